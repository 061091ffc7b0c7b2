"""lorakit vs the Seq2SeqTrainer recipe people copy: useful tokens per second over one epoch.

    python benchmarks/seq2seq_padding.py [--output benchmarks/results/seq2seq_padding.json]
                                         [--max-samples N] [--repeats K] [--cache-dir DIR]
                                         [--torch-threads T] [--gradient-checkpointing on|off] [--note TEXT]
    python benchmarks/seq2seq_padding.py --plot-only benchmarks/results/seq2seq_padding.json

The baseline is the recipe of Philipp Schmid's "Fine-tune FLAN-T5 XL/XXL using DeepSpeed & Hugging Face
Transformers": tokenize with padding="max_length" to max_source_length / max_target_length (pad ids in the
labels replaced by -100), then Seq2SeqTrainer + DataCollatorForSeq2Seq, here with a peft LoRA adapter.
The expert side is what a careful Hugging Face user writes instead: no padding at tokenization,
DataCollatorForSeq2Seq padding each batch to its longest member, and the Trainer's length-grouped sampler
(`train_sampling_strategy="group_by_length"`, transformers 5's name for `group_by_length=True`).
lorakit trains the same rows with `lorakit.train` (length-grouped batches padded to their longest member).

All sides: the tiny T5 that lorakit.testing builds, the builtin news_summaries train split (first N rows),
the same template, caps (the ones lorakit resolves), LoRA config, optimizer, LR schedule, micro batch size,
dtype (float32) and gradient checkpointing; one process; no evaluation; no checkpoint saving.

Sides come in like-for-like pairs on 1 process: plain Seq2SeqTrainer (max_length padding, and the expert's
dynamic padding) vs lorakit on the DeepSpeed engine without ZeRO (stage 0), and Seq2SeqTrainer with DeepSpeed
ZeRO-3 (as the guide runs it) vs lorakit with ZeRO-3. On one process accelerate's DeepSpeed plugin runs correctly on CPU (it was multi-process runs that
misbehaved, see DESIGN.md), so the guide's ZeRO-3 pipeline is measured, not assumed.

Every training run is a fresh subprocess of this script (no state leaks from one run to the next, e.g.
transformers' global "ZeRO-3 is on" flag), and the sides are interleaved so machine noise hits them all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from a checkout: benchmarks.common and this lorakit

from benchmarks.common import machine as _machine  # noqa: E402
from benchmarks.common import pairs as _pairs  # noqa: E402
from benchmarks.common import run_worker, source_dirty  # noqa: E402
from benchmarks.common import source_digest as _source_digest  # noqa: E402
from benchmarks.common import versions as _versions  # noqa: E402

DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "seq2seq_padding.json"

PROMPT = "Summarize the following news article:\n{input}\nSummary:\n"  # recipes/quickstart.yaml
MICRO_BATCH = 8
DTYPE = "float32"  # bf16 is not "the same way" on CPU: DeepSpeed casts weights, Trainer(bf16=True) autocasts
SIDES = ("baseline", "baseline_zero3", "expert", "lorakit_zero0", "lorakit_zero3")
# The Hugging Face sides, and how each pads: to max_length (the guide) or per batch (the expert).
HF_PADDING = {"baseline": "max_length", "baseline_zero3": "max_length", "expert": "dynamic"}
# (lorakit side, Hugging Face side): each lorakit side is compared with the pipelines that use DeepSpeed the
# same way.
PAIRS = (("lorakit_zero0", "baseline"), ("lorakit_zero3", "baseline_zero3"), ("lorakit_zero0", "expert"))
HEADLINE = PAIRS[0]


def pair_key(side: str, versus: str) -> str:
    """The key of a pair in the result's `ratios`: `lorakit_zero0_vs_baseline`."""
    return f"{side}_vs_{versus}"


CLAIM = 3.0
# The hyper-parameters all sides share. Speed does not depend on lr; 3e-3 trains the random tiny T5 smoothly.
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
    "epoch_seconds": "wall clock of the epoch loop, batch loading, logging and progress bar included; model "
    "build, optimizer setup and saving excluded. Baseline: own timer from TrainerCallback.on_epoch_begin to "
    "on_epoch_end. lorakit: own timer around lorakit.engine.loop.Trainer.run (eval disabled, so the loop only).",
    "step_seconds": "sum of per-step windows, batch loading excluded. Baseline: on_step_begin -> on_step_end "
    "(forward, backward, clipping, optimizer and scheduler step). lorakit: summary['train_seconds'].",
    "trainer_train_runtime": "Hugging Face sides only: train_runtime from trainer.train() metrics (includes dataloader "
    "and optimizer setup), for reference.",
    "useful_tokens": "non-pad source tokens + target tokens (labels != -100) of every batch trained on, "
    "counted batch by batch on every side",
    "token_slots": "source + target positions of every batch, padding included",
}


def _recipe_dict(max_samples: int, cache_dir: str, zero_stage: int, gc: bool, out_dir: str) -> dict:
    return {
        "model": {"name_or_path": "tiny:t5", "dtype": DTYPE, "gradient_checkpointing": gc},
        "method": dict(LORA),
        "data": {
            "source": "builtin:news_summaries",
            "split": "train",
            "input_column": "article",
            "target_column": "highlights",
            "prompt_template": PROMPT,
            "max_samples": max_samples,
            "max_source_length": "auto",
            "max_target_length": "auto",
            "cache_dir": cache_dir,
        },
        "train": {
            k: TRAIN[k]
            for k in (
                "epochs",
                "lr",
                "micro_batch_size",
                "gradient_accumulation_steps",
                "warmup_ratio",
                "lr_schedule",
                "weight_decay",
                "max_grad_norm",
                "seed",
            )
        },
        "distributed": {"num_processes": 1, "zero_stage": zero_stage},
        "eval": {"enabled": False},
        "output": {"dir": out_dir, "save_adapter": False},
    }


# ----------------------------------------------------------------------------------------------- workers
def _worker_lorakit(spec: dict) -> dict:
    import torch

    import lorakit
    from lorakit.engine import loop
    from lorakit.recipe import recipe_from_dict

    # Instrumentation only: time the epoch loop the same way as the baseline's on_epoch_begin/end.
    timer: dict[str, float] = {}
    run = loop.Trainer.run

    def timed_run(self):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return run(self)
        finally:
            timer["epoch_seconds"] = time.perf_counter() - start
            timer["epoch_cpu_seconds"] = time.process_time() - cpu

    loop.Trainer.run = timed_run
    raw = _recipe_dict(
        spec["max_samples"],
        spec["cache_dir"],
        spec["zero_stage"],
        spec["gradient_checkpointing"],
        spec["work_dir"],
    )
    s = lorakit.train(recipe_from_dict(raw)).summary
    return {
        "epoch_seconds": timer["epoch_seconds"],
        "epoch_cpu_seconds": timer["epoch_cpu_seconds"],
        "step_seconds": s["train_seconds"],
        "steps": s["steps"],
        "samples": s["train_samples"],
        "useful_tokens": s["train_tokens"],
        "token_slots": s["padded_tokens"],
        "lorakit_tokens_per_second": s["tokens_per_second"],
        "lorakit_packing_efficiency": s["packing_efficiency"],
        "loss_first": s["loss"]["first"],
        "loss_last": s["loss"]["last"],
        "attention": s["attention"],
        "trainable_params": s["trainable_params"],
        "total_params": s["total_params"],
        "peak_rss_bytes": s["peak_memory_bytes"]["cpu_rss"],
        "torch_threads": torch.get_num_threads(),
        "max_source_length": s["data"]["max_source_length"],
        "max_target_length": s["data"]["max_target_length"],
    }


def _worker_baseline(spec: dict) -> dict:
    import datasets
    import torch
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import (
        AutoModelForSeq2SeqLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        TrainerCallback,
        set_seed,
    )

    from lorakit.data.samples import builtin_dataset_dir
    from lorakit.testing import resolve_model_source

    src_len, tgt_len = spec["max_source_length"], spec["max_target_length"]
    source = resolve_model_source("tiny:t5", spec["cache_dir"])
    tokenizer = AutoTokenizer.from_pretrained(source)
    raw = datasets.load_dataset(
        "json",
        data_files={"train": str(builtin_dataset_dir("news_summaries") / "train.jsonl")},
        split="train",
    )
    raw = raw.select(range(spec["max_samples"]))

    # The guide pads every row to the caps; the expert leaves padding to the collator, batch by batch.
    dynamic = HF_PADDING[spec["side"]] == "dynamic"
    padding = "do_not_pad" if dynamic else "max_length"

    def preprocess(sample):  # the guide's preprocess_function
        inputs = [PROMPT.format(input=x) for x in sample["article"]]
        model_inputs = tokenizer(inputs, max_length=src_len, padding=padding, truncation=True)
        labels = tokenizer(
            text_target=sample["highlights"], max_length=tgt_len, padding=padding, truncation=True
        )
        pad = tokenizer.pad_token_id
        model_inputs["labels"] = [[t if t != pad else -100 for t in label] for label in labels["input_ids"]]
        return model_inputs

    train = raw.map(preprocess, batched=True, remove_columns=raw.column_names)

    set_seed(TRAIN["seed"])
    model = AutoModelForSeq2SeqLM.from_pretrained(
        source, dtype=getattr(torch, DTYPE), attn_implementation=spec["attention"]
    )
    model.config.use_cache = False
    model = get_peft_model(
        model,
        LoraConfig(
            r=LORA["r"],
            lora_alpha=LORA["alpha"],
            lora_dropout=LORA["dropout"],
            target_modules=LORA["target_modules"],
            task_type=TaskType.SEQ_2_SEQ_LM,
        ),
    )
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    counts = {"useful_tokens": 0, "token_slots": 0, "samples": 0}

    def counting_collator(features):  # counts what every trained batch holds; the batch itself is untouched
        batch = collator(features)
        counts["useful_tokens"] += int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())
        counts["token_slots"] += batch["input_ids"].numel() + batch["labels"].numel()
        counts["samples"] += batch["input_ids"].shape[0]
        return batch

    class Timer(TrainerCallback):
        def __init__(self):
            self.epoch = self.epoch_cpu = self.steps = 0.0
            self._e = self._c = self._s = 0.0

        def on_train_begin(self, *a, **k):
            # DeepSpeed's initialisation inside the Trainer resets torch's thread count (to one per core);
            # pin it again so every side computes with the same number of threads.
            if spec.get("torch_threads"):
                torch.set_num_threads(spec["torch_threads"])

        def on_epoch_begin(self, *a, **k):
            self._e, self._c = time.perf_counter(), time.process_time()

        def on_epoch_end(self, *a, **k):
            self.epoch += time.perf_counter() - self._e
            self.epoch_cpu += time.process_time() - self._c

        def on_step_begin(self, *a, **k):
            self._s = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.steps += time.perf_counter() - self._s

    timer = Timer()
    deepspeed_config = None
    if spec.get("baseline_zero_stage") == 3:
        # The guide's ds_flan_t5_z3_config (bf16 off: both sides run float32 here), with torch's AdamW since
        # DeepSpeed's fused Adam needs CUDA. One process: the launcher variables DeepSpeed reads.
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(spec["master_port"]),
        )
        deepspeed_config = {
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "optimizer": {
                "type": "AdamW",
                "params": {
                    "lr": "auto",
                    "betas": "auto",
                    "eps": "auto",
                    "weight_decay": "auto",
                    "torch_adam": True,
                },
            },
            "zero_optimization": {
                "stage": 3,
                "overlap_comm": False,
                "contiguous_gradients": True,
                "stage3_gather_16bit_weights_on_model_save": True,
            },
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
        }
    args = Seq2SeqTrainingArguments(
        deepspeed=deepspeed_config,
        output_dir=spec["work_dir"],
        per_device_train_batch_size=MICRO_BATCH,
        num_train_epochs=TRAIN["epochs"],
        learning_rate=TRAIN["lr"],
        warmup_steps=TRAIN["warmup_ratio"],
        lr_scheduler_type=TRAIN["lr_schedule"],
        weight_decay=TRAIN["weight_decay"],
        max_grad_norm=TRAIN["max_grad_norm"],
        seed=TRAIN["seed"],
        gradient_accumulation_steps=TRAIN["gradient_accumulation_steps"],
        # torch.optim.AdamW, as lorakit's DeepSpeed config gives it on CPU (torch_adam), not the fused one.
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        activation_checkpointing=spec["gradient_checkpointing"],
        activation_checkpointing_kwargs={"use_reentrant": False} if spec["gradient_checkpointing"] else None,
        use_cpu=True,
        bf16=False,
        fp16=False,
        eval_strategy="no",
        save_strategy="no",
        logging_steps=1,
        report_to="none",
        dataloader_num_workers=0,
        # The expert's group_by_length=True (LengthGroupedSampler); the guide samples at random.
        train_sampling_strategy="group_by_length" if dynamic else "random",
        predict_with_generate=False,
        label_names=["labels"],
    )
    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=train,
        data_collator=counting_collator,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    metrics = trainer.train().metrics
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "epoch_seconds": timer.epoch,
        "epoch_cpu_seconds": timer.epoch_cpu,
        "step_seconds": timer.steps,
        "steps": trainer.state.global_step,
        "trainer_train_runtime": metrics["train_runtime"],
        **counts,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "attention": model.config._attn_implementation,
        "trainable_params": trainable,
        "total_params": sum(p.numel() for p in model.parameters()),
        "torch_threads": torch.get_num_threads(),
        "train_sampling_strategy": args.train_sampling_strategy,
        "max_source_length": max(map(len, train["input_ids"])),
        "max_target_length": max(map(len, train["labels"])),
    }


# ------------------------------------------------------------------------------------------ orchestration
def _run_side(side: str, spec: dict, tmp: Path, log) -> dict:
    """Run one side in a fresh interpreter and return its measurements."""
    spec = dict(spec, side=side, work_dir=str(tmp / f"work-{side}-{time.monotonic_ns()}"))
    if side.startswith("lorakit_zero"):
        spec["zero_stage"] = int(side.removeprefix("lorakit_zero"))
    if side == "baseline_zero3":
        from lorakit.engine.launch import free_port

        spec.update(baseline_zero_stage=3, master_port=free_port())
    result = run_worker(__file__, spec, tmp, side)
    result["side"] = side
    load = result["load_avg_1min_before"]
    result["padding_efficiency"] = result["useful_tokens"] / result["token_slots"]
    result["useful_tokens_per_second"] = result["useful_tokens"] / result["epoch_seconds"]
    result["step_useful_tokens_per_second"] = result["useful_tokens"] / result["step_seconds"]
    result["token_slots_per_second"] = result["token_slots"] / result["epoch_seconds"]
    result["seconds_per_step"] = result["epoch_seconds"] / result["steps"]
    log(
        f"  {side:14s} epoch {result['epoch_seconds']:7.1f} s  {result['useful_tokens_per_second']:8.1f} useful tok/s"
        f"  efficiency {result['padding_efficiency']:.3f}  (load {load:.1f})"
    )
    return result


def _summarise(runs: list[dict]) -> tuple[dict, dict]:
    keys = (
        "epoch_seconds",
        "epoch_cpu_seconds",
        "useful_tokens_per_second",
        "step_seconds",
        "step_useful_tokens_per_second",
        "token_slots_per_second",
        "seconds_per_step",
        "padding_efficiency",
    )
    medians = {
        side: {k: statistics.median(r[k] for r in runs if r["side"] == side) for k in keys} for side in SIDES
    }
    ratios = {}
    for side, base_side in PAIRS:
        base, m = medians[base_side], medians[side]
        paired = [
            lk["useful_tokens_per_second"] / b["useful_tokens_per_second"]
            for b, lk in _pairs(runs, side, base_side)
        ]
        ratios[pair_key(side, base_side)] = {
            "side": side,
            "versus": base_side,
            "useful_tokens_per_second": m["useful_tokens_per_second"] / base["useful_tokens_per_second"],
            "epoch_time_speedup": base["epoch_seconds"] / m["epoch_seconds"],
            "step_useful_tokens_per_second": m["step_useful_tokens_per_second"]
            / base["step_useful_tokens_per_second"],
            "paired_useful_tokens_per_second": paired,
            "paired_median": statistics.median(paired),
            "padding_efficiency_ratio": m["padding_efficiency"] / base["padding_efficiency"],
        }
    return medians, ratios


def _analysis(medians: dict, first: dict) -> dict:
    """Arithmetic on the medians above (derived, not separately measured): where the epoch time goes."""
    steps = first["baseline"]["steps"]
    z3, z0, base, base3, expert = (
        medians[s]["epoch_seconds"]
        for s in ("lorakit_zero3", "lorakit_zero0", "baseline", "baseline_zero3", "expert")
    )
    return {
        "steps_per_epoch": {s: first[s]["steps"] for s in SIDES},
        "token_slots_baseline_over_lorakit": first["baseline"]["token_slots"]
        / first[HEADLINE[0]]["token_slots"],
        "token_slots_expert_over_lorakit": first["expert"]["token_slots"] / first[HEADLINE[0]]["token_slots"],
        "expert_minus_zero0_seconds_per_step": (expert - z0) / steps,
        "seconds_per_step": {s: medians[s]["seconds_per_step"] for s in SIDES},
        "zero3_minus_zero0_seconds_per_step": (z3 - z0) / steps,
        "zero3_minus_zero0_share_of_zero3_epoch": (z3 - z0) / z3,
        "baseline_minus_zero0_seconds_per_step": (base - z0) / steps,
        "baseline_zero3_minus_baseline_seconds_per_step": (base3 - base) / steps,
        "cpu_seconds_per_wall_second": {
            s: medians[s]["epoch_cpu_seconds"] / medians[s]["epoch_seconds"] for s in SIDES
        },
        "how_to_read": "same batches and token slots on lorakit_zero3 and lorakit_zero0, so their difference per "
        "step is what the ZeRO-3 engine adds per step (parameter gather/release hooks on every module, run again "
        "by gradient checkpointing's recompute); a fixed cost per step, independent of padding",
    }


def orchestrate(args) -> int:
    t0 = time.perf_counter()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    from lorakit.rundir import git_revision, write_json

    revision, digest = git_revision(ROOT), _source_digest()
    dirty = source_dirty() if revision else None

    def log(msg):
        print(msg, flush=True)

    import lorakit
    from lorakit.model import load_config
    from lorakit.model.attention import choose_attention
    from lorakit.recipe import recipe_from_dict

    cache_dir = str(Path(args.cache_dir).expanduser().resolve())
    gc = args.gradient_checkpointing == "on"
    recipe = recipe_from_dict(
        _recipe_dict(args.max_samples, cache_dir, 3, gc, str(Path(tempfile.gettempdir()) / "x"))
    )
    data = lorakit.prepare(recipe)  # builds the tiny T5, tokenizes and caches; the lorakit runs reuse it
    log(data.describe())
    _, config = load_config(recipe)
    from transformers import T5ForConditionalGeneration

    spec = {
        "max_samples": args.max_samples,
        "cache_dir": cache_dir,
        "gradient_checkpointing": gc,
        "max_source_length": data.lengths.max_source_length,
        "max_target_length": data.lengths.max_target_length,
        "attention": choose_attention("auto", T5ForConditionalGeneration),
        "torch_threads": args.torch_threads,
    }
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="lorakit-bench-") as tmp:
        for repeat in range(args.repeats):
            # Alternate the order so no side always runs first (or right after the same neighbour).
            order = list(SIDES) if repeat % 2 == 0 else list(reversed(SIDES))
            log(f"repeat {repeat + 1}/{args.repeats}: {' -> '.join(order)}")
            for position, side in enumerate(order):
                r = _run_side(side, spec, Path(tmp), log)
                runs.append(dict(r, repeat=repeat, position=position))

    medians, ratios = _summarise(runs)
    tokens = {side: sorted({r["useful_tokens"] for r in runs if r["side"] == side}) for side in SIDES}
    equal = all(len(v) == 1 for v in tokens.values()) and len({v[0] for v in tokens.values()}) == 1
    first = {side: next(r for r in runs if r["side"] == side) for side in SIDES}
    headline = ratios[pair_key(*HEADLINE)]["useful_tokens_per_second"]
    result = {
        "benchmark": "seq2seq_padding",
        "measured": "useful (non-pad source + target) tokens per second over one training epoch: lorakit.train "
        "(length-grouped batches padded to their longest member) vs transformers Seq2SeqTrainer + peft LoRA on "
        "data padded to max_length as in the FLAN-T5 DeepSpeed guide; same model, rows, caps, LoRA, optimizer, "
        "batch size, dtype and checkpointing; interleaved in one invocation",
        "claim": f"lorakit processes useful tokens >= {CLAIM}x faster per epoch than the padded Seq2SeqTrainer "
        f"pipeline using DeepSpeed the same way ({HEADLINE[0]} vs {HEADLINE[1]}); against the expert's dynamic "
        "padding with length grouping the speed-up is measured and reported, not claimed",
        "claim_met": bool(equal and headline >= CLAIM),
        "claim_met_by_pair": {
            key: bool(equal and r["useful_tokens_per_second"] >= CLAIM) for key, r in ratios.items()
        },
        "headline_side": HEADLINE[0],
        "headline_pair": pair_key(*HEADLINE),
        "headline_ratio": headline,
        "command": "python benchmarks/seq2seq_padding.py " + " ".join(args.argv),
        "date": started,
        "benchmark_wall_seconds": None,
        "timing": TIMING,
        "setup": {
            "model": {
                "name_or_path": "tiny:t5",
                "built_by": "lorakit.testing.resolve_model_source",
                **{
                    k: getattr(config, k)
                    for k in (
                        "d_model",
                        "d_ff",
                        "d_kv",
                        "num_layers",
                        "num_decoder_layers",
                        "num_heads",
                        "vocab_size",
                        "feed_forward_proj",
                    )
                },
                "total_params": first[HEADLINE[0]]["total_params"],
                "trainable_params": {s: first[s]["trainable_params"] for s in SIDES},
            },
            "data": {
                "source": "builtin:news_summaries",
                "split": "train",
                "rows": args.max_samples,
                "prompt_template": PROMPT,
                "max_source_length": data.lengths.max_source_length,
                "max_target_length": data.lengths.max_target_length,
                "lengths_from": "lorakit.prepare(recipe).lengths (auto: longest templated source, p95 target)",
                **{
                    k: data.stats.get(k)
                    for k in (
                        "source_tokens_untruncated",
                        "target_tokens_untruncated",
                        "truncated_sources",
                        "truncated_targets",
                    )
                },
            },
            "lora": LORA,
            "train": dict(TRAIN, optimizer="torch.optim.AdamW (betas 0.9/0.999, eps 1e-8) on all sides"),
            "dtype": DTYPE,
            "dtype_why": "float32 runs the same way on both sides on CPU; bf16 does not "
            "(DeepSpeed bf16 keeps bf16 weights, Trainer bf16=True autocasts fp32 weights)",
            "gradient_checkpointing": gc,
            "gradient_checkpointing_kwargs": {"use_reentrant": False} if gc else None,
            "attention": {s: first[s]["attention"] for s in SIDES},
            "processes": 1,
            "evaluation": "disabled on all sides",
            "saving": "disabled on all sides",
            "torch_threads": sorted({r["torch_threads"] for r in runs}),
        },
        "sides": {
            "baseline": "transformers Seq2SeqTrainer + peft LoRA; guide preprocessing: tokenizer(padding="
            "'max_length', truncation=True) to the caps, label pad ids -> -100; DataCollatorForSeq2Seq(model=model, "
            "label_pad_token_id=-100); RandomSampler; no DeepSpeed: accelerate's DeepSpeed plugin does not run "
            "correctly on CPU here (each rank thought it was alone; docs/architecture.md), so plain Trainer on 1 "
            "process. The guide's pad_to_multiple_of=8 is left out: it would round the caps up (365/25 -> 368/32) "
            "and add padding, so leaving it out can only help the baseline.",
            "baseline_zero3": "the same Seq2SeqTrainer pipeline with the guide's DeepSpeed ZeRO-3 config "
            "(Seq2SeqTrainingArguments(deepspeed=...), stage 3, torch AdamW, float32), 1 process; the model is "
            "loaded before the training arguments, as in the guide's script",
            "expert": "what an expert writes with the same Seq2SeqTrainer + peft LoRA: tokenizer(truncation=True) "
            "to the caps without padding, DataCollatorForSeq2Seq(model=model, label_pad_token_id=-100) padding "
            "each batch to its longest member, and train_sampling_strategy='group_by_length' (transformers 5's "
            "group_by_length=True: LengthGroupedSampler, mega-batches of 50 batches sorted by length); no "
            "DeepSpeed, 1 process",
            "lorakit_zero3": "lorakit.train, distributed.num_processes 1, zero_stage 3 (lorakit's default stage)",
            "lorakit_zero0": "lorakit.train, distributed.num_processes 1, zero_stage 0 (DeepSpeed engine, no ZeRO)",
        },
        "machine": _machine(),
        "versions": _versions(),
        "git_revision": revision,
        "useful_tokens": {
            "per_side": {s: v[0] if len(v) == 1 else v for s, v in tokens.items()},
            "equal_on_all_sides": equal,
        },
        "padding_efficiency": {s: medians[s]["padding_efficiency"] for s in SIDES},
        "token_slots": {s: first[s]["token_slots"] for s in SIDES},
        "medians": medians,
        "ratios": ratios,
        "runs": runs,
        "analysis": _analysis(medians, first),
        "notes": list(args.note or []),
    }
    end_digest = _source_digest()
    result["lorakit_source"] = {
        "git_revision_at_start": revision,
        "uncommitted_changes_at_start": dirty,
        "sha256_at_start": digest,
        "sha256_at_end": end_digest,
        "unchanged_during_run": digest == end_digest,
    }
    if digest != end_digest:
        log("warning: lorakit's source changed while the benchmark ran; see lorakit_source in the result")
    result["benchmark_wall_seconds"] = time.perf_counter() - t0
    output = Path(args.output).expanduser().resolve()
    write_json(output, result)
    log(f"useful tokens: {result['useful_tokens']['per_side']} (equal: {equal})")
    for r in ratios.values():
        log(
            f"{r['side']} vs {r['versus']}: x{r['useful_tokens_per_second']:.2f} useful tokens/s (median), "
            f"epoch time x{r['epoch_time_speedup']:.2f}, paired {[round(x, 2) for x in r['paired_useful_tokens_per_second']]}"
        )
    log(f"wrote {output} in {result['benchmark_wall_seconds']:.0f} s")
    if plot(result, output.with_suffix(".png")):
        log(f"wrote {output.with_suffix('.png')}")
    else:
        log("matplotlib is not installed: no chart (pip install matplotlib)")
    if not equal:
        print("error: the sides did not see the same number of useful tokens", file=sys.stderr)
        return 1
    return 0


def plot(result: dict, path: Path) -> bool:
    """Bar chart of the per-run and median useful tokens/s of each side; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = {
        "baseline": "Trainer\nmax_length",
        "baseline_zero3": "Trainer ZeRO-3\nmax_length",
        "expert": "Trainer dynamic\n+ group_by_length",
        "lorakit_zero3": "lorakit\nZeRO-3",
        "lorakit_zero0": "lorakit\nZeRO-0",
    }
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 4.8))
    for i, side in enumerate(SIDES):
        runs = [r["useful_tokens_per_second"] for r in result["runs"] if r["side"] == side]
        ax.bar(i, result["medians"][side]["useful_tokens_per_second"], color=f"C{i}", alpha=0.8)
        ax.scatter([i] * len(runs), runs, color="black", s=12, zorder=3)
        mine = [r for r in result["ratios"].values() if r["side"] == side]
        if mine:
            top = max(runs + [result["medians"][side]["useful_tokens_per_second"]])
            ax.annotate(
                "\n".join(
                    f"x{r['useful_tokens_per_second']:.2f} vs {labels[r['versus']].replace(chr(10), ' ')}"
                    for r in mine
                ),
                (i, top),
                xytext=(0, 4),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax2.bar(i, result["padding_efficiency"][side], color=f"C{i}", alpha=0.8)
    for a, title in ((ax, "useful tokens / s (bars: median, dots: runs)"), (ax2, "padding efficiency")):
        a.set_xticks(range(len(SIDES)), [labels[s] for s in SIDES], fontsize=8)
        a.set_title(title, fontsize=10)
    ax2.set_ylim(0, 1)
    ax.margins(y=0.2)
    setup, v = result["setup"], result["versions"]
    fig.suptitle(
        f"tiny T5, {setup['data']['rows']} rows, batch {setup['train']['micro_batch_size']}, "
        f"{setup['dtype']}, 1 process, {'/'.join(map(str, setup['torch_threads']))} torch thread(s), CPU ({result['machine']['cpu_count']} cores), "
        f"torch {v['torch']}, transformers {v['transformers']}, deepspeed {v['deepspeed']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        spec = json.loads(Path(argv[1]).read_text())
        if spec.get("torch_threads"):
            import torch

            torch.set_num_threads(spec["torch_threads"])
        fn = _worker_baseline if spec["side"] in HF_PADDING else _worker_lorakit
        Path(argv[2]).write_text(json.dumps(fn(spec)))
        return 0
    p = argparse.ArgumentParser(
        prog="python benchmarks/seq2seq_padding.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--output", default=str(DEFAULT_OUTPUT), help="result JSON (default: %(default)s)")
    p.add_argument("--max-samples", type=int, default=1000, help="first N training rows (default: all 1000)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds of every side (default: 2)")
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
        default=0,
        help="torch intra-op threads in every run (default 0: torch's default, one per core)",
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
        # lorakit's sampler fills a last short batch with repeats; the Trainer does not: counts would differ.
        p.error(
            f"--max-samples must be a multiple of the micro batch size {MICRO_BATCH}, got {args.max_samples}"
        )
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return orchestrate(args)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a script from a checkout: import this checkout's lorakit
    sys.exit(main())
