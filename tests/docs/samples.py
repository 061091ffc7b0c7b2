"""Sample outputs in the docs, checked against what the code prints: a ```text block right after the ```bash
block of a command is that command's output. A number that changes from run to run is written `X.XXXX`
(any number with 4 decimals), a machine's path as `/path/to/...`; everything else must be as printed,
line for line. The test that runs the command (its covered-by test) calls `mismatches`."""

from __future__ import annotations

import re
from pathlib import Path

NUMBER, PATH = "X.XXXX", "/path/to/"


def sample_after(page: Path, command: str) -> list[str]:
    """The lines of the ```text block that follows the ```bash block holding `command` on `page`."""
    text = page.read_text(encoding="utf-8")
    at = text.index(command)
    block = re.compile(r"```text\n(.*?)```", re.S).search(text, at)
    assert block is not None, f"{page.name}: no sample output after {command!r}"
    return block[1].rstrip("\n").splitlines()


def _pattern(line: str) -> re.Pattern:
    parts = re.split(f"({re.escape(NUMBER)}|{re.escape(PATH)})", line)
    regex = "".join(
        r"-?\d+\.\d{4}" if p == NUMBER else r"(?:/[^/\s]+)*/" if p == PATH else re.escape(p) for p in parts
    )
    return re.compile(regex)


def mismatches(sample: list[str], printed: list[str], paths: dict[str, str] | None = None) -> list[str]:
    """The sample's lines that the printed output does not have (in order), and printed lines it lacks.
    `paths`: {the run's real path: the path the sample shows for it} (a test's output.dir is not the doc's)."""
    for real, shown in (paths or {}).items():
        printed = [line.replace(real, shown) for line in printed]
    problems = []
    if len(sample) != len(printed):
        problems.append(f"the sample has {len(sample)} lines, the command printed {len(printed)}")
    for want, got in zip(sample, printed, strict=False):
        if not _pattern(want).fullmatch(got):
            problems.append(f"sample {want!r} vs printed {got!r}")
    return problems
