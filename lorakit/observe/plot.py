"""run_dir/loss.png: the training and eval loss against the optimizer step, drawn from metrics.jsonl.

matplotlib (a core dependency, for lorakit.compare) is imported here only, through its object API with the
Agg canvas: no pyplot state, no display needed.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

from lorakit import rundir, storage


def loss_curves(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """{"train": (steps, losses), "eval": (steps, losses)} of the finite losses in metric records."""
    curves: dict[str, tuple[list[int], list[float]]] = {"train": ([], []), "eval": ([], [])}
    for r in records:
        loss = r.get("loss")
        if r.get("kind") in curves and isinstance(loss, int | float) and math.isfinite(loss):
            curves[r["kind"]][0].append(int(r["step"]))
            curves[r["kind"]][1].append(float(loss))
    return curves


def plot_losses(run_dir: Path) -> Path | None:
    """Draw run_dir/loss.png from run_dir/metrics.jsonl (durably: save_figure); None when no step was
    logged."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curves = loss_curves(rundir.read_metrics(run_dir))
    if not curves["train"][0]:
        return None
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(*curves["train"], label="train loss", linewidth=1)
    if curves["eval"][0]:
        ax.plot(*curves["eval"], "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (per target token)")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = run_dir / rundir.LOSS_PLOT
    save_figure(fig, out)
    return out


def save_figure(fig, path: Path, **options) -> None:
    """Write a matplotlib figure as a PNG at `path` the way lorakit writes every file: rendered to bytes in
    memory, then storage.write_file (temp, fsync, rename, fsync of the directory), so after a crash or a
    power loss `path` is the old picture or the new one, never a short one. `options`: savefig's (dpi). A
    full disk is a DiskFullError naming the file."""
    png = io.BytesIO()
    fig.savefig(png, format="png", **options)
    with storage.writing(path.name, path):
        storage.write_file(path, png.getvalue())
