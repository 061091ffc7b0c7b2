"""Links hold: every relative link in README.md and docs/ resolves (file and anchor), every docs/ page the code
names exists with its anchor, and docs/index.md reaches every page."""

from __future__ import annotations

import re

import pytest

from lorakit.errors import recipe_section_link, recipe_sections
from tests.docs.harness import ROOT, discover_pages, rel
from tests.docs.mdlinks import DOC_REF, check_target, is_external, links

PAGES = discover_pages()


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_resolve(page):
    broken = [
        f"{rel(page)}:{line}: {why}"
        for line, target in links(page)
        if not is_external(target) and (why := check_target(page, target, ROOT))
    ]
    assert not broken, "\n".join(broken)


def test_the_code_names_only_pages_and_anchors_that_exist():
    """`doc="docs/X.md#a"` on errors, and every docs/ page a message, docstring or comment mentions."""
    broken = []
    for path in sorted((ROOT / "lorakit").rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for ref in DOC_REF.findall(line):
                why = check_target(ROOT / "README.md", ref, ROOT)
                if why:
                    broken.append(f"{rel(path)}:{n}: {why}")
    assert not broken, "\n".join(broken)


def test_errors_with_a_doc_are_found_by_the_scan():
    """The scan above sees the doc= arguments (a guard against a regex that matches nothing)."""
    sources = "\n".join(p.read_text() for p in (ROOT / "lorakit").rglob("*.py"))
    refs = set(re.findall(r'doc="(docs/[^"]+)"', sources))
    assert {"docs/merge.md#what-is-checked", "docs/qlora.md#install"} <= refs
    assert all(DOC_REF.fullmatch(r) for r in refs)


def test_recipe_errors_link_a_section_that_the_reference_has():
    """RecipeError links docs/recipes.md#SECTION for the field it names, and the reference has a heading for
    every section, the registered objectives' included."""
    for section in recipe_sections():
        link = recipe_section_link(f"invalid recipe:\n  {section}.some_key: unknown key")
        assert link == f"docs/recipes.md#{section}"
        assert check_target(ROOT / "README.md", link, ROOT) is None


def test_the_index_reaches_every_page():
    index = ROOT / "docs" / "index.md"
    linked = {
        (index.parent / target.partition("#")[0]).resolve()
        for _, target in links(index)
        if not is_external(target) and target.partition("#")[0]
    }
    unlisted = [
        rel(p) for p in sorted((ROOT / "docs").glob("*.md")) if p != index and p.resolve() not in linked
    ]
    assert not unlisted, f"docs/index.md does not link: {', '.join(unlisted)}"
    readme = {target.partition("#")[0] for _, target in links(ROOT / "README.md")}
    assert "docs/index.md" in readme


def test_no_merge_conflict_markers_are_left_in_tracked_files():
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    marker = re.compile(r"^(<{7} |>{7} |={7}$)", re.M)
    left = []
    for name in tracked.stdout.splitlines():
        path = ROOT / name
        if path.suffix in {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".sh"} and path.is_file():
            if marker.search(path.read_text(encoding="utf-8", errors="replace")):
                left.append(name)
    assert not left, left
