"""The sample-output check itself (tests/docs/samples.py): it passes the output a sample describes and
catches one that no longer matches (a changed number's form, a new or missing line, another label)."""

from __future__ import annotations

from tests.conftest import ROOT
from tests.docs.samples import mismatches, sample_after

SAMPLE = [
    "run dir:  /path/to/runs/quickstart",
    "loss:     X.XXXX -> X.XXXX over 32 steps",
    "plot:     /path/to/runs/quickstart/loss.png",
]
PRINTED = [
    "run dir:  /tmp/x/runs/quickstart",
    "loss:     8.1192 -> 5.5800 over 32 steps",
    "plot:     /tmp/x/runs/quickstart/loss.png",
]


def test_a_matching_output_passes():
    assert mismatches(SAMPLE, PRINTED) == []


def test_the_runs_own_folder_is_shown_as_the_samples():
    printed = [line.replace("/tmp/x/runs/quickstart", "/tmp/t/run") for line in PRINTED]
    assert mismatches(SAMPLE, printed)
    assert mismatches(SAMPLE, printed, {"/tmp/t/run": "/path/to/runs/quickstart"}) == []


def test_a_sample_that_no_longer_matches_is_caught():
    assert mismatches(SAMPLE, PRINTED[:2])  # the command prints a line the sample lacks
    assert mismatches(SAMPLE, [PRINTED[0], "loss:     8.1192 -> 5.5800 over 33 steps", PRINTED[2]])
    assert mismatches(SAMPLE[:1] + ["loss:     8.1542 -> 5.6537 over 32 steps"] + SAMPLE[2:], PRINTED)
    assert mismatches(SAMPLE, [PRINTED[0], PRINTED[1], "saved:    /tmp/x/runs/quickstart/adapter"])


def test_the_quickstart_sample_is_written_in_the_checked_form():
    sample = sample_after(ROOT / "docs" / "index.md", "python -m lorakit.run recipes/quickstart.yaml")
    assert sample[0].startswith("run dir:  /path/to/") and "X.XXXX" in sample[1], sample


def test_every_test_the_fault_tables_name_exists():
    """docs/faults.md's `test` column and prose name tests by function, module or path: each must exist."""
    import re

    text = (ROOT / "docs" / "faults.md").read_text(encoding="utf-8")
    tests = ROOT / "tests"
    defined = {
        m for p in tests.rglob("*.py") for m in re.findall(r"def (test_\w+)", p.read_text(encoding="utf-8"))
    }
    modules = {p.stem for p in tests.rglob("*.py")}
    missing = sorted(t for t in set(re.findall(r"\btest_\w+", text)) if t not in defined | modules)
    assert not missing, f"docs/faults.md names tests that do not exist: {missing}"
