"""Encoder-decoder (T5) training, two measurements of useful tokens per second over one epoch.

`padding` (specs/seq2seq_padding.yaml): lorakit vs the FLAN-T5 DeepSpeed guide's Seq2SeqTrainer pipeline (pads
to max_length), without and with its ZeRO-3, and vs an expert's that pads dynamically and groups by length.
`packing` (specs/seq2seq_packing.yaml): packed vs padded in lorakit, with the eval loss after the epoch.
Commands (`python benchmarks/seq2seq.py padding|packing [--smoke] ...`): benchmarks/README.md.
"""

from __future__ import annotations

import bisect
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script: the harness and this lorakit

from benchmarks.harness import load_spec, main, plots, workers  # noqa: E402
from benchmarks.harness.runner import claims, first_of, one_or_all, token_checks  # noqa: E402

PADDING, PACKING = load_spec("seq2seq_padding"), load_spec("seq2seq_packing")
MICRO_BATCH = PACKING["recipe"]["train"]["micro_batch_size"]
SIDES = list(PACKING["sides"])
UNTRUNCATED = ("source_tokens_untruncated", "target_tokens_untruncated")


def data_overrides(bench) -> dict:
    """The recipe's data keys of --dataset; `code` rows are generated into the invocation's temp dir."""
    data = dict(PADDING["datasets"][bench.args.dataset]["data"])
    if data.get("source") == "generated":
        from benchmarks.prepare_speed import write_rows

        (bench.tmp / "code").mkdir(exist_ok=True)
        write_rows(bench.tmp / "code" / "train.jsonl", bench.args.max_samples, "code")
        data["source"] = str(bench.tmp / "code")
    return {f"data.{k}": v for k, v in data.items()}


def hf_worker(spec: dict) -> dict:
    """One Seq2SeqTrainer run: the guide's pipeline (padding to max_length) or the expert's (dynamic)."""
    import datasets
    import torch
    import transformers as hf

    from lorakit.data.source_files import resolve_local_source
    from lorakit.testing import resolve_model_source

    recipe, dynamic = spec["recipe"], spec["hf"]["padding"] == "dynamic"
    data, cfg = recipe["data"], recipe["train"]
    source = resolve_model_source(recipe["model"]["name_or_path"], data["cache_dir"])
    tokenizer = hf.AutoTokenizer.from_pretrained(source)
    path = resolve_local_source(data["source"]) / "train.jsonl"
    rows = datasets.load_dataset("json", data_files={"train": str(path)}, split="train")
    rows = rows.select(range(data["max_samples"]))
    # The guide pads every row to the caps; the expert leaves padding to the collator, batch by batch.
    columns = (data["input_column"], data["target_column"])
    caps = (spec["max_source_length"], spec["max_target_length"])
    padding = "do_not_pad" if dynamic else "max_length"
    preprocess = workers.guide_preprocess(tokenizer, data["prompt_template"], columns, caps, padding)
    rows = rows.map(preprocess, batched=True, remove_columns=rows.column_names)
    hf.set_seed(cfg["seed"])
    dtype, attention = getattr(torch, recipe["model"]["dtype"]), spec["attention"]
    model = workers.hf_model(source, recipe["method"], True, dtype=dtype, attn_implementation=attention)
    collator = hf.DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    out = {"useful_tokens": 0, "token_slots": 0, "samples": 0}
    out.update(epoch_seconds=0.0, epoch_cpu_seconds=0.0, step_seconds=0.0)

    def counted(features):  # counts what every trained batch holds; the batch itself is untouched
        batch = collator(features)
        out["useful_tokens"] += int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())
        out["token_slots"] += batch["input_ids"].numel() + batch["labels"].numel()
        out["samples"] += batch["input_ids"].shape[0]
        return batch

    marks = {}

    class Timer(hf.TrainerCallback):
        def on_train_begin(self, *a, **k):
            # DeepSpeed's initialisation inside the Trainer resets torch's thread count: pin it again.
            if spec.get("torch_threads"):
                torch.set_num_threads(spec["torch_threads"])

        def on_epoch_begin(self, *a, **k):
            marks.update(epoch=time.perf_counter(), cpu=time.process_time())

        def on_epoch_end(self, *a, **k):
            out["epoch_seconds"] += time.perf_counter() - marks["epoch"]
            out["epoch_cpu_seconds"] += time.process_time() - marks["cpu"]

        def on_step_begin(self, *a, **k):
            marks["step"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            out["step_seconds"] += time.perf_counter() - marks["step"]

    # Under ZeRO-3 the model is loaded before the arguments, as in the guide's script.
    zero3 = spec["hf"].get("zero3")
    deepspeed = workers.one_process_deepspeed(spec["master_port"], spec["guide_zero3"]) if zero3 else None
    # group_by_length: the expert's LengthGroupedSampler; the guide samples at random.
    kwargs = {k: workers.dig(recipe, key) for k, key in PADDING["hf_from_recipe"].items()}
    kwargs.update(spec["hf_args"], deepspeed=deepspeed, output_dir=spec["work_dir"], group_by_length=dynamic)
    args = workers.training_args(hf.Seq2SeqTrainingArguments, **kwargs)
    trainer, metrics, losses = workers.train(
        hf.Seq2SeqTrainer, model, args, rows, counted, tokenizer, Timer()
    )
    params = list(model.parameters())
    out.update(steps=trainer.state.global_step, trainer_train_runtime=metrics["train_runtime"], **losses)
    out.update(attention=model.config._attn_implementation, total_params=sum(p.numel() for p in params))
    out["trainable_params"] = sum(p.numel() for p in params if p.requires_grad)
    out.update(torch_threads=torch.get_num_threads(), train_sampling_strategy=args.train_sampling_strategy)
    out["max_source_length"] = max(map(len, rows["input_ids"]))
    out["max_target_length"] = max(map(len, rows["labels"]))
    return out


def padding_analysis(medians: dict, first: dict) -> dict:
    """Arithmetic on the medians (derived, not separately measured): where the epoch time goes. Differences
    that need a side which was not run (--sides) are left out."""
    sides = list(first)
    epoch = {s: medians[s]["epoch_seconds"] for s in sides}
    out = {"steps_per_epoch": {s: first[s]["steps"] for s in sides}}
    out["seconds_per_step"] = {s: medians[s]["seconds_per_step"] for s in sides}
    out["cpu_seconds_per_wall_second"] = {s: medians[s]["epoch_cpu_seconds"] / epoch[s] for s in sides}
    lorakit = "lorakit_zero0"
    for other in ("baseline", "expert"):
        if other in first and lorakit in first:
            slots = first[other]["token_slots"] / first[lorakit]["token_slots"]
            out[f"token_slots_{other}_over_lorakit"] = slots
            steps = first[other]["steps"]
            out[f"{other}_minus_zero0_seconds_per_step"] = (epoch[other] - epoch[lorakit]) / steps
    if {"lorakit_zero0", "lorakit_zero3"} <= set(sides):
        z3, z0 = epoch["lorakit_zero3"], epoch["lorakit_zero0"]
        out["zero3_minus_zero0_seconds_per_step"] = (z3 - z0) / first["lorakit_zero0"]["steps"]
        out["zero3_minus_zero0_share_of_zero3_epoch"] = (z3 - z0) / z3
    if {"baseline", "baseline_zero3"} <= set(sides):
        z3, z0 = epoch["baseline_zero3"], epoch["baseline"]
        out["baseline_zero3_minus_baseline_seconds_per_step"] = (z3 - z0) / first["baseline"]["steps"]
    out["how_to_read"] = PADDING["analysis_how_to_read"]
    return out


def measure_padding(bench) -> int:
    from transformers import T5ForConditionalGeneration

    from lorakit.engine.launch import free_port
    from lorakit.model.attention import choose_attention

    args, spec, log = bench.args, bench.spec, bench.log
    data_keys = data_overrides(bench)
    data = bench.prepare("lorakit_zero3", data_keys)  # the lorakit runs reuse its tiny T5 and cache
    log(data.describe())
    lengths = {k: getattr(data.lengths, k) for k in ("max_source_length", "max_target_length")}
    hf_spec = {**lengths, "attention": choose_attention("auto", T5ForConditionalGeneration)}
    hf_spec.update(guide_zero3=spec["guide_zero3"], hf_args=spec["hf_args"])

    def run(side: str, _round: int) -> dict:
        hf = spec["sides"][side].get("hf")
        if hf is None:
            return bench.run(side, overrides=data_keys)
        worker = {**hf_spec, "recipe": bench.recipe(side, data_keys), "hf": hf, "master_port": free_port()}
        return bench.run(side, kind="hf", spec=worker)

    sides = [s for s in spec["sides"] if s in (args.sides or spec["sides"])]
    runs = bench.rounds(sides, args.repeats, run)
    # Only the comparisons and claims whose two sides both ran.
    comparisons = [c for c in spec["comparisons"] if set(c) <= set(sides)]
    medians, ratios = bench.summarise(runs, sides, comparisons)
    equal = len({r["useful_tokens"] for r in runs}) == 1
    first = {side: next(r for r in runs if r["side"] == side) for side in sides}
    judged = [c for c in spec["claims"] if {c["side"], c["versus"]} <= set(sides)]
    measured = claims(judged, ratios, medians, equal, spec["ratio_key"])
    met = bool(measured) and all(c["claim_met"] for c in measured)
    result = bench.result(claims=measured, claims_met=met)
    # The first claim's pair; none when --sides left out both claims' sides.
    head = measured[0] if measured else None
    result["headline_pair"] = spec["ratio_key"].format(**head) if head else None
    result["headline_ratio"] = head["measured_ratio"] if head else None
    base = {**spec["recipe"]["data"], **{k.removeprefix("data."): v for k, v in data_keys.items()}}
    source = base["source"] if base["source"].startswith("builtin:") else PADDING["generated_source"]
    data_setup = {"dataset": args.dataset, "source": source, "split": base["split"], "rows": args.max_samples}
    data_setup.update(prompt_template=base["prompt_template"], **lengths, lengths_from=spec["lengths_from"])
    stats = (*UNTRUNCATED, "truncated_sources", "truncated_targets")
    data_setup.update({k: data.stats.get(k) for k in stats})
    checkpointing = {"use_reentrant": False} if args.gradient_checkpointing else None
    whole = next((s for s in sides if "zero3" not in s), sides[0])  # ZeRO-3 sides count a partition
    setup = bench.setup(runs, sides, data_setup, dtype_why=spec["dtype_why"])
    setup["model"]["total_params"] = first[whole]["total_params"]
    setup["model"]["trainable_params"] = first_of(runs, sides, "trainable_params")
    disabled = "disabled on all sides"
    setup.update(gradient_checkpointing_kwargs=checkpointing, evaluation=disabled, saving=disabled)
    result.update(setup=setup, sides=bench.describe(sides), **bench.per_side(runs, sides, equal, medians))
    result.update(medians=medians, ratios=ratios, runs=runs, analysis=padding_analysis(medians, first))
    log(f"useful tokens: {result['useful_tokens']['per_side']} (equal: {equal})")
    return bench.finish(result, equal)


def plot_padding(result: dict, plt):
    """Per-run and median useful tokens/s of each side (ratios to its pairs above), and padding efficiency."""
    fig, (ax, ax2) = plots.panels(plt, [1, 1], scale=7.0)
    labels = {s: PADDING["sides"][s]["label"] for s in result["medians"]}

    plots.speed_bars(ax, result, labels, None, name=lambda s: labels[s].replace("\n", " "))
    efficiency = [result["padding_efficiency"][s] for s in labels]
    no_runs, no_notes = [[]] * len(labels), [""] * len(labels)
    plots.bars(ax2, list(labels.values()), efficiency, no_runs, no_notes, "padding efficiency")
    ax2.set_ylim(0, 1)
    return fig


def check_args_packing(args, error) -> None:
    args.examples_per_row = sorted(set(args.examples_per_row))
    bad = [k for k in args.examples_per_row if args.examples_per_step % k]
    if bad:
        error(f"--examples-per-row {bad} must divide --examples-per-step {args.examples_per_step}")
    uneven = [k for k in args.examples_per_row if args.max_samples % k]
    if uneven:
        # A last row short of k random examples would be filled with repeats: counts would differ.
        error(f"--max-samples {args.max_samples} must be a multiple of every --examples-per-row {uneven}")


def rows_at(budget: int, sources: list[int], targets: list[int]) -> int:
    """Packed rows of one epoch at encoder budget `budget`, as lorakit packs them on one process."""
    from lorakit.data.multipack_seq2seq import Seq2SeqMultipackBatchSampler, default_max_target_tokens

    max_target = default_max_target_tokens(sources, targets, budget)
    return len(Seq2SeqMultipackBatchSampler(sources, targets, budget, max_target, num_replicas=1))


def budget_rows(k: int, examples_per_step: int, sources: list, targets: list) -> dict:
    """Rows of k examples on average: the largest train.max_tokens (a multiple of 8) that still packs the
    epoch into n / k rows or more (benchmarks/README.md), its rows per optimizer step and per epoch."""
    mean, need = sum(sources) / len(sources), math.ceil(len(sources) / k)
    lo = 8 * math.ceil(max(sources) / 8)  # any one example must fit
    budgets = range(lo, max(lo, 8 * math.ceil(2 * k * mean / PACKING["row_fill"] / 8)) + 1, 8)
    # rows_at falls as the budget grows: the largest budget that still packs `need` rows or more.
    fewer = bisect.bisect_right(budgets, -need, key=lambda b: -rows_at(b, sources, targets))
    budget = budgets[max(fewer - 1, 0)]
    c = {"examples_per_row": k, "max_tokens": budget, "accumulation": examples_per_step // k}
    return {**c, "rows_per_epoch": rows_at(budget, sources, targets)}


def measure_packing(bench) -> int:
    args, spec, log = bench.args, bench.spec, bench.log
    dataset, per_step = spec["datasets"][args.dataset]["data"], args.examples_per_step
    base_seed = spec["base_seed"]

    def overrides(side: str, b: dict, seed: int) -> dict:
        """`b`: examples per micro-batch (or row), the packed rows' budget or None, micro-batches per step."""
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

    def prepare(side: str, max_tokens=None):
        b = {"micro_batch": MICRO_BATCH, "max_tokens": max_tokens, "accumulation": 1}
        return bench.prepare(side, overrides(side, b, base_seed))

    data = prepare("padded_random")
    log(data.describe())
    prepare("packed")
    sources, targets = [len(x) for x in data.train["input_ids"]], [len(x) for x in data.train["labels"]]
    rows = [{"examples_per_row": k, "micro_batch": k, "max_tokens": None} for k in args.examples_per_row]
    candidates = [dict(c, accumulation=per_step // c["micro_batch"]) for c in rows]
    padded = {"micro_batch": MICRO_BATCH, "max_tokens": None, "accumulation": per_step // MICRO_BATCH}
    by_size = {c["examples_per_row"]: c for c in candidates}

    def sweep_run(k: int) -> dict:  # rows of k random examples, the rows per step that keep examples per step
        return dict(run("packed", by_size[k], label=f"sweep_{k}"), examples_per_row=k)

    row_sweep = None
    if len(candidates) > 1:
        # Chosen by useful tokens per CPU second: wall seconds also hold what other jobs on the machine took.
        row_sweep = bench.sweep(list(by_size), sweep_run, lambda k, runs: by_size[k])
        row_sweep["candidates"] = candidates
    best = row_sweep["best"] if row_sweep else candidates[0]["examples_per_row"]
    chosen = next(c for c in candidates if c["examples_per_row"] == best)
    # Rows filled to a token budget, at the same examples per row on average (lorakit with max_tokens).
    budget = budget_rows(best, per_step, sources, targets)
    budget["micro_batch"] = MICRO_BATCH
    prepare("packed_budget", budget["max_tokens"])
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
    r0, eval_rows = runs[0], one_or_all(r["eval_rows"] for r in every if r["eval_rows"] is not None)
    data_setup = {**dataset, "split": "train", "rows": args.max_samples, "format": "instruction"}
    caps = ("max_source_length", "max_target_length", *UNTRUNCATED)
    data_setup.update({k: r0[k] for k in caps}, caps_from=spec["caps_from"])
    data_setup.update(eval_split="validation", eval_rows=eval_rows)
    more = {"zero_stage": first_of(runs, SIDES, "zero_stage"), "saving": "disabled"}
    evaluation = spec["evaluation"].format(n=args.max_eval_samples)
    setup = bench.setup(every, SIDES, data_setup, evaluation=evaluation, **more)
    how = "chosen by the sweep" if row_sweep else "the only row size given, no sweep"
    context = {"k": best, "how": how, "budget": budget["max_tokens"], "budget_k": best}
    context.update(packed_accumulation=chosen["accumulation"], padded_accumulation=padded["accumulation"])
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


def plot_packing(result: dict, plt):
    """Useful tokens/s and eval loss per side, and the row size sweep."""
    fig, axes, sides, swept = plots.side_and_sweep_panels(plt, result, "row_sweep", "row_sizes", 2, scale=1.3)
    per_row = result["micro_batch"]
    labels = plots.budget_labels(result, PACKING, sides)
    labels["packed"] += f"\n{per_row['packed']} per row"

    def loss(side: str) -> str:
        return f"{result['medians'][side]['eval_loss']:.3f}\n{result['optimizer_steps'][side]} steps"

    plots.speed_bars(axes[0], result, labels, "padding eff.", 7)
    title = "eval loss after the epoch (lower is better)"
    plots.side_bars(axes[1], result, "eval_loss", title, labels, loss, 7)
    losses = [r["eval_loss"] for r in result["runs"]]
    pad = 0.5 * (max(losses) - min(losses) + 0.05)
    axes[1].set_ylim(min(losses) - pad, max(losses) + pad)
    if swept:
        plots.sweep_bars(axes[2], swept, PACKING["sweep"])
    return fig


WORKERS = {"hf": hf_worker}
MEASUREMENTS = {  # what the harness reads of a script, for each of its measurements (harness/cli.py)
    "padding": dict(SPEC=PADDING, measure=measure_padding, plot=plot_padding),
    "packing": dict(SPEC=PACKING, measure=measure_packing, plot=plot_packing, check_args=check_args_packing),
}

if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
