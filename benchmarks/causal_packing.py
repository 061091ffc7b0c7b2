"""Packed vs dynamically padded causal-LM training in lorakit: useful tokens per second over one epoch.

    python benchmarks/causal_packing.py [--output benchmarks/results/causal_packing.json]
                                        [--max-samples N] [--repeats K] [--budgets 512,1024,2048,4096]
                                        [--sweep-repeats K] [--max-tokens N] [--zero3-pair]
                                        [--cache-dir DIR] [--torch-threads T] [--note TEXT]
    python benchmarks/causal_packing.py --plot-only benchmarks/results/causal_packing.json

Three ways to batch the same rows, all trained with `lorakit.train` on the same tiny Llama, data, LoRA,
optimizer, schedule, seed, dtype (float32) and gradient checkpointing, one process, DeepSpeed without ZeRO:

- padded_random: random micro-batches of 8 padded to their longest member (data.group_by_length false): what
  a shuffled DataLoader + DataCollatorForSeq2Seq gives, the usual Hugging Face setup;
- padded_grouped: micro-batches of 8 examples of similar length, padded to their longest member
  (data.group_by_length true, lorakit's default without packing);
- packed: multipack rows of at most train.max_tokens tokens (data.packing true), attention per example.

The packed side's token budget is chosen by measurement in the same invocation: a sweep phase first trains
one epoch at each budget of --budgets (--sweep-repeats interleaved rounds) and picks the one with the highest
median useful tokens/s; the comparison rounds that follow are new runs (the sweep's runs are not reused, so
picking the best of a noisy sweep does not flatter the headline). --max-tokens N skips the sweep.

Every training run is a fresh subprocess of this script, and the sides are interleaved (the order reversed
every other round) so machine noise hits them all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from a checkout: benchmarks.common and this lorakit

from benchmarks.common import (  # noqa: E402
    changed_files,
    load_average,
    machine,
    paired_ratios,
    run_worker,
    source_digest,
    source_dirty,
    source_files,
    versions,
)

DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "causal_packing.json"

MODEL = "tiny:llama"
PROMPT = "Summarize the following news article:\n{input}\nSummary:\n"  # recipes/quickstart_causal.yaml
MICRO_BATCH = 8
DTYPE = "float32"
DEFAULT_BUDGETS = (512, 1024, 2048, 4096)
CLAIM = 1.3
HEADLINE = ("packed", "padded_random")
# How each side batches, and the DeepSpeed ZeRO stage it runs with.
SIDE_SPECS = {
    "padded_random": {"packing": False, "group_by_length": False, "zero_stage": 0},
    "padded_grouped": {"packing": False, "group_by_length": True, "zero_stage": 0},
    "packed": {"packing": True, "group_by_length": True, "zero_stage": 0},
    "packed_matched": {"packing": True, "group_by_length": True, "zero_stage": 0},
    "padded_random_zero3": {"packing": False, "group_by_length": False, "zero_stage": 3},
    "packed_zero3": {"packing": True, "group_by_length": True, "zero_stage": 3},
}
BASE_SIDES = ("padded_random", "padded_grouped", "packed")
ZERO3_SIDES = ("padded_random_zero3", "packed_zero3")
# (side, versus): the ratios the result reports.
COMPARISONS = (
    ("packed", "padded_random"),
    ("packed", "padded_grouped"),
    ("padded_grouped", "padded_random"),
)
MATCHED_COMPARISONS = (("packed_matched", "padded_random"), ("packed_matched", "padded_grouped"))
ZERO3_COMPARISONS = (("packed_zero3", "padded_random_zero3"),)
# The hyper-parameters every side shares. Speed does not depend on lr.
TRAIN = {
    "epochs": 1,
    "lr": 3e-3,
    "micro_batch_size": MICRO_BATCH,
    "gradient_accumulation_steps": 1,
    "warmup_ratio": 0.05,
    "lr_schedule": "linear",
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "seed": 42,
}
LORA = {"kind": "lora", "r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"}
TIMING = {
    "epoch_seconds": "wall clock of lorakit.engine.loop.Trainer.run (our own timer, installed in the worker): "
    "the epoch loop with batch loading, collation, logging and the progress bar; model build, DeepSpeed "
    "initialisation, data preparation and saving excluded (eval and saving are disabled)",
    "step_seconds": "lorakit's summary['train_seconds']: the sum of per-step windows, batch loading included, "
    "logging excluded",
    "useful_tokens": "summary['train_tokens']: the non-pad tokens of every micro-batch trained on (every token "
    "of every example; prompt tokens included, not only loss tokens)",
    "token_slots": "summary['padded_tokens']: padded sides: rows x longest member of every micro-batch; packed "
    "sides: train.max_tokens per packed row (its capacity)",
    "epoch_cpu_seconds": "CPU time of the worker process over the same window (time.process_time); with one "
    "torch thread, cpu/wall well below 1 means other jobs took the core away during the epoch",
    "examples": "counted by the worker micro-batch by micro-batch (a packed row holds several examples; "
    "summary['train_samples'] counts rows)",
}


def recipe_dict(spec: dict) -> dict:
    """The lorakit recipe of one run; `spec` holds the side's batching and the shared settings."""
    train = {k: TRAIN[k] for k in TRAIN}
    if spec["packing"]:
        train["max_tokens"] = spec["max_tokens"]
    return {
        "model": {
            "name_or_path": MODEL,
            "dtype": DTYPE,
            "gradient_checkpointing": spec["gradient_checkpointing"],
        },
        "method": dict(LORA),
        "data": {
            "source": "builtin:news_summaries",
            "split": "train",
            "format": "instruction",
            "input_column": "article",
            "target_column": "highlights",
            "prompt_template": PROMPT,
            "max_samples": spec["max_samples"],
            "max_length": "auto",
            "packing": spec["packing"],
            "group_by_length": spec["group_by_length"],
            "cache_dir": spec["cache_dir"],
        },
        "train": train,
        "distributed": {"num_processes": 1, "zero_stage": spec["zero_stage"]},
        "eval": {"enabled": False},
        "output": {"dir": spec["work_dir"], "save_adapter": False},
    }


# ----------------------------------------------------------------------------------------------- worker
def worker(spec: dict) -> dict:
    """One training run in this (fresh) process: lorakit.train with our timer and batch counter."""
    import torch

    import lorakit
    from lorakit.engine import loop
    from lorakit.recipe import recipe_from_dict

    threads = spec.get("torch_threads") or 0
    timer: dict[str, float] = {}
    run, train_window = loop.Trainer.run, loop.train_window
    counts = {
        "examples": 0,
        "micro_batches": 0,
        "rows": 0,
        "loss_tokens": 0,
        "counted_useful_tokens": 0,
        "widest_row": 0,
    }

    def timed_run(self):
        # DeepSpeed's initialisation can reset torch's thread count; pin it again before the clock starts.
        if threads:
            torch.set_num_threads(threads)
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return run(self)
        finally:
            timer["epoch_seconds"] = time.perf_counter() - start
            timer["epoch_cpu_seconds"] = time.process_time() - cpu
            timer["torch_threads"] = torch.get_num_threads()

    def counted_window(engine, inputs, window, meter):
        for b in window:  # instrumentation only: reads the batches, changes nothing
            ids = b["input_ids"]
            counts["examples"] += int(b.get("num_examples", ids.shape[0]))
            counts["micro_batches"] += 1
            counts["rows"] += ids.shape[0]
            counts["loss_tokens"] += int((b["labels"] != -100).sum())
            mask = b.get("attention_mask")
            counts["counted_useful_tokens"] += int(mask.sum()) if mask is not None else ids.numel()
            counts["widest_row"] = max(counts["widest_row"], ids.shape[1])
        return train_window(engine, inputs, window, meter)

    loop.Trainer.run, loop.train_window = timed_run, counted_window
    s = lorakit.train(recipe_from_dict(recipe_dict(spec))).summary
    return {
        **timer,
        **counts,
        "step_seconds": s["train_seconds"],
        "optimizer_steps": s["steps"],
        "summary_train_samples": s["train_samples"],
        "useful_tokens": s["train_tokens"],
        "token_slots": s["padded_tokens"],
        "lorakit_packing_efficiency": s["packing_efficiency"],
        "lorakit_tokens_per_second": s["tokens_per_second"],
        "batching": s["batching"],
        "loss_first": s["loss"]["first"],
        "loss_last": s["loss"]["last"],
        "attention": s["attention"],
        "zero_stage": s["zero_stage"],
        "trainable_params": s["trainable_params"],
        "total_params": s["total_params"],
        "peak_rss_bytes": s["peak_memory_bytes"]["cpu_rss"],
        "max_length": s["data"]["max_length"],
    }


# ------------------------------------------------------------------------------------------ orchestration
def run_side(
    side: str, max_tokens: int | None, shared: dict, tmp: Path, log, label: str | None = None
) -> dict:
    """Train one side in a fresh interpreter; returns its measurements and the rates derived from them."""
    label = label or side
    spec = dict(shared, **SIDE_SPECS[side], side=side)
    spec["max_tokens"] = max_tokens if spec["packing"] else None
    spec["work_dir"] = str(tmp / f"work-{label}-{time.monotonic_ns()}")
    r = run_worker(__file__, spec, tmp, label)
    r.update(side=side, max_tokens=spec["max_tokens"])
    r["padding_efficiency"] = r["useful_tokens"] / r["token_slots"]
    r["useful_tokens_per_second"] = r["useful_tokens"] / r["epoch_seconds"]
    r["useful_tokens_per_cpu_second"] = r["useful_tokens"] / r["epoch_cpu_seconds"]
    r["cpu_seconds_per_wall_second"] = r["epoch_cpu_seconds"] / r["epoch_seconds"]
    r["step_useful_tokens_per_second"] = r["useful_tokens"] / r["step_seconds"]
    r["token_slots_per_second"] = r["token_slots"] / r["epoch_seconds"]
    r["seconds_per_optimizer_step"] = r["epoch_seconds"] / r["optimizer_steps"]
    r["useful_tokens_per_optimizer_step"] = r["useful_tokens"] / r["optimizer_steps"]
    log(
        f"  {label:20s} epoch {r['epoch_seconds']:6.1f} s  {r['useful_tokens_per_second']:8.0f} useful tok/s  "
        f"efficiency {r['padding_efficiency']:.3f}  {r['optimizer_steps']:4d} steps  "
        f"(cpu/wall {r['cpu_seconds_per_wall_second']:.2f}, load {r['load_avg_1min_before']:.2f})"
    )
    return r


MEDIAN_KEYS = (
    "epoch_seconds",
    "epoch_cpu_seconds",
    "step_seconds",
    "useful_tokens_per_second",
    "useful_tokens_per_cpu_second",
    "cpu_seconds_per_wall_second",
    "step_useful_tokens_per_second",
    "token_slots_per_second",
    "seconds_per_optimizer_step",
    "padding_efficiency",
)


def medians_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in MEDIAN_KEYS}


def ratios_of(runs: list[dict], medians: dict, comparisons) -> dict:
    out = {}
    for side, base in comparisons:
        paired = paired_ratios(runs, side, base, "useful_tokens_per_second")
        out[f"{side}/{base}"] = {
            "side": side,
            "versus": base,
            "useful_tokens_per_second": medians[side]["useful_tokens_per_second"]
            / medians[base]["useful_tokens_per_second"],
            "paired_useful_tokens_per_second": paired,
            "paired_median": statistics.median(paired),
            "epoch_time_speedup": medians[base]["epoch_seconds"] / medians[side]["epoch_seconds"],
            # Per CPU second of the epoch: less sensitive to other jobs taking the core away (1 thread).
            "useful_tokens_per_cpu_second": medians[side]["useful_tokens_per_cpu_second"]
            / medians[base]["useful_tokens_per_cpu_second"],
            "paired_useful_tokens_per_cpu_second": paired_ratios(
                runs, side, base, "useful_tokens_per_cpu_second"
            ),
            "step_useful_tokens_per_second": medians[side]["step_useful_tokens_per_second"]
            / medians[base]["step_useful_tokens_per_second"],
            "padding_efficiency_ratio": medians[side]["padding_efficiency"]
            / medians[base]["padding_efficiency"],
        }
    return out


def sweep(budgets: list[int], rounds: int, shared: dict, tmp: Path, log) -> dict:
    """Packed epochs at every budget, interleaved; picks the budget with the highest median useful tokens/s."""
    runs = []
    for rnd in range(rounds):
        order = list(budgets) if rnd % 2 == 0 else list(reversed(budgets))
        log(f"budget sweep {rnd + 1}/{rounds}: {' -> '.join(map(str, order))}")
        for position, budget in enumerate(order):
            r = run_side("packed", budget, shared, tmp, log, label=f"sweep_{budget}")
            runs.append(dict(r, repeat=rnd, position=position))
    per_budget = {}
    for b in budgets:
        mine = [r for r in runs if r["max_tokens"] == b]
        per_budget[str(b)] = {
            **medians_of(mine),
            "useful_tokens_per_second_runs": [r["useful_tokens_per_second"] for r in mine],
            "optimizer_steps": mine[0]["optimizer_steps"],
            "micro_batches": mine[0]["micro_batches"],
            "useful_tokens_per_optimizer_step": mine[0]["useful_tokens_per_optimizer_step"],
            "examples_per_row_mean": mine[0]["examples"] / mine[0]["micro_batches"],
            "sampler_efficiency": mine[0]["batching"].get("sampler_efficiency_epoch0"),
        }
    best = max(budgets, key=lambda b: per_budget[str(b)]["useful_tokens_per_second"])
    return {
        "how": "one epoch of the packed side at each budget, interleaved in this invocation before the "
        "comparison rounds (order reversed every other round); the budget with the highest median useful "
        "tokens/s is chosen; the comparison rounds are separate runs",
        "budgets": list(budgets),
        "repeats": rounds,
        "per_budget": per_budget,
        "best": best,
        "best_by_cpu_time": max(budgets, key=lambda b: per_budget[str(b)]["useful_tokens_per_cpu_second"]),
        "runs": runs,
    }


def orchestrate(args) -> int:
    t0 = time.perf_counter()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    load_at_start = load_average()
    from lorakit.rundir import git_revision, write_json

    revision, digest, files_at_start = git_revision(ROOT), source_digest(), source_files()
    dirty = source_dirty() if revision else None

    def log(msg):
        print(msg, flush=True)

    import lorakit
    from lorakit.model import load_config
    from lorakit.recipe import recipe_from_dict

    sides = list(BASE_SIDES) + (list(ZERO3_SIDES) if args.zero3_pair else [])
    comparisons = COMPARISONS + (ZERO3_COMPARISONS if args.zero3_pair else ())
    shared = {
        "max_samples": args.max_samples,
        "cache_dir": str(Path(args.cache_dir).expanduser().resolve()),
        "gradient_checkpointing": args.gradient_checkpointing == "on",
        "torch_threads": args.torch_threads,
    }
    scratch = str(Path(tempfile.gettempdir()) / "lorakit-bench-unused")

    def recipe_for(side: str, max_tokens: int | None):
        spec = dict(shared, **SIDE_SPECS[side], work_dir=scratch)
        spec["max_tokens"] = max_tokens
        return recipe_from_dict(recipe_dict(spec))

    # Build the tiny model and tokenize once per distinct recipe here, so no timed run pays for it.
    data = lorakit.prepare(recipe_for("padded_random", None))
    log(data.describe())
    max_length = data.lengths.max_length
    budgets = sorted(set(args.budgets if args.max_tokens is None else [args.max_tokens]))
    short = [b for b in budgets if b < max_length]
    if short:
        print(
            f"error: budgets {short} are below the longest example ({max_length} tokens): packing would "
            "truncate examples and the sides would not train on the same tokens",
            file=sys.stderr,
        )
        return 2
    for b in budgets:
        lorakit.prepare(recipe_for("packed", b))
    data_tokens = int(sum(data.train["length"]))
    _, config = load_config(recipe_for("padded_random", None))

    runs: list[dict] = []
    budget_sweep = None
    with tempfile.TemporaryDirectory(prefix="lorakit-bench-") as tmp_name:
        tmp = Path(tmp_name)
        matched = None
        if args.max_tokens is None:
            budget_sweep = sweep(budgets, args.sweep_repeats, shared, tmp, log)
            chosen = budget_sweep["best"]
            log(f"chosen budget: {chosen} tokens per packed row")
            # The budget whose optimizer steps hold about as many tokens as a padded micro-batch of 8: with
            # it, packing is compared at (about) the same batch size; a larger chosen budget also means
            # fewer, bigger optimizer steps.
            per_padded_step = data_tokens / (args.max_samples / MICRO_BATCH)
            per = budget_sweep["per_budget"]
            matched = min(
                budgets, key=lambda b: abs(per[str(b)]["useful_tokens_per_optimizer_step"] - per_padded_step)
            )
            budget_sweep["matched_to_padded_batch"] = {
                "budget": matched,
                "padded_useful_tokens_per_optimizer_step": per_padded_step,
                "packed_useful_tokens_per_optimizer_step": per[str(matched)][
                    "useful_tokens_per_optimizer_step"
                ],
            }
            if matched != chosen:
                sides.insert(sides.index("packed") + 1, "packed_matched")
                comparisons += MATCHED_COMPARISONS
                log(f"packed_matched: budget {matched}, about as many tokens per optimizer step as padded")
        else:
            chosen = args.max_tokens
        budget_of = {s: (matched if s == "packed_matched" else chosen) for s in sides}
        for repeat in range(args.repeats):
            order = sides if repeat % 2 == 0 else list(reversed(sides))
            log(f"repeat {repeat + 1}/{args.repeats}: {' -> '.join(order)}")
            for position, side in enumerate(order):
                r = run_side(side, budget_of[side], shared, tmp, log)
                runs.append(dict(r, repeat=repeat, position=position))

    every = runs + (budget_sweep["runs"] if budget_sweep else [])
    useful = {s: sorted({r["useful_tokens"] for r in runs if r["side"] == s}) for s in sides}
    all_useful = sorted({r["useful_tokens"] for r in every})
    loss_tokens = sorted({r["loss_tokens"] for r in every})
    examples = sorted({r["examples"] for r in every})
    equal = len(all_useful) == 1 and all(r["counted_useful_tokens"] == r["useful_tokens"] for r in every)
    each_once = examples == [args.max_samples]
    medians = {s: medians_of([r for r in runs if r["side"] == s]) for s in sides}
    ratios = ratios_of(runs, medians, comparisons)
    first = {s: next(r for r in runs if r["side"] == s) for s in sides}
    head = ratios["/".join(HEADLINE)]
    result = {
        "benchmark": "causal_packing",
        "measured": "useful (non-pad) tokens per second over one training epoch of a causal LM in lorakit: "
        "multipack packing vs micro-batches of 8 padded to their longest member (random, and grouped by "
        "length); same model, rows, LoRA, optimizer, schedule, seed, dtype and checkpointing; interleaved in "
        "one invocation",
        "claim": f"packed training processes useful tokens >= {CLAIM}x faster per epoch than random "
        "micro-batches padded to their longest member (packed vs padded_random)",
        "claim_ratio": CLAIM,
        "claim_met": bool(equal and each_once and head["useful_tokens_per_second"] >= CLAIM),
        "headline": {"side": HEADLINE[0], "versus": HEADLINE[1]},
        "headline_ratio": head["useful_tokens_per_second"],
        "headline_paired_median": head["paired_median"],
        "chosen_max_tokens": chosen,
        "matched_max_tokens": matched,
        "max_tokens": {s: budget_of[s] if SIDE_SPECS[s]["packing"] else None for s in sides},
        "command": "python benchmarks/causal_packing.py " + " ".join(args.argv),
        "date": started,
        "load_average_at_start": load_at_start,
        "benchmark_wall_seconds": None,
        "timing": TIMING,
        "setup": {
            "model": {
                "name_or_path": MODEL,
                "built_by": "lorakit.testing.resolve_model_source",
                **{
                    k: getattr(config, k, None)
                    for k in (
                        "model_type",
                        "hidden_size",
                        "intermediate_size",
                        "num_hidden_layers",
                        "num_attention_heads",
                        "num_key_value_heads",
                        "vocab_size",
                        "max_position_embeddings",
                    )
                },
                "total_params": first["packed"]["total_params"],
                "trainable_params": first["packed"]["trainable_params"],
            },
            "data": {
                "source": "builtin:news_summaries",
                "split": "train",
                "rows": args.max_samples,
                "format": "instruction",
                "input_column": "article",
                "target_column": "highlights",
                "prompt_template": PROMPT,
                "max_length": max_length,
                "max_length_from": "data.max_length auto: the longest example, capped at the model's maximum",
                "tokens": data_tokens,
                "loss_tokens": data.stats.get("loss_tokens"),
                "tokens_untruncated": data.stats.get("tokens_untruncated"),
                "overlong": data.stats.get("overlong"),
            },
            "lora": LORA,
            "train": dict(TRAIN, optimizer="torch.optim.AdamW (DeepSpeed's torch_adam on CPU)"),
            "dtype": DTYPE,
            "gradient_checkpointing": shared["gradient_checkpointing"],
            "attention": {s: first[s]["attention"] for s in sides},
            "zero_stage": {s: first[s]["zero_stage"] for s in sides},
            "processes": 1,
            "evaluation": "disabled",
            "saving": "disabled",
            "torch_threads": sorted({r["torch_threads"] for r in every}),
        },
        "sides": {
            "padded_random": "data.packing false, data.group_by_length false, micro_batch_size 8: random "
            "micro-batches padded to their longest member (a shuffled DataLoader + DataCollatorForSeq2Seq)",
            "padded_grouped": "data.packing false, data.group_by_length true (lorakit's default without "
            "packing), micro_batch_size 8: micro-batches of similar lengths padded to their longest member",
            "packed": f"data.packing true, train.max_tokens {chosen} (chosen by the budget sweep"
            + (")" if budget_sweep else "; given with --max-tokens, no sweep)")
            + ": one multipack row per micro-batch, attention per example",
            **(
                {
                    "packed_matched": f"packed with train.max_tokens {matched}: the swept budget whose "
                    "optimizer steps hold about as many tokens as a padded micro-batch of 8 (the chosen budget "
                    "also changes the batch size: fewer, bigger optimizer steps)"
                }
                if "packed_matched" in sides
                else {}
            ),
            **(
                {
                    "padded_random_zero3": "padded_random with distributed.zero_stage 3",
                    "packed_zero3": "packed with distributed.zero_stage 3",
                }
                if args.zero3_pair
                else {}
            ),
        },
        "machine": machine(),
        "versions": versions(),
        "git_revision": revision,
        "checks": {
            "useful_tokens_equal_on_all_runs": equal,
            "useful_tokens": all_useful[0] if len(all_useful) == 1 else all_useful,
            "loss_tokens": loss_tokens[0] if len(loss_tokens) == 1 else loss_tokens,
            "examples_per_run": examples[0] if len(examples) == 1 else examples,
            "each_example_once": each_once,
            "runs_checked": len(every),
            "runs_with_cpu_per_wall_below_0.9": [
                f"{r['side']}@{r['max_tokens']}" if r["max_tokens"] else r["side"]
                for r in every
                if r["cpu_seconds_per_wall_second"] < 0.9
            ],
        },
        "useful_tokens": {
            "per_side": {s: v[0] if len(v) == 1 else v for s, v in useful.items()},
            "equal_on_all_sides": equal,
        },
        "padding_efficiency": {s: medians[s]["padding_efficiency"] for s in sides},
        "token_slots": {s: first[s]["token_slots"] for s in sides},
        "optimizer_steps": {s: first[s]["optimizer_steps"] for s in sides},
        "useful_tokens_per_optimizer_step": {s: first[s]["useful_tokens_per_optimizer_step"] for s in sides},
        "medians": medians,
        "ratios": ratios,
        "budget_sweep": budget_sweep,
        "runs": runs,
        "notes": list(args.note or []),
    }
    end_digest = source_digest()
    changed = changed_files(files_at_start, source_files())
    result["lorakit_source"] = {
        "changed_during_run": changed,
        "git_revision_at_start": revision,
        "uncommitted_changes_at_start": dirty,
        "sha256_at_start": digest,
        "sha256_at_end": end_digest,
        "unchanged_during_run": digest == end_digest,
    }
    if digest != end_digest:
        log(f"warning: lorakit's source changed while the benchmark ran: {', '.join(changed)}")
    result["load_average_at_end"] = load_average()
    result["benchmark_wall_seconds"] = time.perf_counter() - t0
    output = Path(args.output).expanduser().resolve()
    write_json(output, result)
    log(
        f"useful tokens: {result['checks']['useful_tokens']} on every run (equal: {equal}); examples per run: {examples}"
    )
    if budget_sweep:
        log(
            "budget sweep (median useful tok/s): "
            + ", ".join(
                f"{b}: {budget_sweep['per_budget'][str(b)]['useful_tokens_per_second']:.0f}" for b in budgets
            )
        )
    for key, r in ratios.items():
        log(
            f"{key}: x{r['useful_tokens_per_second']:.2f} useful tokens/s (ratio of medians), paired "
            f"{[round(x, 2) for x in r['paired_useful_tokens_per_second']]} (median x{r['paired_median']:.2f})"
        )
    log(f"claim (>= {CLAIM}x packed vs padded_random): {'met' if result['claim_met'] else 'NOT met'}")
    log(f"wrote {output} in {result['benchmark_wall_seconds']:.0f} s")
    if plot(result, output.with_suffix(".png")):
        log(f"wrote {output.with_suffix('.png')}")
    else:
        log("matplotlib is not installed: no chart (pip install matplotlib)")
    if not (equal and each_once):
        print("error: the runs did not all train on the same tokens, each example once", file=sys.stderr)
        return 1
    return 0


LABELS = {
    "padded_random": "padded\nrandom",
    "padded_grouped": "padded\ngrouped by length",
    "packed": "packed",
    "packed_matched": "packed\n(batch matched)",
    "padded_random_zero3": "padded random\nZeRO-3",
    "packed_zero3": "packed\nZeRO-3",
}


def plot(result: dict, path: Path) -> bool:
    """Useful tokens/s per side (padding efficiency annotated) and the budget sweep; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sides = list(result["medians"])
    sweep_data = result.get("budget_sweep")
    widths = [len(sides) + 1] + ([len(sweep_data["budgets"]) + 1] if sweep_data else [])
    fig, axes = plt.subplots(
        1,
        len(widths),
        figsize=(1.45 * sum(widths) + 1, 4.8),
        squeeze=False,
        gridspec_kw={"width_ratios": widths},
    )
    ax = axes[0][0]
    for i, side in enumerate(sides):
        med = result["medians"][side]["useful_tokens_per_second"]
        runs = [r["useful_tokens_per_second"] for r in result["runs"] if r["side"] == side]
        ax.bar(i, med, color=f"C{i}", alpha=0.8)
        ax.scatter([i] * len(runs), runs, color="black", s=12, zorder=3)
        lines = [
            f"x{ratio['useful_tokens_per_second']:.2f} vs {ratio['versus']}"
            for ratio in result["ratios"].values()
            if ratio["side"] == side
        ]
        text = "\n".join(lines + [f"padding efficiency {result['padding_efficiency'][side]:.2f}"])
        ax.annotate(
            text,
            (i, max(runs + [med])),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    labels = [LABELS.get(s, s) for s in sides]
    labels = [
        lbl + (f"\nmax_tokens {result['max_tokens'][s]}" if result["max_tokens"].get(s) else "")
        for s, lbl in zip(sides, labels, strict=True)
    ]
    ax.set_xticks(range(len(sides)), labels, fontsize=8)
    ax.set_title("useful tokens / s (bars: median, dots: runs)", fontsize=10)
    ax.margins(y=0.2)
    if sweep_data:
        ax2 = axes[0][1]
        budgets = sweep_data["budgets"]
        per = sweep_data["per_budget"]
        meds = [per[str(b)]["useful_tokens_per_second"] for b in budgets]
        ax2.bar(range(len(budgets)), meds, color="C2", alpha=0.6)
        for i, b in enumerate(budgets):
            runs = per[str(b)]["useful_tokens_per_second_runs"]
            ax2.scatter([i] * len(runs), runs, color="black", s=12, zorder=3)
            ax2.annotate(
                f"eff. {per[str(b)]['padding_efficiency']:.2f}\n{per[str(b)]['optimizer_steps']} steps",
                (i, max(runs + [meds[i]])),
                xytext=(0, 4),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax2.set_xticks(
            range(len(budgets)), [f"{b}{' (chosen)' if b == sweep_data['best'] else ''}" for b in budgets]
        )
        ax2.set_xlabel("train.max_tokens (tokens per packed row)")
        ax2.set_title(
            f"budget sweep: packed useful tokens / s ({sweep_data['repeats']} round(s))", fontsize=10
        )
        ax2.margins(y=0.2)
    setup, v = result["setup"], result["versions"]
    fig.suptitle(
        f"tiny Llama, {setup['data']['rows']} rows, micro batch {setup['train']['micro_batch_size']} (padded), "
        f"{setup['dtype']}, 1 process, ZeRO-{'/'.join(str(z) for z in sorted(set(setup['zero_stage'].values())))}, {'/'.join(map(str, setup['torch_threads']))} torch thread(s), "
        f"CPU ({result['machine']['cpu_count']} cores), torch {v['torch']}, transformers {v['transformers']}, "
        f"deepspeed {v['deepspeed']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _budgets(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token budgets, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        spec = json.loads(Path(argv[1]).read_text())
        if spec.get("torch_threads"):
            import torch

            torch.set_num_threads(spec["torch_threads"])
        Path(argv[2]).write_text(json.dumps(worker(spec)))
        return 0
    p = argparse.ArgumentParser(
        prog="python benchmarks/causal_packing.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--output", default=str(DEFAULT_OUTPUT), help="result JSON (default: %(default)s)")
    p.add_argument("--max-samples", type=int, default=1000, help="first N training rows (default: all 1000)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds of every side (default: 3)")
    p.add_argument(
        "--budgets",
        type=_budgets,
        default=list(DEFAULT_BUDGETS),
        help="packed token budgets to sweep, comma-separated (default: 512,1024,2048,4096)",
    )
    p.add_argument(
        "--sweep-repeats", type=int, default=1, help="interleaved rounds of the budget sweep (default: 1)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=None, help="packed budget to use; skips the sweep (default: sweep)"
    )
    p.add_argument(
        "--zero3-pair",
        action="store_true",
        help="also run padded_random and packed with DeepSpeed ZeRO-3 (default: ZeRO-0 sides only)",
    )
    p.add_argument(
        "--cache-dir", default="~/.cache/lorakit", help="lorakit cache: tiny model, tokenized data"
    )
    p.add_argument(
        "--gradient-checkpointing",
        choices=("on", "off"),
        default="on",
        help="activation checkpointing on every side (default: on, lorakit's default)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads in every run (default: 1; 0: torch's default, one per core)",
    )
    p.add_argument("--note", action="append", help="a note to store in the result (repeatable)")
    p.add_argument("--plot-only", metavar="RESULT_JSON", help="only redraw the chart of an existing result")
    args = p.parse_args(argv)
    args.argv = argv
    if args.plot_only:
        path = Path(args.plot_only)
        if not plot(json.loads(path.read_text()), path.with_suffix(".png")):
            p.error("--plot-only needs matplotlib (pip install matplotlib)")
        return 0
    if args.max_samples < MICRO_BATCH or args.max_samples % MICRO_BATCH:
        # The padded sides' sampler fills a last short micro-batch with repeats: counts would differ.
        p.error(
            f"--max-samples must be a multiple of the micro batch size {MICRO_BATCH}, got {args.max_samples}"
        )
    if args.repeats < 1 or args.sweep_repeats < 1:
        p.error("--repeats and --sweep-repeats must be >= 1")
    if args.max_tokens is not None and args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
