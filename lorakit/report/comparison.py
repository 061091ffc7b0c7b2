"""lorakit.compare: runs side by side in report.md (tables, notes) and PNG plots."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from lorakit import rundir
from lorakit.report import plots, table
from lorakit.report.objective_metrics import compare_section
from lorakit.report.runs import CompareError, RunRow, read_runs

DEFAULT_OUTPUT = "compare-report"
DEFAULT_GPU_HOUR_PRICE = 4.1
REPORT = "report.md"


@dataclass
class Comparison:
    """What lorakit.compare returns: the runs as read, where report.md and the plots went."""

    rows: list[RunRow]
    output_dir: Path
    report: Path
    plots: dict[str, Path]
    gpu_hour_price: float
    # Why something is missing from the report (no matplotlib, a run without metrics, ...).
    notes: list[str] = field(default_factory=list)

    def table(self) -> str:
        """The main table as aligned text, as the CLI prints it."""
        return table.text(*table.columns(self.rows, self.gpu_hour_price))

    def markdown(self) -> str:
        """The main table as Markdown."""
        return table.markdown(*table.columns(self.rows, self.gpu_hour_price))


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _footnotes(rows: list[RunRow], price: float) -> list[str]:
    notes = [
        "- **tokens/s**: useful (non-pad) training tokens per second of training steps, over all processes "
        "(summary.json `tokens_per_second`).",
        "- **train time**: the training steps only (summary.json `train_seconds`); model loading, data "
        "preparation, evaluation and saving are not included.",
        "- **peak GPU memory**: the largest `torch.cuda.max_memory_allocated` of any process; **peak CPU RSS**: "
        "the largest resident memory of any process (both from summary.json `peak_memory_bytes`).",
        f"- **cost**: train time in hours x processes x ${price:g} per GPU-hour.",
    ]
    if any(r.device == "cpu" for r in rows):
        notes.append(
            f"- \\* CPU run (it recorded no GPU memory): the cost is what its train hours x processes would "
            f"cost as GPU-hours at ${price:g}; it is not the price of the CPU time, and a GPU would have "
            "taken a different time."
        )
    if any(r.device is None for r in rows):
        notes.append(
            "- \\*\\* the run's summary.json does not record memory, so whether it ran on a GPU is unknown; "
            "the cost assumes it did."
        )
    notes.append("- n/a: the run did not record that value.")
    return notes


def render_report(rows: list[RunRow], price: float, drawn: dict[str, Path], notes: list[str]) -> str:
    """report.md: runs, the table with footnotes, the table relative to the first run, plots, notes."""
    lines = ["# lorakit run comparison", ""]
    lines += [
        f"- **{r.label}**: `{_display(r.path)}` ({r.method_label()}, {r.model or 'model n/a'})" for r in rows
    ]
    lines += ["", table.markdown(*table.columns(rows, price)), "", *_footnotes(rows, price), ""]
    if len(rows) > 1:
        lines += [
            f"## Relative to {rows[0].label}",
            "",
            "Ratios run / first run (tokens/s above 1.00x is faster; memory, time and parameters above 1.00x "
            "are more); eval differences are run minus first run (for loss, negative is better).",
            "",
            table.markdown(*table.relative_columns(rows)),
            "",
        ]
    lines += compare_section(rows)
    titles = {
        plots.LOSS: "Loss against training tokens",
        plots.EVAL: "Eval metrics (last evaluation of each run)",
        plots.SPEED_MEMORY: "Throughput, memory and trainable parameters",
    }
    if drawn:
        lines += ["## Plots", ""]
        for name in drawn:
            lines += [f"![{titles[name]}]({name})", ""]
    if notes:
        lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    lines.append(f"Written by `lorakit.compare` (lorakit {rundir.versions()['lorakit']}) on {stamp}.")
    return "\n".join(lines) + "\n"


def _check_output(output: Path) -> None:
    if output.exists() and not output.is_dir():
        raise CompareError(f"--output {output}: exists and is not a directory")


def compare(
    run_dirs: list[str | Path],
    *,
    output: str | Path | None = None,
    gpu_hour_price: float = DEFAULT_GPU_HOUR_PRICE,
) -> Comparison:
    """Compare finished runs of any method: write `output`/report.md (table: method, trainable params, peak
    memory, tokens/s, train time, eval metrics, cost at `gpu_hour_price` per GPU-hour) and PNG plots (loss vs
    tokens, eval metrics, throughput and memory). Every run is read before anything is written; a path that
    is not a finished run raises CompareError. output defaults to ./compare-report."""
    if isinstance(gpu_hour_price, bool) or not isinstance(gpu_hour_price, (int, float)):
        raise CompareError(f"gpu_hour_price: expected a number, got {gpu_hour_price!r}")
    if not math.isfinite(gpu_hour_price) or gpu_hour_price < 0:
        raise CompareError(f"gpu_hour_price: must be a finite number >= 0, got {gpu_hour_price}")
    rows = read_runs(run_dirs)
    out = Path(output if output is not None else DEFAULT_OUTPUT).expanduser().resolve()
    _check_output(out)
    notes = [f"{r.label}: {n}" for r in rows for n in r.notes]
    missing = plots.matplotlib_missing()
    out.mkdir(parents=True, exist_ok=True)
    if missing:
        notes.append(f"no plots: {missing}")
        for name in plots.ALL:
            (out / name).unlink(missing_ok=True)
        drawn: dict[str, Path] = {}
    else:
        drawn = plots.draw_all(rows, out)
    report = out / REPORT
    rundir.write_text(report, render_report(rows, float(gpu_hour_price), drawn, notes))
    return Comparison(rows, out, report, drawn, float(gpu_hour_price), notes)
