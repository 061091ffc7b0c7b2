"""The comparison table: one row per run, as Markdown (report.md) and as aligned text (the terminal)."""

from __future__ import annotations

from lorakit.recipe.known_objectives import specs
from lorakit.report.runs import RunRow, loss_name

NA = "n/a"
# Eval metrics that are lower-is-better; every other (ROUGE, accuracy, exact match, DPO's margin) is
# higher-is-better, but for DPO's rewards, which are neither (both may fall while the margin grows).
LOWER_IS_BETTER = {loss_name(spec) for spec in specs()}
NO_DIRECTION = {"rewards/chosen", "rewards/rejected"}


def fmt_count(n: int | float | None) -> str:
    """12345678 -> 12.3M."""
    if n is None:
        return NA
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


def fmt_bytes(n: int | None) -> str:
    """Binary units, as memory is sold: 1536 MiB -> 1.50 GiB."""
    if n is None:
        return NA
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def fmt_seconds(s: float | None) -> str:
    """Seconds below 2 minutes, then minutes below 2 hours, then hours."""
    if s is None:
        return NA
    if s < 120:
        return f"{s:.3g} s"
    if s < 7200:
        return f"{s / 60:.3g} min"
    return f"{s / 3600:.3g} h"


def fmt_float(x: float | None, digits: int = 4) -> str:
    return NA if x is None else f"{x:.{digits}f}"


def fmt_rate(x: float | None) -> str:
    return NA if x is None else f"{x:,.0f}"


def fmt_money(x: float | None) -> str:
    if x is None:
        return NA
    return f"${x:,.2f}" if x >= 1 else f"${x:.3g}"


def fmt_ratio(x: float | None) -> str:
    return NA if x is None else f"{x:.2f}x"


def eval_names(rows: list[RunRow]) -> list[str]:
    """Every eval metric any run recorded: loss first, then the others in first-seen order."""
    names: list[str] = []
    for row in rows:
        names += [k for k in row.eval if k not in names]
    return sorted(names, key=lambda k: (k != "loss", names.index(k)))


def cost_cell(row: RunRow, price: float) -> str:
    cell = fmt_money(row.cost(price))
    if row.device == "cpu" and cell != NA:
        return cell + " *"
    if row.device is None and cell != NA:
        return cell + " **"
    return cell


def columns(rows: list[RunRow], price: float) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the main table."""
    metrics = eval_names(rows)
    header = [
        "run",
        "method",
        "model",
        "processes",
        "trainable params",
        "peak GPU memory",
        "peak CPU RSS",
        "tokens/s",
        "train time",
        "steps",
        "train loss first -> last",
        *[f"eval {m}" for m in metrics],
        f"cost at ${price:g}/GPU-h",
    ]
    cells = []
    for r in rows:
        share = r.trainable_share()
        params = fmt_count(r.trainable_params) + (f" ({share:.1%})" if share is not None else "")
        loss = f"{fmt_float(r.loss_first)} -> {fmt_float(r.loss_last)}"
        if r.loss_first is None and r.loss_last is None:
            loss = NA
        elif r.loss_label is not None:
            loss += f" ({r.loss_label})"
        cells.append(
            [
                r.label,
                r.method_label(),
                r.model or NA,
                NA if r.world_size is None else str(r.world_size),
                params,
                fmt_bytes(r.peak_gpu_bytes),
                fmt_bytes(r.peak_cpu_rss_bytes),
                fmt_rate(r.tokens_per_second),
                fmt_seconds(r.train_seconds),
                NA if r.steps is None else str(r.steps),
                loss,
                *[fmt_float(r.eval.get(m), 4 if m in LOWER_IS_BETTER else 2) for m in metrics],
                cost_cell(r, price),
            ]
        )
    return header, cells


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def relative_columns(rows: list[RunRow]) -> tuple[list[str], list[list[str]]]:
    """Every run against the first one: ratios of speed, memory, time and trainable parameters, and the
    difference in eval metrics."""
    ref = rows[0]
    metrics = eval_names(rows)
    header = [
        "run",
        "tokens/s",
        "peak GPU memory",
        "peak CPU RSS",
        "train time",
        "trainable params",
        *[f"eval {m} diff" for m in metrics],
    ]
    cells = []
    for r in rows:
        diffs = []
        for m in metrics:
            a, b = r.eval.get(m), ref.eval.get(m)
            diffs.append(NA if a is None or b is None else f"{a - b:+.4f}")
        cells.append(
            [
                r.label,
                fmt_ratio(_ratio(r.tokens_per_second, ref.tokens_per_second)),
                fmt_ratio(_ratio(r.peak_gpu_bytes, ref.peak_gpu_bytes)),
                fmt_ratio(_ratio(r.peak_cpu_rss_bytes, ref.peak_cpu_rss_bytes)),
                fmt_ratio(_ratio(r.train_seconds, ref.train_seconds)),
                fmt_ratio(_ratio(r.trainable_params, ref.trainable_params)),
                *diffs,
            ]
        )
    return header, cells


def markdown(header: list[str], cells: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table (pipes in cells escaped)."""

    def line(values):
        return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *map(line, cells)])


def text(header: list[str], cells: list[list[str]]) -> str:
    """An aligned plain-text table for the terminal: text columns left, numbers right."""
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    numeric = [
        all(c[i] == NA or c[i][:1].isdigit() or c[i][:1] in "$+-" for c in cells) for i in range(len(header))
    ]

    def line(values):
        return "  ".join(
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *map(line, cells)])
