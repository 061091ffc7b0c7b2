"""Markdown as GitHub reads it, just enough to check links: heading anchors and the links of a page."""

from __future__ import annotations

import re
from pathlib import Path

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"""<a\s+(?:id|name)=["']([^"']+)["']""")
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
DOC_REF = re.compile(r"docs/[A-Za-z0-9_./-]+?\.md(?:#[A-Za-z0-9_-]+)?")


def unfenced_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            if fence is None:
                fence = m[1]
            elif m[1][0] == fence[0] and len(m[1]) >= len(fence):
                fence = None
            continue
        if fence is None:
            out.append((n, line))
    return out


def prose_lines(text: str) -> list[tuple[int, str]]:
    """unfenced_lines with inline code spans blanked (a link inside `code` is not a link)."""
    return [(n, _CODE_SPAN.sub(lambda s: " " * len(s[0]), line)) for n, line in unfenced_lines(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not - or _), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a page: its headings (repeats get -1, -2, as on GitHub) and <a id/name> tags."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = path.read_text(encoding="utf-8")
    for _, line in unfenced_lines(text):
        m = _HEADING.match(line)
        if m:
            base = slug(m[2])
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    found.update(_HTML_ANCHOR.findall(text))
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every inline link, image and reference definition outside code."""
    out = []
    for n, line in prose_lines(path.read_text(encoding="utf-8")):
        out += [(n, t) for t in _INLINE_LINK.findall(line)]
        m = _REF_DEF.match(line)
        if m:
            out.append((n, m[1]))
    return out


def is_external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I))


def check_target(page: Path, target: str, root: Path) -> str | None:
    """Why a relative link (or a `docs/X.md#a` reference from `root`) does not resolve; None when it does."""
    path_part, _, anchor = target.partition("#")
    dest = page if not path_part else (page.parent / path_part).resolve()
    if path_part and not (dest == root or root in dest.parents):
        return f"{target}: points outside the repository"
    if not dest.exists():
        return f"{target}: no such file"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{target}: {dest.name} has no heading with anchor #{anchor}"
    return None
