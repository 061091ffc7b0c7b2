"""Packed vs padded encoder-decoder (T5) training in lorakit: useful tokens per second over one epoch, and the
eval loss after it.

    python benchmarks/seq2seq_packing.py [--dataset dialogues|news] [--output PATH] [--max-samples N]
                                         [--repeats K] [--examples-per-step N] [--examples-per-row 8,16,32]
                                         [--sweep-repeats K] [--max-eval-samples N] [--cache-dir DIR]
                                         [--torch-threads T] [--note TEXT]
    python benchmarks/seq2seq_packing.py --plot-only benchmarks/results/seq2seq_packing.json

Four ways to batch the same (source, summary) pairs, all trained with `lorakit.train` on the same tiny T5,
data, LoRA, optimizer, learning rate, schedule, dtype (float32) and gradient checkpointing, one process,
DeepSpeed without ZeRO, and the same number of examples per optimizer step (--examples-per-step, 32 by
default), so every side takes the same optimisation path in expectation:

- padded_random: random micro-batches of 8 padded to their longest member, 4 accumulated per step (data.packing
  false, data.group_by_length false): a shuffled DataLoader + DataCollatorForSeq2Seq, the usual Hugging Face
  setup;
- padded_grouped: micro-batches of 8 examples of similar length, padded to their longest member, 4 per step
  (data.packing false, data.group_by_length true);
- packed: lorakit's default packing (data.packing true, train.max_tokens unset): micro-batches of k random
  examples (train.micro_batch_size k) each packed, unpadded, into one encoder row and one decoder row,
  attention per example (lorakit_varlen_sdpa), 32 / k rows per step, so every optimizer step holds 32 random
  examples as on padded_random;
- packed_budget: rows filled to token budgets by the two-capacity multipack sampler (train.max_tokens set:
  the largest budget at which the epoch still packs into at least n / k rows, so rows of at most k examples
  on average, and no fewer optimizer steps than the padded sides), in random order with random trades.

The packed row size k is chosen by measurement in the same invocation: a sweep phase trains one epoch of the
packed side with rows of 8, 16 and 32 random examples (4, 2 and 1 rows per step) and picks the one with the
highest median useful tokens per CPU second (one torch thread: what the run computed, whatever other jobs
took from the machine); packed_budget takes the same k. The comparison rounds that follow are new runs.
Round r trains every side with seed 42 + r, so the eval-loss claim is judged over several data orders,
paired by seed.

Datasets (--dataset): `dialogues` (default), builtin:dialogue_summaries, SAMSum-shaped chats whose source and
target lengths are both long-tailed (random micro-batches of 8 about half full); `news`,
builtin:news_summaries, articles with targets of almost one length (random micro-batches two thirds full).

Every run evaluates once after its epoch (eval.generate false: the loss on the first --max-eval-samples
validation rows); the evaluation is timed apart and excluded from the epoch's seconds.

Every training run is a fresh subprocess of this script, and the sides are interleaved (the order reversed
every other round) so machine noise hits them all.
"""

from __future__ import annotations

import argparse
import json
import math
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

RESULTS = ROOT / "benchmarks" / "results"

MODEL = "tiny:t5"
# The data each --dataset trains on, and where its result goes by default.
DATASETS = {
    "dialogues": {
        "data": {
            "source": "builtin:dialogue_summaries",
            "input_column": "dialogue",
            "target_column": "summary",
            "prompt_template": "Summarize the following dialogue:\n{input}\nSummary:\n",
        },
        "output": RESULTS / "seq2seq_packing.json",
    },
    "news": {
        "data": {
            "source": "builtin:news_summaries",
            "input_column": "article",
            "target_column": "highlights",
            "prompt_template": "Summarize the following news article:\n{input}\nSummary:\n",  # quickstart
        },
        "output": RESULTS / "seq2seq_packing_news.json",
    },
}
MICRO_BATCH = 8
DTYPE = "float32"
BASE_SEED = 42
# Examples per optimizer step on every side: the padded sides accumulate 4 micro-batches of 8.
EXAMPLES_PER_STEP = 32
# Packed rows swept, in examples per row; each row size gets the accumulation that keeps EXAMPLES_PER_STEP.
DEFAULT_ROW_EXAMPLES = (8, 16, 32)
# The share of a row the packer fills (docs/packing.md: 0.94-0.99): bounds the budget search from above.
ROW_FILL = 0.95
# The claims of issue #10, as (name, side, versus, what, threshold).
CLAIMS = (
    {
        "name": "packed_vs_padded_random_speed",
        "side": "packed",
        "versus": "padded_random",
        "metric": "useful_tokens_per_second",
        "ratio_at_least": 2.0,
        "text": "packed trains >= 2x the useful tokens/s of random micro-batches padded to their longest member",
    },
    {
        "name": "packed_vs_padded_grouped_speed",
        "side": "packed",
        "versus": "padded_grouped",
        "metric": "useful_tokens_per_second",
        "ratio_at_least": 1.0,
        "text": "packed trains >= 1.0x the useful tokens/s of length-grouped padded micro-batches",
    },
    {
        "name": "packed_eval_loss_vs_padded_random",
        "side": "packed",
        "versus": "padded_random",
        "metric": "eval_loss",
        "text": "after one epoch on the same data, packed's eval loss <= padded_random's (median over runs)",
    },
)
SIDE_SPECS = {
    "padded_random": {"packing": False, "group_by_length": False},
    "padded_grouped": {"packing": False, "group_by_length": True},
    "packed": {"packing": True, "group_by_length": False},
    "packed_budget": {"packing": True, "group_by_length": False},
}
BASE_SIDES = ("padded_random", "padded_grouped", "packed", "packed_budget")
COMPARISONS = (
    ("packed", "padded_random"),
    ("packed", "padded_grouped"),
    ("packed", "packed_budget"),
    ("packed_budget", "padded_random"),
    ("padded_grouped", "padded_random"),
)
TRAIN = {
    "epochs": 1,
    "lr": 3e-3,
    "micro_batch_size": MICRO_BATCH,
    "warmup_ratio": 0.05,
    "lr_schedule": "linear",
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
}
LORA = {"kind": "lora", "r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"}
TIMING = {
    "epoch_seconds": "wall clock of lorakit.engine.loop.Trainer.run (our own timer, installed in the worker) "
    "minus the evaluation it calls after the epoch (timed apart: eval_seconds): the epoch loop with batch "
    "loading, collation, logging and the progress bar; model build, DeepSpeed initialisation, data "
    "preparation, evaluation and saving excluded (saving is disabled)",
    "eval_seconds": "wall clock of the evaluation after the epoch (loss only, no generation)",
    "step_seconds": "lorakit's summary['train_seconds']: the sum of per-step windows, batch loading included, "
    "logging excluded",
    "useful_tokens": "summary['train_tokens']: the non-pad source tokens plus the target tokens of every "
    "micro-batch trained on",
    "token_slots": "summary['padded_tokens']: padded sides: rows x (longest source + longest target) of every "
    "micro-batch; packed_budget: train.max_tokens + train.max_target_tokens per packed micro-batch (its "
    "capacity); packed (rows without a budget): the rows' own tokens",
    "epoch_cpu_seconds": "CPU time of the worker process over the epoch (time.process_time, evaluation "
    "excluded); with one torch thread, cpu/wall well below 1 means other jobs took the core away",
    "examples": "counted by the worker micro-batch by micro-batch (a packed micro-batch holds several "
    "examples; summary['train_samples'] counts rows)",
    "eval_loss": "summary['eval']['loss'] after the epoch: token-weighted cross-entropy on the validation "
    "rows (same rows, same caps, on every run)",
}


def recipe_dict(spec: dict) -> dict:
    """The lorakit recipe of one run; `spec` holds the side's batching and the shared settings."""
    train = dict(
        TRAIN,
        micro_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["accumulation"],
        seed=spec["seed"],
    )
    if spec["packing"] and spec.get("max_tokens"):
        train["max_tokens"] = spec["max_tokens"]
    return {
        "model": {
            "name_or_path": MODEL,
            "dtype": DTYPE,
            "gradient_checkpointing": spec["gradient_checkpointing"],
        },
        "method": dict(LORA),
        "data": {
            **DATASETS[spec["dataset"]]["data"],
            "split": "train",
            "eval_split": "validation",
            "format": "instruction",
            "max_samples": spec["max_samples"],
            "max_eval_samples": spec["max_eval_samples"],
            "max_source_length": "auto",
            "max_target_length": "auto",
            "packing": spec["packing"],
            "group_by_length": spec["group_by_length"],
            "cache_dir": spec["cache_dir"],
        },
        "train": train,
        "distributed": {"num_processes": 1, "zero_stage": 0},
        "eval": {"enabled": True, "generate": False},
        "output": {"dir": spec["work_dir"], "save_adapter": False},
    }


# ----------------------------------------------------------------------------------------------- worker
def worker(spec: dict) -> dict:
    """One training run in this (fresh) process: lorakit.train with our timers and batch counter."""
    import torch

    import lorakit
    from lorakit.engine import loop
    from lorakit.recipe import recipe_from_dict

    threads = spec.get("torch_threads") or 0
    timer: dict[str, float] = {"eval_seconds": 0.0, "eval_cpu_seconds": 0.0}
    run, train_window = loop.Trainer.run, loop.train_window
    counts = {
        "examples": 0,
        "micro_batches": 0,
        "rows": 0,
        "loss_tokens": 0,
        "source_tokens": 0,
        "counted_useful_tokens": 0,
        "widest_source_row": 0,
        "widest_target_row": 0,
    }

    def timed_run(self):
        # DeepSpeed's initialisation can reset torch's thread count; pin it again before the clock starts.
        if threads:
            torch.set_num_threads(threads)
        evaluate = self.evaluate
        if evaluate is not None:

            def timed_evaluate(*args, **kwargs):
                start_e, cpu_e = time.perf_counter(), time.process_time()
                try:
                    return evaluate(*args, **kwargs)
                finally:
                    timer["eval_seconds"] += time.perf_counter() - start_e
                    timer["eval_cpu_seconds"] += time.process_time() - cpu_e

            self.evaluate = timed_evaluate
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return run(self)
        finally:
            timer["epoch_seconds"] = time.perf_counter() - start - timer["eval_seconds"]
            timer["epoch_cpu_seconds"] = time.process_time() - cpu - timer["eval_cpu_seconds"]
            timer["torch_threads"] = torch.get_num_threads()

    def counted_window(engine, inputs, window, meter):
        for b in window:  # instrumentation only: reads the batches, changes nothing
            ids, labels = b["input_ids"], b["labels"]
            mask = b.get("attention_mask")
            source = int(mask.sum()) if mask is not None else int((b["source_segments"] > 0).sum())
            target = int((labels != -100).sum())
            counts["examples"] += int(b.get("num_examples", ids.shape[0]))
            counts["micro_batches"] += 1
            counts["rows"] += ids.shape[0]
            counts["loss_tokens"] += target
            counts["source_tokens"] += source
            counts["counted_useful_tokens"] += source + target
            counts["widest_source_row"] = max(counts["widest_source_row"], ids.shape[1])
            counts["widest_target_row"] = max(counts["widest_target_row"], labels.shape[1])
        return train_window(engine, inputs, window, meter)

    loop.Trainer.run, loop.train_window = timed_run, counted_window
    s = lorakit.train(recipe_from_dict(recipe_dict(spec))).summary
    batching = s["batching"]
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
        "batching": batching,
        "source_efficiency": batching.get("source_efficiency"),
        "target_efficiency": batching.get("target_efficiency"),
        "max_target_tokens": batching.get("max_target_tokens"),
        "loss_first": s["loss"]["first"],
        "loss_last": s["loss"]["last"],
        "eval_loss": (s.get("eval") or {}).get("loss"),
        "eval_rows": s["data"].get("eval_rows"),
        "attention": s["attention"],
        "zero_stage": s["zero_stage"],
        "trainable_params": s["trainable_params"],
        "total_params": s["total_params"],
        "peak_rss_bytes": s["peak_memory_bytes"]["cpu_rss"],
        "max_source_length": s["data"]["max_source_length"],
        "max_target_length": s["data"]["max_target_length"],
        "source_tokens_untruncated": s["data"].get("source_tokens_untruncated"),
        "target_tokens_untruncated": s["data"].get("target_tokens_untruncated"),
    }


# ------------------------------------------------------------------------------------------ orchestration
def run_side(
    side: str,
    batching: dict,
    shared: dict,
    tmp: Path,
    log,
    seed: int = BASE_SEED,
    label: str | None = None,
) -> dict:
    """Train one side in a fresh interpreter; returns its measurements and the rates derived from them.

    `batching`: {"micro_batch": examples per micro-batch (packed: per row, without a budget), "max_tokens":
    the packed rows' token budget or None, "accumulation": micro-batches per optimizer step}."""
    label = label or side
    spec = dict(shared, **SIDE_SPECS[side], side=side, seed=seed, accumulation=batching["accumulation"])
    spec["micro_batch"] = batching["micro_batch"]
    spec["max_tokens"] = batching["max_tokens"] if spec["packing"] else None
    spec["work_dir"] = str(tmp / f"work-{label}-{time.monotonic_ns()}")
    r = run_worker(__file__, spec, tmp, label)
    r.update(
        side=side,
        micro_batch=spec["micro_batch"],
        max_tokens=spec["max_tokens"],
        accumulation=spec["accumulation"],
        seed=seed,
    )
    r["padding_efficiency"] = r["useful_tokens"] / r["token_slots"]
    r["useful_tokens_per_second"] = r["useful_tokens"] / r["epoch_seconds"]
    r["useful_tokens_per_cpu_second"] = r["useful_tokens"] / r["epoch_cpu_seconds"]
    r["cpu_seconds_per_wall_second"] = r["epoch_cpu_seconds"] / r["epoch_seconds"]
    r["step_useful_tokens_per_second"] = r["useful_tokens"] / r["step_seconds"]
    r["token_slots_per_second"] = r["token_slots"] / r["epoch_seconds"]
    r["seconds_per_optimizer_step"] = r["epoch_seconds"] / r["optimizer_steps"]
    r["useful_tokens_per_optimizer_step"] = r["useful_tokens"] / r["optimizer_steps"]
    r["examples_per_optimizer_step"] = r["examples"] / r["optimizer_steps"]
    log(
        f"  {label:16s} epoch {r['epoch_seconds']:6.1f} s  {r['useful_tokens_per_second']:7.0f} useful tok/s  "
        f"eff. {r['padding_efficiency']:.3f}  {r['optimizer_steps']:4d} steps "
        f"({r['examples_per_optimizer_step']:.1f} ex/step)  seed {seed}  eval loss {r['eval_loss']:.4f}  "
        f"(eval {r['eval_seconds']:.1f} s, cpu/wall {r['cpu_seconds_per_wall_second']:.2f}, "
        f"load {r['load_avg_1min_before']:.2f})"
    )
    return r


MEDIAN_KEYS = (
    "epoch_seconds",
    "epoch_cpu_seconds",
    "eval_seconds",
    "step_seconds",
    "useful_tokens_per_second",
    "useful_tokens_per_cpu_second",
    "cpu_seconds_per_wall_second",
    "step_useful_tokens_per_second",
    "token_slots_per_second",
    "seconds_per_optimizer_step",
    "padding_efficiency",
    "eval_loss",
    "loss_last",
)


def medians_of(runs: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in runs) for k in MEDIAN_KEYS}
    for k in ("source_efficiency", "target_efficiency"):
        values = [r[k] for r in runs if r.get(k) is not None]
        out[k] = statistics.median(values) if values else None
    return out


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
            "useful_tokens_per_cpu_second": medians[side]["useful_tokens_per_cpu_second"]
            / medians[base]["useful_tokens_per_cpu_second"],
            "paired_useful_tokens_per_cpu_second": paired_ratios(
                runs, side, base, "useful_tokens_per_cpu_second"
            ),
            "step_useful_tokens_per_second": medians[side]["step_useful_tokens_per_second"]
            / medians[base]["step_useful_tokens_per_second"],
            "padding_efficiency_ratio": medians[side]["padding_efficiency"]
            / medians[base]["padding_efficiency"],
            "eval_loss_difference": medians[side]["eval_loss"] - medians[base]["eval_loss"],
            "paired_eval_loss_differences": [
                s - b
                for s, b in zip(
                    [r["eval_loss"] for r in runs if r["side"] == side],
                    [r["eval_loss"] for r in runs if r["side"] == base],
                    strict=False,
                )
            ],
        }
    return out


def claims_of(ratios: dict, medians: dict, valid: bool, side: str = "packed") -> list[dict]:
    """Each claim with the measured value it is judged on; claim_met comes from the recorded medians.

    Speed claims are judged on wall-clock useful tokens/s; the ratio of useful tokens per CPU second is
    recorded next to it (`cpu_ratio`, `cpu_claim_met`), since other jobs on a shared machine take wall time
    from the runs unevenly. The eval-loss claim compares the medians over the rounds' seeds; the paired
    differences (same seed) are recorded next to it.
    """
    out = []
    for c in CLAIMS:
        c = dict(c, side=side)
        key = f"{side}/{c['versus']}"
        if c["metric"] == "eval_loss":
            side_loss, base_loss = medians[side]["eval_loss"], medians[c["versus"]]["eval_loss"]
            out.append(
                dict(
                    c,
                    side_eval_loss=side_loss,
                    versus_eval_loss=base_loss,
                    paired_differences=ratios[key]["paired_eval_loss_differences"],
                    claim_met=bool(valid and side_loss <= base_loss),
                )
            )
        else:
            measured = ratios[key][c["metric"]]
            cpu = ratios[key]["useful_tokens_per_cpu_second"]
            out.append(
                dict(
                    c,
                    measured_ratio=measured,
                    paired_median=ratios[key]["paired_median"],
                    claim_met=bool(valid and measured >= c["ratio_at_least"]),
                    cpu_ratio=cpu,
                    cpu_claim_met=bool(valid and cpu >= c["ratio_at_least"]),
                )
            )
    return out


def rows_at(budget: int, sources: list[int], targets: list[int]) -> int:
    """Packed rows of one epoch at encoder budget `budget` (decoder budget: lorakit's default), as lorakit
    packs them on one process."""
    from lorakit.data.multipack_seq2seq import Seq2SeqMultipackBatchSampler, default_max_target_tokens

    max_target = default_max_target_tokens(sources, targets, budget)
    return len(Seq2SeqMultipackBatchSampler(sources, targets, budget, max_target, num_replicas=1))


def packed_candidates(
    row_examples: list[int], examples_per_step: int, sources: list[int], targets: list[int]
):
    """(examples per row, train.max_tokens, rows per optimizer step) for each packed row size swept.

    The budget is the largest multiple of 8 at which the epoch still packs into at least n / k rows, so
    rows hold at most k examples on average and, with examples_per_step / k rows per step, the epoch takes
    at least the padded sides' optimizer steps (never fewer, larger steps)."""
    out = []
    mean = sum(sources) / len(sources)
    for k in row_examples:
        need = math.ceil(len(sources) / k)
        lo = 8 * math.ceil(max(sources) / 8)  # any one example must fit
        hi = max(lo, 8 * math.ceil(2 * k * mean / ROW_FILL / 8))
        while lo < hi:  # rows_at falls as the budget grows
            mid = 8 * ((lo + hi + 8) // 16)
            if rows_at(mid, sources, targets) >= need:
                lo = mid
            else:
                hi = mid - 8
        out.append(
            {
                "examples_per_row": k,
                "max_tokens": lo,
                "accumulation": examples_per_step // k,
                "rows_per_epoch": rows_at(lo, sources, targets),
            }
        )
    return out


def row_candidates(row_examples: list[int], examples_per_step: int) -> list[dict]:
    """The packed side's row sizes swept: rows of k random examples (train.micro_batch_size k, no budget),
    examples_per_step / k rows per optimizer step."""
    return [
        {"examples_per_row": k, "micro_batch": k, "max_tokens": None, "accumulation": examples_per_step // k}
        for k in row_examples
    ]


def sweep(candidates: list[dict], rounds: int, shared: dict, tmp: Path, log) -> dict:
    """Packed epochs at every row size, interleaved; picks the one with the highest median useful tokens per
    CPU second (with one torch thread, what the run computed; wall seconds also hold what other jobs on a
    shared machine took, which moved a sweep run's wall time by up to 2x here)."""
    runs = []
    sizes = [c["examples_per_row"] for c in candidates]
    for rnd in range(rounds):
        order = list(candidates) if rnd % 2 == 0 else list(reversed(candidates))
        log(f"row size sweep {rnd + 1}/{rounds}: {' -> '.join(str(c['examples_per_row']) for c in order)}")
        for position, c in enumerate(order):
            r = run_side("packed", c, shared, tmp, log, label=f"sweep_{c['examples_per_row']}")
            runs.append(dict(r, repeat=rnd, position=position, examples_per_row=c["examples_per_row"]))
    per_size = {}
    for c in candidates:
        mine = [r for r in runs if r["examples_per_row"] == c["examples_per_row"]]
        per_size[str(c["examples_per_row"])] = {
            **medians_of(mine),
            **c,
            "useful_tokens_per_second_runs": [r["useful_tokens_per_second"] for r in mine],
            "eval_loss_runs": [r["eval_loss"] for r in mine],
            "optimizer_steps": mine[0]["optimizer_steps"],
            "micro_batches": mine[0]["micro_batches"],
            "useful_tokens_per_optimizer_step": mine[0]["useful_tokens_per_optimizer_step"],
            "examples_per_optimizer_step": mine[0]["examples_per_optimizer_step"],
        }
    best = max(sizes, key=lambda k: per_size[str(k)]["useful_tokens_per_cpu_second"])
    return {
        "how": "one epoch of the packed side at each row size (train.micro_batch_size k: packed rows of k "
        "random examples, with the rows per optimizer step that keep its examples per step), interleaved "
        "in this invocation before the comparison rounds (order reversed every other round), "
        f"seed {BASE_SEED}; the row size with the highest median useful tokens per CPU second is chosen; "
        "the comparison rounds are separate runs",
        "row_sizes": sizes,
        "candidates": candidates,
        "repeats": rounds,
        "per_row_size": per_size,
        "best": best,
        "best_by_wall_time": max(sizes, key=lambda k: per_size[str(k)]["useful_tokens_per_second"]),
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

    sides = list(BASE_SIDES)
    comparisons = COMPARISONS
    dataset = DATASETS[args.dataset]
    shared = {
        "dataset": args.dataset,
        "max_samples": args.max_samples,
        "max_eval_samples": args.max_eval_samples,
        "cache_dir": str(Path(args.cache_dir).expanduser().resolve()),
        "gradient_checkpointing": args.gradient_checkpointing == "on",
        "torch_threads": args.torch_threads,
    }
    scratch = str(Path(tempfile.gettempdir()) / "lorakit-bench-unused")

    def recipe_for(side: str, max_tokens: int | None):
        spec = dict(shared, **SIDE_SPECS[side], work_dir=scratch, seed=BASE_SEED, accumulation=1)
        spec.update(max_tokens=max_tokens, micro_batch=MICRO_BATCH)
        return recipe_from_dict(recipe_dict(spec))

    # Build the tiny model and tokenize once per distinct recipe here, so no timed run pays for it.
    data = lorakit.prepare(recipe_for("padded_random", None))
    log(data.describe())
    sources = [len(x) for x in data.train["input_ids"]]
    targets = [len(x) for x in data.train["labels"]]
    mean_source = sum(sources) / len(sources)
    candidates = row_candidates(args.examples_per_row, args.examples_per_step)
    lorakit.prepare(recipe_for("packed", None))
    _, config = load_config(recipe_for("padded_random", None))
    padded = {
        "micro_batch": MICRO_BATCH,
        "max_tokens": None,
        "accumulation": args.examples_per_step // MICRO_BATCH,
    }

    runs: list[dict] = []
    seeds = [BASE_SEED + r for r in range(args.repeats)]
    with tempfile.TemporaryDirectory(prefix="lorakit-bench-") as tmp_name:
        tmp = Path(tmp_name)
        if len(candidates) > 1:
            row_sweep = sweep(candidates, args.sweep_repeats, shared, tmp, log)
            chosen = next(c for c in candidates if c["examples_per_row"] == row_sweep["best"])
        else:
            row_sweep, chosen = None, candidates[0]
        # Rows filled to a token budget, at the same examples per row on average (lorakit with max_tokens).
        (budget,) = packed_candidates([chosen["examples_per_row"]], args.examples_per_step, sources, targets)
        budget["micro_batch"] = MICRO_BATCH
        lorakit.prepare(recipe_for("packed_budget", budget["max_tokens"]))
        log(
            f"packed rows: {chosen['examples_per_row']} random examples, {chosen['accumulation']} per optimizer "
            f"step; budget-filled rows: train.max_tokens {budget['max_tokens']}"
        )
        batching_of = {s: {"packed": chosen, "packed_budget": budget}.get(s, padded) for s in sides}
        for repeat, seed in enumerate(seeds):
            order = sides if repeat % 2 == 0 else list(reversed(sides))
            log(f"repeat {repeat + 1}/{args.repeats} (seed {seed}): {' -> '.join(order)}")
            for position, side in enumerate(order):
                r = run_side(side, batching_of[side], shared, tmp, log, seed=seed)
                runs.append(dict(r, repeat=repeat, position=position))

    every = runs + (row_sweep["runs"] if row_sweep else [])
    useful = {s: sorted({r["useful_tokens"] for r in runs if r["side"] == s}) for s in sides}
    all_useful = sorted({r["useful_tokens"] for r in every})
    loss_tokens = sorted({r["loss_tokens"] for r in every})
    examples = sorted({r["examples"] for r in every})
    eval_rows = sorted({r["eval_rows"] for r in every if r["eval_rows"] is not None})
    equal = len(all_useful) == 1 and all(r["counted_useful_tokens"] == r["useful_tokens"] for r in every)
    each_once = examples == [args.max_samples]
    evaluated = all(r["eval_loss"] is not None for r in every)
    valid = equal and each_once and evaluated
    medians = {s: medians_of([r for r in runs if r["side"] == s]) for s in sides}
    ratios = ratios_of(runs, medians, comparisons)
    claims = claims_of(ratios, medians, valid)
    first = {s: next(r for r in runs if r["side"] == s) for s in sides}
    r0 = first["padded_random"]
    result = {
        "benchmark": "seq2seq_packing",
        "measured": "useful (non-pad source + target) tokens per second over one training epoch of a tiny T5 "
        "in lorakit, and the eval loss after it: packed encoder/decoder rows vs micro-batches of 8 padded to "
        "their longest member (random, and grouped by length); same model, rows, LoRA, optimizer, learning "
        "rate, schedule, examples per optimizer step, dtype and checkpointing; rounds paired by seed; "
        "interleaved in one invocation",
        "dataset": args.dataset,
        "claims": claims,
        "claims_met": {c["name"]: c["claim_met"] for c in claims},
        "chosen_examples_per_row": chosen["examples_per_row"],
        "chosen_max_tokens": budget["max_tokens"],
        "budget_rows_per_epoch": budget["rows_per_epoch"],
        "micro_batch": {s: batching_of[s]["micro_batch"] for s in sides},
        "max_tokens": {s: batching_of[s]["max_tokens"] for s in sides},
        "accumulation": {s: batching_of[s]["accumulation"] for s in sides},
        "examples_per_step": args.examples_per_step,
        "seeds": seeds,
        "mean_source_tokens": mean_source,
        "max_target_tokens": {s: first[s]["max_target_tokens"] for s in sides},
        "command": "python benchmarks/seq2seq_packing.py " + " ".join(args.argv),
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
                        "d_model",
                        "d_ff",
                        "num_layers",
                        "num_decoder_layers",
                        "num_heads",
                        "vocab_size",
                    )
                },
                "total_params": r0["total_params"],
                "trainable_params": r0["trainable_params"],
            },
            "data": {
                **dataset["data"],
                "split": "train",
                "rows": args.max_samples,
                "format": "instruction",
                "max_source_length": r0["max_source_length"],
                "max_target_length": r0["max_target_length"],
                "caps_from": "data.max_source_length / max_target_length auto, as lorakit resolves them",
                "source_tokens_untruncated": r0["source_tokens_untruncated"],
                "target_tokens_untruncated": r0["target_tokens_untruncated"],
                "eval_split": "validation",
                "eval_rows": eval_rows[0] if len(eval_rows) == 1 else eval_rows,
            },
            "lora": LORA,
            "train": dict(TRAIN, optimizer="torch.optim.AdamW (DeepSpeed's torch_adam on CPU)"),
            "dtype": DTYPE,
            "gradient_checkpointing": shared["gradient_checkpointing"],
            "attention": {s: first[s]["attention"] for s in sides},
            "zero_stage": {s: first[s]["zero_stage"] for s in sides},
            "processes": 1,
            "evaluation": f"after the epoch, loss only (eval.generate false), first {args.max_eval_samples} "
            "validation rows; timed apart and excluded from epoch_seconds",
            "saving": "disabled",
            "torch_threads": sorted({r["torch_threads"] for r in every}),
        },
        "sides": {
            "padded_random": f"data.packing false, data.group_by_length false, micro_batch_size 8, "
            f"gradient_accumulation_steps {padded['accumulation']}: random micro-batches padded to their longest "
            "member (a shuffled DataLoader + DataCollatorForSeq2Seq)",
            "padded_grouped": f"data.packing false, data.group_by_length true, micro_batch_size 8, "
            f"gradient_accumulation_steps {padded['accumulation']}: micro-batches of similar lengths padded to "
            "their longest member",
            "packed": f"data.packing true, train.micro_batch_size {chosen['examples_per_row']} ("
            + ("chosen by the sweep" if row_sweep else "the only row size given, no sweep")
            + f"), train.max_tokens unset, gradient_accumulation_steps {chosen['accumulation']}: lorakit's "
            "default packing, encoder and decoder rows of that many random examples each (the optimizer steps "
            "of random padded batches), unpadded, attention per example",
            "packed_budget": f"data.packing true, train.max_tokens {budget['max_tokens']} (rows of about "
            f"{budget['examples_per_row']} examples on average), train.max_target_tokens lorakit's default, "
            f"gradient_accumulation_steps {budget['accumulation']}: rows filled to token budgets by the "
            "two-capacity multipack sampler, attention per example",
        },
        "batch_size_matching": f"every side takes about {args.examples_per_step} examples per optimizer step: "
        f"the padded sides {padded['accumulation']} micro-batches of {MICRO_BATCH}, the packed side rows of "
        "exactly k random examples, packed_budget rows of at most k examples on average (the largest budget "
        "that still packs the epoch into n / k rows or more), as many per step as keep that number "
        "(examples_per_optimizer_step records what each side took). lr and schedule are the same on every "
        "side; so is the number of optimizer steps, up to the budget packer's rounding.",
        "machine": machine(),
        "versions": versions(),
        "git_revision": revision,
        "checks": {
            "useful_tokens_equal_on_all_runs": equal,
            "useful_tokens": all_useful[0] if len(all_useful) == 1 else all_useful,
            "loss_tokens": loss_tokens[0] if len(loss_tokens) == 1 else loss_tokens,
            "examples_per_run": examples[0] if len(examples) == 1 else examples,
            "each_example_once": each_once,
            "every_run_evaluated": evaluated,
            "runs_checked": len(every),
            "runs_with_cpu_per_wall_below_0.9": [
                f"{r['side']}@{r['max_tokens'] or r['micro_batch']}"
                if r["side"].startswith("packed")
                else r["side"]
                for r in every
                if r["cpu_seconds_per_wall_second"] < 0.9
            ],
        },
        "useful_tokens": {
            "per_side": {s: v[0] if len(v) == 1 else v for s, v in useful.items()},
            "equal_on_all_sides": equal,
        },
        "padding_efficiency": {s: medians[s]["padding_efficiency"] for s in sides},
        "source_efficiency": {s: medians[s]["source_efficiency"] for s in sides},
        "target_efficiency": {s: medians[s]["target_efficiency"] for s in sides},
        "eval_loss": {s: medians[s]["eval_loss"] for s in sides},
        "token_slots": {s: first[s]["token_slots"] for s in sides},
        "optimizer_steps": {s: first[s]["optimizer_steps"] for s in sides},
        "examples_per_optimizer_step": {s: first[s]["examples_per_optimizer_step"] for s in sides},
        "useful_tokens_per_optimizer_step": {s: first[s]["useful_tokens_per_optimizer_step"] for s in sides},
        "medians": medians,
        "ratios": ratios,
        "row_sweep": row_sweep,
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
    if row_sweep:
        log(
            "row size sweep (median useful tok/s): "
            + ", ".join(
                f"{k}: {row_sweep['per_row_size'][str(k)]['useful_tokens_per_second']:.0f}"
                for k in row_sweep["row_sizes"]
            )
        )
    for s in sides:
        m = medians[s]
        log(
            f"{s:15s} median {m['useful_tokens_per_second']:7.0f} useful tok/s, epoch {m['epoch_seconds']:.1f} s, "
            f"eval loss {m['eval_loss']:.4f}, efficiency {m['padding_efficiency']:.3f}"
        )
    for key, r in ratios.items():
        log(
            f"{key}: x{r['useful_tokens_per_second']:.2f} useful tokens/s (ratio of medians), paired "
            f"{[round(x, 2) for x in r['paired_useful_tokens_per_second']]} (median x{r['paired_median']:.2f}); "
            f"eval loss {r['eval_loss_difference']:+.4f}"
        )
    for c in claims:
        cpu = f", by CPU time {'met' if c['cpu_claim_met'] else 'NOT met'}" if "cpu_claim_met" in c else ""
        log(f"claim {c['name']}: {'met' if c['claim_met'] else 'NOT met'}{cpu}")
    log(f"wrote {output} in {result['benchmark_wall_seconds']:.0f} s")
    if plot(result, output.with_suffix(".png")):
        log(f"wrote {output.with_suffix('.png')}")
    else:
        log("matplotlib is not installed: no chart (pip install matplotlib)")
    if not valid:
        print(
            "error: the runs did not all train on the same tokens, each example once, and evaluate",
            file=sys.stderr,
        )
        return 1
    return 0


LABELS = {
    "padded_random": "padded\nrandom",
    "padded_grouped": "padded\ngrouped by length",
    "packed": "packed\nrandom rows",
    "packed_budget": "packed\nbudget rows",
}


def plot(result: dict, path: Path) -> bool:
    """Useful tokens/s and eval loss per side, and the row size sweep; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sides = list(result["medians"])
    sweep_data = result.get("row_sweep")
    widths = [len(sides) + 1, len(sides) + 1] + ([len(sweep_data["row_sizes"]) + 1] if sweep_data else [])
    fig, axes = plt.subplots(
        1,
        len(widths),
        figsize=(1.3 * sum(widths) + 1, 4.8),
        squeeze=False,
        gridspec_kw={"width_ratios": widths},
    )
    labels = [
        LABELS.get(s, s)
        + (f"\nmax_tokens {result['max_tokens'][s]}" if result["max_tokens"].get(s) else "")
        + (f"\n{result['micro_batch'][s]} per row" if s == "packed" else "")
        for s in sides
    ]
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
        text = "\n".join(lines + [f"padding eff. {result['padding_efficiency'][side]:.2f}"])
        ax.annotate(
            text,
            (i, max(runs + [med])),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_xticks(range(len(sides)), labels, fontsize=7)
    ax.set_title("useful tokens / s (bars: median, dots: runs)", fontsize=9)
    ax.margins(y=0.25)
    ax = axes[0][1]
    for i, side in enumerate(sides):
        med = result["medians"][side]["eval_loss"]
        runs = [r["eval_loss"] for r in result["runs"] if r["side"] == side]
        ax.bar(i, med, color=f"C{i}", alpha=0.8)
        ax.scatter([i] * len(runs), runs, color="black", s=12, zorder=3)
        ax.annotate(
            f"{med:.3f}\n{result['optimizer_steps'][side]} steps",
            (i, max(runs + [med])),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=7,
        )
    low = min(r["eval_loss"] for r in result["runs"])
    high = max(r["eval_loss"] for r in result["runs"])
    ax.set_ylim(low - 0.5 * (high - low + 0.05), high + 0.5 * (high - low + 0.05))
    ax.set_xticks(range(len(sides)), labels, fontsize=7)
    ax.set_title("eval loss after the epoch (lower is better)", fontsize=9)
    if sweep_data:
        ax2 = axes[0][2]
        sizes = sweep_data["row_sizes"]
        per = sweep_data["per_row_size"]
        # The sweep chooses by useful tokens per CPU second (see sweep()).
        meds = [per[str(b)]["useful_tokens_per_cpu_second"] for b in sizes]
        ax2.bar(range(len(sizes)), meds, color="C2", alpha=0.6)
        for i, b in enumerate(sizes):
            runs = [
                r["useful_tokens_per_cpu_second"] for r in sweep_data["runs"] if r["examples_per_row"] == b
            ]
            ax2.scatter([i] * len(runs), runs, color="black", s=12, zorder=3)
            ax2.annotate(
                f"eff. {per[str(b)]['padding_efficiency']:.2f}\n{per[str(b)]['optimizer_steps']} steps\n"
                f"eval {per[str(b)]['eval_loss']:.3f}",
                (i, max(runs + [meds[i]])),
                xytext=(0, 4),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=7,
            )
        ax2.set_xticks(
            range(len(sizes)),
            [f"{b}{' (chosen)' if b == sweep_data['best'] else ''}" for b in sizes],
            fontsize=8,
        )
        ax2.set_xlabel("train.micro_batch_size (random examples per packed row)", fontsize=8)
        ax2.set_title(
            f"row size sweep: packed useful tokens / CPU s ({sweep_data['repeats']} round(s))", fontsize=9
        )
        ax2.margins(y=0.3)
    setup, v = result["setup"], result["versions"]
    fig.suptitle(
        f"tiny T5, {setup['data']['rows']} rows, micro batch {setup['train']['micro_batch_size']} (padded), "
        f"{setup['dtype']}, 1 process, ZeRO-0, {'/'.join(map(str, setup['torch_threads']))} torch thread(s), "
        f"CPU ({result['machine']['cpu_count']} cores), torch {v['torch']}, transformers {v['transformers']}, "
        f"deepspeed {v['deepspeed']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _row_examples(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers of examples, got {text!r}")
    return sorted(set(values))


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
        prog="python benchmarks/seq2seq_packing.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--dataset",
        choices=sorted(DATASETS),
        default="dialogues",
        help="builtin:dialogue_summaries (default) or builtin:news_summaries",
    )
    p.add_argument(
        "--output",
        default=None,
        help="result JSON (default: benchmarks/results/seq2seq_packing.json for dialogues, "
        "seq2seq_packing_news.json for news)",
    )
    p.add_argument(
        "--max-samples",
        type=int,
        default=992,
        help="first N training rows of 1000 (default: 992, a multiple of every row size swept)",
    )
    p.add_argument(
        "--max-eval-samples", type=int, default=100, help="validation rows for the eval loss (default: 100)"
    )
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds of every side (default: 2)")
    p.add_argument(
        "--examples-per-step",
        type=int,
        default=EXAMPLES_PER_STEP,
        help=f"examples per optimizer step on every side (default: {EXAMPLES_PER_STEP})",
    )
    p.add_argument(
        "--examples-per-row",
        type=_row_examples,
        default=list(DEFAULT_ROW_EXAMPLES),
        help="packed row sizes to sweep, in examples per row, comma-separated; each must divide "
        "--examples-per-step; one value skips the sweep (default: 8,16,32)",
    )
    p.add_argument(
        "--sweep-repeats", type=int, default=1, help="interleaved rounds of the row size sweep (default: 1)"
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
    if args.repeats < 1 or args.sweep_repeats < 1 or args.max_eval_samples < 1:
        p.error("--repeats, --sweep-repeats and --max-eval-samples must be >= 1")
    if args.examples_per_step % MICRO_BATCH:
        p.error(f"--examples-per-step must be a multiple of the micro batch size {MICRO_BATCH}")
    bad = [k for k in args.examples_per_row if args.examples_per_step % k]
    if bad:
        p.error(f"--examples-per-row {bad} must divide --examples-per-step {args.examples_per_step}")
    uneven = [k for k in args.examples_per_row if args.max_samples % k]
    if uneven:
        # A last row short of k random examples would be filled with repeats: counts would differ.
        p.error(f"--max-samples {args.max_samples} must be a multiple of every --examples-per-row {uneven}")
    if args.output is None:
        args.output = str(DATASETS[args.dataset]["output"])
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
