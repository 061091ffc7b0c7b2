"""Charts of results: matplotlib is optional (without it the JSON is written and the chart is skipped)."""

from __future__ import annotations

from pathlib import Path

NOTE = {"xytext": (0, 4), "textcoords": "offset points", "ha": "center", "va": "bottom"}


def render(module, result: dict, path: Path) -> bool:
    """Saves `module.plot(result, plt)` as a PNG at `path`; False without matplotlib or a figure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = module.plot(result, plt)
    if fig is None:
        return False
    if "chart_title" in module.SPEC:
        fig.suptitle(title(result, module.SPEC["chart_title"]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def title(result: dict, text: str) -> str:
    """`text` filled from the result's setup, then the machine and the versions it ran on."""
    setup, v = result["setup"], result["versions"]
    threads = "/".join(map(str, setup["torch_threads"]))
    zero = "/".join(str(z) for z in sorted(set(setup.get("zero_stage", {}).values())))
    what = text.format(setup=setup, threads=threads, zero=zero)
    versions = f"torch {v['torch']}, transformers {v['transformers']}, deepspeed {v['deepspeed']}"
    return f"{what}, CPU ({result['machine']['cpu_count']} cores), {versions}"


def panels(plt, widths: list[int], height: float = 4.8, scale: float = 1.4):
    """A figure with one row of panels of the given relative widths; (figure, list of axes)."""
    size = (scale * sum(widths) + 1, height)
    grid = {"width_ratios": widths}
    fig, axes = plt.subplots(1, len(widths), figsize=size, squeeze=False, gridspec_kw=grid)
    return fig, list(axes[0])


def side_and_sweep_panels(
    plt, result: dict, sweep: str, items: str, side_panels: int = 1, scale: float = 1.4
):
    """`side_panels` panels of the sides, then one of the sweep if any: (figure, axes, sides, sweep)."""
    sides, swept = list(result["medians"]), result.get(sweep)
    widths = [len(sides) + 1] * side_panels + ([len(swept[items]) + 1] if swept else [])
    return (*panels(plt, widths, scale=scale), sides, swept)


def bars(ax, labels, heights, dots, notes, title: str, color=None, fontsize: int = 8) -> None:
    """One bar per item (its median), a dot per run, a note above each bar."""
    for i, (height, runs, note) in enumerate(zip(heights, dots, notes, strict=True)):
        ax.bar(i, height, color=color or f"C{i}", alpha=0.8 if color is None else 0.6)
        ax.scatter([i] * len(runs), runs, color="black", s=12, zorder=3)
        if note:
            ax.annotate(note, (i, max([height, *runs])), fontsize=fontsize, **NOTE)
    ax.set_xticks(range(len(labels)), labels, fontsize=fontsize)
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.25)


def side_bars(ax, result: dict, metric: str, title: str, labels: dict, notes, fontsize: int = 8) -> None:
    """`bars` of `metric` per side of a result: medians, runs, and `notes(side)` above each side."""
    sides = list(result["medians"])
    runs = [[r[metric] for r in result["runs"] if r["side"] == s] for s in sides]
    heights, texts = [result["medians"][s][metric] for s in sides], [notes(s) for s in sides]
    bars(ax, [labels[s] for s in sides], heights, runs, texts, title, fontsize=fontsize)


def budget_labels(result: dict, spec: dict, sides: list[str]) -> dict:
    """{side: its label in the spec, with its packed rows' token budget if it has one}."""
    budget = result["max_tokens"]
    own = {s: f"\nmax_tokens {budget[s]}" for s in sides if budget.get(s)}
    return {s: spec["sides"][s]["label"] + own.get(s, "") for s in sides}


def speed_bars(ax, result: dict, labels: dict, efficiency="padding efficiency", fontsize=8, name=str) -> None:
    """Useful tokens/s of each side, its ratios ('x1.23 vs OTHER') and padding efficiency above it."""

    def notes(side: str) -> str:
        mine = [r for r in result["ratios"].values() if r["side"] == side]
        lines = [f"x{r['useful_tokens_per_second']:.2f} vs {name(r['versus'])}" for r in mine]
        lines += [f"{efficiency} {result['padding_efficiency'][side]:.2f}"] if efficiency else []
        return "\n".join(lines)

    title = "useful tokens / s (bars: median, dots: runs)"
    side_bars(ax, result, "useful_tokens_per_second", title, labels, notes, fontsize)


def sweep_bars(ax, swept: dict, spec: dict) -> None:
    """A sweep's candidates (`spec`: the spec's `sweep`): the median of the metric it chooses by, its runs, its
    padding efficiency, steps and eval loss above it, and which one was chosen."""
    items, per, metric = swept[spec["items"]], swept[spec["per"]], spec["choose"]["best"]
    dots = [[r[metric] for r in swept["runs"] if r[spec["key"]] == x] for x in items]
    labels = [f"{x}{' (chosen)' if x == swept['best'] else ''}" for x in items]
    heights, notes = [per[str(x)][metric] for x in items], []
    for p in (per[str(x)] for x in items):
        loss = f"\neval {p['eval_loss']:.3f}" if p.get("eval_loss") is not None else ""
        notes.append(f"eff. {p['padding_efficiency']:.2f}\n{p['optimizer_steps']} steps{loss}")
    title = f"{spec['chart']['title']} ({swept['repeats']} round(s))"
    bars(ax, labels, heights, dots, notes, title, color="C2", fontsize=7)
    ax.set_xlabel(spec["chart"]["xlabel"], fontsize=8)
