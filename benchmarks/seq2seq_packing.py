"""Packed vs padded encoder-decoder (T5) training in lorakit: useful tokens per second over one epoch, and the
eval loss after it.

    python benchmarks/seq2seq_packing.py [--dataset dialogues|news] [--repeats K] [--examples-per-step N]
                                         [--examples-per-row 8,16,32] [--sweep-repeats K] [--smoke] ...
    python benchmarks/seq2seq_packing.py --plot-only benchmarks/results/seq2seq_packing.json

Four ways to batch the same (source, summary) pairs at the same examples per optimizer step (padded random,
padded grouped, rows of k random examples with k swept, rows filled to a token budget); round r trains every
side with seed 42 + r and evaluates after its epoch. specs/seq2seq_packing.yaml; benchmarks/README.md.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script: the harness and this lorakit

from benchmarks.harness import load_spec, main, plots  # noqa: E402
from benchmarks.harness.runner import claims, first_of, token_checks  # noqa: E402

SPEC = load_spec("seq2seq_packing")
MICRO_BATCH = SPEC["recipe"]["train"]["micro_batch_size"]
SIDES = list(SPEC["sides"])


def default_output(args) -> str:
    return SPEC["datasets"][args.dataset]["output"]


def check_args(args, error) -> None:
    args.examples_per_row = sorted(set(args.examples_per_row))
    bad = [k for k in args.examples_per_row if args.examples_per_step % k]
    if bad:
        error(f"--examples-per-row {bad} must divide --examples-per-step {args.examples_per_step}")
    uneven = [k for k in args.examples_per_row if args.max_samples % k]
    if uneven:
        # A last row short of k random examples would be filled with repeats: counts would differ.
        error(f"--max-samples {args.max_samples} must be a multiple of every --examples-per-row {uneven}")


def rows_at(budget: int, sources: list[int], targets: list[int]) -> int:
    """Packed rows of one epoch at encoder budget `budget` (decoder budget: lorakit's default), as lorakit
    packs them on one process."""
    from lorakit.data.multipack_seq2seq import Seq2SeqMultipackBatchSampler, default_max_target_tokens

    max_target = default_max_target_tokens(sources, targets, budget)
    return len(Seq2SeqMultipackBatchSampler(sources, targets, budget, max_target, num_replicas=1))


def packed_candidates(row_examples: list, examples_per_step: int, sources: list, targets: list) -> list:
    """(examples per row, train.max_tokens, rows per optimizer step) for each packed row size swept.

    The budget is the largest multiple of 8 at which the epoch still packs into at least n / k rows, so
    rows hold at most k examples on average and, with examples_per_step / k rows per step, the epoch takes
    at least the padded sides' optimizer steps (never fewer, larger steps)."""
    out = []
    mean = sum(sources) / len(sources)
    for k in row_examples:
        need = math.ceil(len(sources) / k)
        lo = 8 * math.ceil(max(sources) / 8)  # any one example must fit
        hi = max(lo, 8 * math.ceil(2 * k * mean / SPEC["row_fill"] / 8))
        while lo < hi:  # rows_at falls as the budget grows
            mid = 8 * ((lo + hi + 8) // 16)
            if rows_at(mid, sources, targets) >= need:
                lo = mid
            else:
                hi = mid - 8
        c = {"examples_per_row": k, "max_tokens": lo, "accumulation": examples_per_step // k}
        out.append({**c, "rows_per_epoch": rows_at(lo, sources, targets)})
    return out


def measure(bench) -> int:
    import lorakit
    from lorakit.model import load_config
    from lorakit.recipe import recipe_from_dict

    args, spec, log = bench.args, bench.spec, bench.log
    dataset, per_step = spec["datasets"][args.dataset]["data"], args.examples_per_step
    base_seed = spec["base_seed"]

    def overrides(side: str, b: dict, seed: int) -> dict:
        """`b`: examples per micro-batch (packed: per row, without a budget), the packed rows' token budget
        or None, micro-batches per optimizer step."""
        out = {f"data.{k}": v for k, v in dataset.items()}
        out.update({"train.micro_batch_size": b["micro_batch"], "train.seed": seed})
        out["train.gradient_accumulation_steps"] = b["accumulation"]
        if bench.packing(side) and b["max_tokens"]:
            out["train.max_tokens"] = b["max_tokens"]
        return out

    def run(side: str, b: dict, seed: int = base_seed, label: str | None = None) -> dict:
        fields = {"micro_batch": b["micro_batch"], "accumulation": b["accumulation"], "seed": seed}
        fields["max_tokens"] = b["max_tokens"] if bench.packing(side) else None
        return bench.run(side, label, overrides(side, b, seed), **fields)

    def recipe(side: str, max_tokens=None):
        b = {"micro_batch": MICRO_BATCH, "max_tokens": max_tokens, "accumulation": 1}
        return recipe_from_dict(bench.recipe(side, overrides(side, b, base_seed)))

    # Build the tiny model and tokenize once per distinct recipe here, so no timed run pays for it.
    data = lorakit.prepare(recipe("padded_random"))
    log(data.describe())
    lorakit.prepare(recipe("packed"))
    _, config = load_config(recipe("padded_random"))
    sources, targets = [len(x) for x in data.train["input_ids"]], [len(x) for x in data.train["labels"]]
    rows = [{"examples_per_row": k, "micro_batch": k, "max_tokens": None} for k in args.examples_per_row]
    candidates = [dict(c, accumulation=per_step // c["micro_batch"]) for c in rows]
    padded = {"micro_batch": MICRO_BATCH, "max_tokens": None, "accumulation": per_step // MICRO_BATCH}
    by_size = {c["examples_per_row"]: c for c in candidates}

    def sweep_run(k: int) -> dict:  # rows of k random examples, the rows per step that keep examples per step
        return dict(run("packed", by_size[k], label=f"sweep_{k}"), examples_per_row=k)

    row_sweep = None
    if len(candidates) > 1:
        # Chosen by useful tokens per CPU second: with one torch thread, what the run computed; wall seconds
        # also hold what other jobs on a shared machine took (up to 2x on a sweep run's wall time here).
        row_sweep = bench.sweep(list(by_size), sweep_run, lambda k, runs: by_size[k])
        row_sweep["candidates"] = candidates
    best = row_sweep["best"] if row_sweep else candidates[0]["examples_per_row"]
    chosen = next(c for c in candidates if c["examples_per_row"] == best)
    # Rows filled to a token budget, at the same examples per row on average (lorakit with max_tokens).
    (budget,) = packed_candidates([best], per_step, sources, targets)
    budget["micro_batch"] = MICRO_BATCH
    lorakit.prepare(recipe("packed_budget", budget["max_tokens"]))
    log(f"packed rows: {best} random examples; budget rows: train.max_tokens {budget['max_tokens']}")
    batching_of = {s: {"packed": chosen, "packed_budget": budget}.get(s, padded) for s in SIDES}
    seeds = [base_seed + r for r in range(args.repeats)]
    runs = bench.rounds(SIDES, args.repeats, lambda s, rnd: run(s, batching_of[s], seeds[rnd]))

    every = runs + (row_sweep["runs"] if row_sweep else [])
    where = lambda r: f"@{r['max_tokens'] or r['micro_batch']}" if r["side"].startswith("packed") else ""  # noqa: E731
    checks = token_checks(every, args.max_samples, lambda r: r["side"] + where(r))
    checks["every_run_evaluated"] = all(r["eval_loss"] is not None for r in every)
    needed = ("useful_tokens_equal_on_all_runs", "each_example_once", "every_run_evaluated")
    valid = all(checks[k] for k in needed)
    medians, ratios = bench.summarise(runs, SIDES, spec["comparisons"])
    judged = claims(spec["claims"], ratios, medians, valid)
    met = {c["name"]: c["claim_met"] for c in judged}
    result = bench.result(dataset=args.dataset, claims=judged, claims_met=met)
    result.update(chosen_examples_per_row=best, chosen_max_tokens=budget["max_tokens"])
    result["budget_rows_per_epoch"] = budget["rows_per_epoch"]
    for k in ("micro_batch", "max_tokens", "accumulation"):
        result[k] = {s: batching_of[s][k] for s in SIDES}
    result.update(examples_per_step=per_step, seeds=seeds, mean_source_tokens=sum(sources) / len(sources))
    result["max_target_tokens"] = first_of(runs, SIDES, "max_target_tokens")
    r0, eval_rows = runs[0], sorted({r["eval_rows"] for r in every if r["eval_rows"] is not None})
    data_setup = {**dataset, "split": "train", "rows": args.max_samples, "format": "instruction"}
    caps = ("max_source_length", "max_target_length")
    data_setup.update({k: r0[k] for k in caps}, caps_from=spec["caps_from"])
    data_setup.update({k: r0[k] for k in ("source_tokens_untruncated", "target_tokens_untruncated")})
    data_setup.update(eval_split="validation", eval_rows=eval_rows[0] if len(eval_rows) == 1 else eval_rows)
    evaluation = spec["evaluation"].format(n=args.max_eval_samples)
    more = {"zero_stage": first_of(runs, SIDES, "zero_stage"), "evaluation": evaluation, "saving": "disabled"}
    setup = bench.setup(every, SIDES, config, data_setup, **more)
    how = "chosen by the sweep" if row_sweep else "the only row size given, no sweep"
    context = {"k": best, "how": how, "packed_accumulation": chosen["accumulation"]}
    context["budget"] = budget["max_tokens"]
    context.update(padded_accumulation=padded["accumulation"], budget_k=best)
    context["budget_accumulation"] = budget["accumulation"]
    firsts = ("optimizer_steps", "examples_per_optimizer_step", "useful_tokens_per_optimizer_step")
    result.update(setup=setup, sides=bench.describe(SIDES, **context))
    result["batch_size_matching"] = spec["batch_size_matching"].format(n=per_step, **context)
    result["checks"] = checks
    result.update(bench.per_side(runs, SIDES, checks["useful_tokens_equal_on_all_runs"], medians, firsts))
    result.update({k: {s: medians[s][k] for s in SIDES} for k in ("source_efficiency", "target_efficiency")})
    result["eval_loss"] = {s: medians[s]["eval_loss"] for s in SIDES}
    result.update(medians=medians, ratios=ratios, row_sweep=row_sweep, runs=runs)
    for s, m in medians.items():
        rate, loss = m["useful_tokens_per_second"], m["eval_loss"]
        log(f"{s:15s} median {rate:7.0f} useful tok/s, eval loss {loss:.4f}")
    return bench.finish(result, valid)


def plot(result: dict, plt):
    """Useful tokens/s and eval loss per side, and the row size sweep."""
    fig, axes, sides, swept = plots.side_and_sweep_panels(plt, result, "row_sweep", "row_sizes", 2, scale=1.3)
    per_row = result["micro_batch"]
    labels = plots.budget_labels(result, SPEC, sides)
    labels["packed"] += f"\n{per_row['packed']} per row"

    def loss(side: str) -> str:
        return f"{result['medians'][side]['eval_loss']:.3f}\n{result['optimizer_steps'][side]} steps"

    plots.speed_bars(axes[0], result, labels, "padding eff.", 7)
    title = "eval loss after the epoch (lower is better)"
    plots.side_bars(axes[1], result, "eval_loss", title, labels, loss, 7)
    losses = [r["eval_loss"] for r in result["runs"]]
    pad = 0.5 * (max(losses) - min(losses) + 0.05)
    axes[1].set_ylim(min(losses) - pad, max(losses) + pad)
    if swept:  # the sweep chooses by useful tokens per CPU second (see sweep())
        title = f"row size sweep: packed useful tokens / CPU s ({swept['repeats']} round(s))"

        def notes(p: dict) -> str:
            eff, steps, loss = p["padding_efficiency"], p["optimizer_steps"], p["eval_loss"]
            return f"eff. {eff:.2f}\n{steps} steps\neval {loss:.3f}"

        metric = "useful_tokens_per_cpu_second"
        plots.sweep_bars(axes[2], swept, SPEC["sweep"], metric, notes, title)
        axes[2].set_xlabel("train.micro_batch_size (random examples per packed row)", fontsize=8)
    return fig


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
