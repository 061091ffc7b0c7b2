"""One launch, independent checks: a worker script runs every check of its launch, recording a failure
instead of ending the launch with it, and the test side has one test per check that reads that check's own
result (docs/contributing.md#tests). A launch's start-up is paid once, and no failure hides another.

A check that raises on every rank (what a bug in the code under test does: the ranks run the same code)
leaves the group in step for the next one. One that raises on one rank only leaves a collective unmatched:
the next collective then fails or times out on every rank (the process group's timeout), and the tests of
the checks left unrun fail with the launch's output.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path


def failure(fn: Callable[[], object]) -> str | None:
    """Runs `fn`: None when it returns, else its traceback (printed too), so that the launch goes on."""
    try:
        fn()
    except Exception:
        traceback.print_exc()
        return traceback.format_exc()
    return None


def run_checks(out: str | Path, checks: dict[str, Callable[[], None]]) -> None:
    """Runs each check in turn; one that raises leaves OUT/NAME.rankR.error (its traceback) and the next runs."""
    for name, check in checks.items():
        if error := failure(check):
            Path(out, f"{name}.rank{os.environ.get('RANK', '0')}.error").write_text(error)


def check_ran(out: str | Path, name: str, launch_output: str = "") -> None:
    """Fails the calling test with the check's traceback when it raised in the worker, or with the end of the
    launch's output when it never wrote OUT/NAME.json (the launch died before it)."""
    import pytest

    errors = sorted(Path(out).glob(f"{name}.rank*.error"))
    if errors:
        pytest.fail(
            f"{name} raised in the worker:\n" + "\n".join(e.read_text()[-4000:] for e in errors), False
        )
    if not Path(out, f"{name}.json").is_file():
        pytest.fail(f"{name} never ran; the launch's output ends:\n{launch_output[-6000:]}", pytrace=False)
