"""The comparison's PNG plots: training (and eval) loss against tokens, eval metrics, throughput and memory.

matplotlib is imported here only, lazily, with the Agg backend (no display needed)."""

from __future__ import annotations

import itertools
from pathlib import Path

from lorakit.observe.plot import save_figure
from lorakit.report.runs import RunRow
from lorakit.report.table import LOWER_IS_BETTER, NO_DIRECTION, eval_names, fmt_count

LOSS = "loss.png"
EVAL = "eval.png"
SPEED_MEMORY = "speed_memory.png"
ALL = (LOSS, EVAL, SPEED_MEMORY)


def matplotlib_missing() -> str | None:
    """Why plots cannot be drawn (matplotlib is not installed), or None when they can."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    return None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numbers(records: list[dict], key: str) -> bool:
    return all(_is_number(r.get(key)) for r in records)


def loss_axis(rows: list[RunRow]) -> str:
    """The x axis all loss curves can share: `tokens` (cumulative useful tokens, when every record carries
    them), `target tokens` (the loss tokens of every step summed, when every step was logged), else `step`."""
    runs = [r.train_records for r in rows if r.train_records]
    if runs and all(_numbers(recs, "tokens") for recs in runs):
        return "tokens"
    contiguous = all([rec.get("step") for rec in recs] == list(range(1, len(recs) + 1)) for recs in runs)
    if runs and contiguous and all(_numbers(recs, "target_tokens") for recs in runs):
        return "target tokens"
    return "step"


def loss_points(row: RunRow, axis: str) -> tuple[list[float], list[float], dict[int, float]]:
    """(x, training loss) of every logged step, and {step: x} to place eval points on the same axis."""
    xs: list[float] = []
    if axis == "tokens":
        xs = [float(r["tokens"]) for r in row.train_records]
    elif axis == "target tokens":
        xs = list(itertools.accumulate(float(r["target_tokens"]) for r in row.train_records))
    else:
        xs = [
            float(r["step"]) if _is_number(r.get("step")) else i + 1.0
            for i, r in enumerate(row.train_records)
        ]
    ys = [float(r["loss"]) for r in row.train_records]
    at_step = {
        int(r["step"]): x for r, x in zip(row.train_records, xs, strict=True) if _is_number(r.get("step"))
    }
    return xs, ys, at_step


AXIS_LABELS = {
    "tokens": "training tokens seen (non-pad)",
    "target tokens": "target (loss) tokens seen",
    "step": "optimizer step (runs did not all log tokens for every step)",
}


def plot_loss(rows: list[RunRow], path: Path) -> bool:
    """Training loss (lines) and eval loss (markers) against tokens; False when no run logged a loss."""
    drawn = [r for r in rows if r.train_records]
    if not drawn:
        return False
    plt = _pyplot()
    axis = loss_axis(drawn)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, row in enumerate(drawn):
        xs, ys, at_step = loss_points(row, axis)
        ax.plot(xs, ys, color=f"C{i}", lw=1.2, label=f"{row.label} ({row.method_label()}) train")
        evals = [
            (at_step[int(e["step"])], float(e["loss"]))
            for e in row.eval_records
            if _is_number(e.get("loss")) and _is_number(e.get("step")) and int(e["step"]) in at_step
        ]
        if evals:
            ex, ey = zip(*evals, strict=True)
            ax.plot(ex, ey, "o--", color=f"C{i}", ms=6, lw=0.8, label=f"{row.label} eval")
    ax.set_xlabel(AXIS_LABELS[axis])
    ax.set_ylabel("loss (mean per target token)")
    ax.set_title("loss vs training tokens" if axis != "step" else "loss vs step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path, plt)
    return True


def _bars(ax, rows: list[RunRow], values: list, title: str, fmt, log: bool = False) -> None:
    """One bar per run in the run's colour, its value above it, n/a where the run has none."""
    for i, v in enumerate(values):
        if v is None:
            ax.annotate("n/a", (i, 0), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=8)
            continue
        ax.bar(i, v, color=f"C{i}")
        ax.annotate(fmt(v), (i, v), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=8)
    if log and any(v for v in values):
        ax.set_yscale("log")
    elif all(v is None or v >= 0 for v in values):
        ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.set_xticks(range(len(rows)), [r.label for r in rows], rotation=20, fontsize=8)
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.margins(y=0.15)


def _grid(plt, panels: int):
    cols = min(panels, 4)
    rows = -(-panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols + 1, 3.6 * rows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[panels:]:
        ax.set_visible(False)
    return fig, flat[:panels]


def plot_eval(rows: list[RunRow], path: Path) -> bool:
    """One panel per eval metric, a bar per run (its last evaluation); False when no run evaluated."""
    metrics = eval_names(rows)
    if not metrics:
        return False
    plt = _pyplot()
    fig, axes = _grid(plt, len(metrics))
    for ax, metric in zip(axes, metrics, strict=True):
        better = "lower" if metric in LOWER_IS_BETTER else "higher"
        title = f"eval {metric}" if metric in NO_DIRECTION else f"eval {metric} ({better} is better)"
        _bars(ax, rows, [r.eval.get(metric) for r in rows], title, "{:.4g}".format)
    _save(fig, path, plt)
    return True


def plot_speed_memory(rows: list[RunRow], path: Path) -> bool:
    """Bars of tokens/s, peak GPU memory (if any run has it), peak CPU RSS and trainable parameters."""

    def gib(n):
        return None if n is None else n / 2**30

    panels = [("tokens/s", [r.tokens_per_second for r in rows], "{:,.0f}".format, False)]
    if any(r.peak_gpu_bytes is not None for r in rows):
        panels.append(
            ("peak GPU memory (GiB)", [gib(r.peak_gpu_bytes) for r in rows], "{:.3g}".format, False)
        )
    if any(r.peak_cpu_rss_bytes is not None for r in rows):
        panels.append(
            ("peak CPU RSS (GiB)", [gib(r.peak_cpu_rss_bytes) for r in rows], "{:.3g}".format, False)
        )
    panels.append(("trainable parameters (log scale)", [r.trainable_params for r in rows], fmt_count, True))
    plt = _pyplot()
    fig, axes = _grid(plt, len(panels))
    for ax, (title, values, fmt, log) in zip(axes, panels, strict=True):
        _bars(ax, rows, values, title, fmt, log)
    _save(fig, path, plt)
    return True


def _save(fig, path: Path, plt) -> None:
    # Durably, like every file lorakit writes: a reader never sees half a PNG, a power loss leaves none.
    fig.tight_layout()
    try:
        save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)


def draw_all(rows: list[RunRow], output: Path) -> dict[str, Path]:
    """Draw every plot there is data for into `output`; returns {file name: path}. A plot with nothing to
    show is not drawn, and an old copy of it is removed so the directory never mixes two comparisons."""
    drawn = {}
    for name, draw in ((LOSS, plot_loss), (EVAL, plot_eval), (SPEED_MEMORY, plot_speed_memory)):
        path = output / name
        if draw(rows, path):
            drawn[name] = path
        else:
            path.unlink(missing_ok=True)
    return drawn
