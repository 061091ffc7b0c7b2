"""Packed vs dynamically padded causal-LM training in lorakit: useful tokens per second over one epoch, the
packed budget chosen by a sweep (specs/causal_packing.yaml; commands and results: benchmarks/README.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script: the harness and this lorakit

from benchmarks.harness import load_spec, main, plots  # noqa: E402
from benchmarks.harness.runner import claims, first_of, token_checks  # noqa: E402

SPEC = load_spec("causal_packing")
MICRO_BATCH = SPEC["recipe"]["train"]["micro_batch_size"]


def per_budget(budget: int, runs: list[dict]) -> dict:
    """What a budget of the sweep packs: examples per row, the sampler's fill."""
    r = runs[0]
    fill = r["batching"].get("sampler_efficiency_epoch0")
    return {"examples_per_row_mean": r["examples"] / r["micro_batches"], "sampler_efficiency": fill}


def measure(bench) -> int:
    args, spec, log = bench.args, bench.spec, bench.log
    sides, comparisons = ["padded_random", "padded_grouped", "packed"], spec["comparisons"]

    def run(side: str, budget: int | None, label: str | None = None) -> dict:
        budget = budget if bench.packing(side) else None
        return bench.run(side, label, {"train.max_tokens": budget} if budget else {}, max_tokens=budget)

    data = bench.prepare("padded_random")
    log(data.describe())
    max_length, data_tokens = data.lengths.max_length, int(sum(data.train["length"]))
    budgets = sorted(set(args.budgets if args.max_tokens is None else [args.max_tokens]))
    short = [b for b in budgets if b < max_length]
    if short:
        why = "packing would truncate examples and the sides would not train on the same tokens"
        why = f"error: budgets {short} are below the longest example ({max_length} tokens): {why}"
        print(why, file=sys.stderr)
        return 2
    for b in budgets:
        bench.prepare("packed", {"train.max_tokens": b})

    budget_sweep = matched = None
    chosen = args.max_tokens
    if args.max_tokens is None:
        budget_sweep = bench.sweep(budgets, lambda b: run("packed", b, f"sweep_{b}"), per_budget)
        chosen = budget_sweep["best"]
        log(f"chosen budget: {chosen} tokens per packed row")
        # The budget whose optimizer steps hold about as many tokens as a padded micro-batch: packing at
        # (about) the same batch size, where a larger chosen budget means fewer, bigger optimizer steps.
        padded = data_tokens / (args.max_samples / MICRO_BATCH)
        packed = {b: budget_sweep["per_budget"][str(b)]["useful_tokens_per_optimizer_step"] for b in budgets}
        matched = min(budgets, key=lambda b: abs(packed[b] - padded))
        match = {"budget": matched, "padded_useful_tokens_per_optimizer_step": padded}
        match["packed_useful_tokens_per_optimizer_step"] = packed[matched]
        budget_sweep["matched_to_padded_batch"] = match
        if matched != chosen:
            sides.insert(sides.index("packed") + 1, "packed_matched")
            comparisons = comparisons + spec["matched_comparisons"]
            log(f"packed_matched: budget {matched}, about as many tokens per optimizer step as padded")
    own = {"packed_matched": matched}  # the other packed sides run at the chosen budget
    budget_of = {s: own.get(s, chosen) if bench.packing(s) else None for s in sides}
    runs = bench.rounds(sides, args.repeats, lambda s, _: run(s, budget_of[s]))

    every = runs + (budget_sweep["runs"] if budget_sweep else [])
    label = lambda r: f"{r['side']}@{r['max_tokens']}" if r["max_tokens"] else r["side"]  # noqa: E731
    checks = token_checks(every, args.max_samples, label)
    valid = checks["useful_tokens_equal_on_all_runs"] and checks["each_example_once"]
    medians, ratios = bench.summarise(runs, sides, comparisons)
    (c,) = claims(spec["claims"], ratios, medians, valid)  # packed against padded_random
    fields = {"claim": c["text"], "claim_ratio": c["ratio_at_least"], "claim_met": c["claim_met"]}
    fields.update(headline={"side": c["side"], "versus": c["versus"]}, headline_ratio=c["measured_ratio"])
    fields["headline_paired_median"] = c["paired_median"]
    fields.update(chosen_max_tokens=chosen, matched_max_tokens=matched, max_tokens=budget_of)
    result = bench.result(**fields)  # these first, as before the common blocks
    data_setup = {k: v for k, v in spec["recipe"]["data"].items() if k != "max_length"}
    data_setup.update(rows=args.max_samples, max_length=max_length, max_length_from=spec["max_length_from"])
    data_setup.update(tokens=data_tokens)
    data_setup.update({k: data.stats.get(k) for k in ("loss_tokens", "tokens_untruncated", "overlong")})
    how = "chosen by the budget sweep" if budget_sweep else "given with --max-tokens, no sweep"
    more = {"zero_stage": first_of(runs, sides, "zero_stage"), "evaluation": "disabled", "saving": "disabled"}
    setup = bench.setup(every, sides, data_setup, **more)
    described = bench.describe(sides, chosen=chosen, matched=matched, how=how)
    result.update(setup=setup, sides=described, checks=checks)
    firsts = ("optimizer_steps", "useful_tokens_per_optimizer_step")
    result.update(bench.per_side(runs, sides, checks["useful_tokens_equal_on_all_runs"], medians, firsts))
    result.update(medians=medians, ratios=ratios, budget_sweep=budget_sweep, runs=runs)
    return bench.finish(result, valid)


def plot(result: dict, plt):
    """Useful tokens/s per side (ratios and padding efficiency above the bars) and the budget sweep."""
    fig, axes, sides, swept = plots.side_and_sweep_panels(plt, result, "budget_sweep", "budgets", scale=1.45)
    labels = plots.budget_labels(result, SPEC, sides)

    plots.speed_bars(axes[0], result, labels)
    if swept:
        plots.sweep_bars(axes[1], swept, SPEC["sweep"])
    return fig


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
