"""`preflight.doctor: true`: the quick doctor before training, in the launching process once the run lock
is held. A failed check stops the run (PreflightFailed, exit code 3) before the training model is loaded
(the data may be tokenized already: the run time estimate reads it, and training then finds it cached); the
report is in output.dir/doctor."""

from __future__ import annotations

from pathlib import Path

from lorakit.errors import LorakitError

REPORT_DIR = "doctor"


class PreflightFailed(LorakitError):
    """A check of `preflight.doctor` failed on this machine: not bad input, a machine that would train
    wrongly or not at all, so its own exit code."""

    exit_code = 3
    doc = "docs/doctor.md#before-every-run-preflightdoctor"


def run_preflight(recipe) -> None:
    """Run the quick doctor for `recipe`, print its table, write its report to output.dir/doctor; raise
    PreflightFailed naming the failed checks and what to do."""
    from lorakit.doctor.core import run_doctor

    out = Path(recipe.output.dir).expanduser().resolve() / REPORT_DIR
    report = run_doctor(recipe, quick=True, output=out)
    print(report.table(), flush=True)
    if report.ok:
        return
    lines = [
        f"{c.section}/{c.name}: {c.detail}" + (f"; do: {c.action}" if c.action else "")
        for c in report.failures
    ]
    raise PreflightFailed(
        f"preflight.doctor: {len(lines)} check(s) failed on this machine, nothing was trained (report: "
        f"{out / 'doctor.md'}):\n  " + "\n  ".join(lines)
    )
