"""One training job, run by every process of the group: build, train, evaluate, save, summarise."""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from lorakit import rundir
from lorakit.data import (
    CausalCollator,
    LengthGroupedBatchSampler,
    MultipackBatchSampler,
    PackedCausalCollator,
    PackedSeq2SeqCollator,
    Seq2SeqCollator,
    prepare_data,
)
from lorakit.data.balanced import BalancedRandomBatchSampler
from lorakit.data.multipack_seq2seq import Seq2SeqMultipackBatchSampler, default_max_target_tokens
from lorakit.data.sampler import ResumableBatchSampler
from lorakit.data.token_budget import TokenBudgetBatchSampler, token_budget_for_rows
from lorakit.engine import checkpoint, dist
from lorakit.engine.checkpoint import LoopState
from lorakit.engine.deepspeed_config import build_ds_config
from lorakit.engine.loop import (
    Checkpointing,
    NonFinitePolicy,
    Preempted,
    Trainer,
    TrainingDiverged,
    plan_steps,
)
from lorakit.engine.save import save_trained
from lorakit.engine.schedule import lambda_lr_factory
from lorakit.engine.signals import StopRequests
from lorakit.errors import DataError
from lorakit.evaluation.generate import evaluate_model
from lorakit.meter import live_tensor_bytes, peak_memory
from lorakit.model import build_model, count_parameters, load_config, load_tokenizer
from lorakit.model.quantize import describe_quantization, quantization_summary
from lorakit.recipe import Recipe, dump_recipe

# Written by rank 0 when training stops early with its own exit code (preempted, diverged).
EXIT = "exit.json"


@dataclass(frozen=True)
class TrainResult:
    """What lorakit.train returns: the run directory and its summary."""

    run_dir: Path
    summary: dict[str, Any]


def accelerator_name() -> str:
    """DeepSpeed's accelerator for this machine: `cuda`, or `cpu` where there is no GPU."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def _prepare_everywhere(recipe: Recipe, tokenizer, config):
    # Rank 0 tokenizes (or finds the cache); the others wait and then read its cache entry. Where nodes do
    # not share data.cache_dir, the first process of each other node then tokenizes once for its node.
    data = prepare_data(recipe, tokenizer, config) if dist.is_main() else None
    dist.barrier()
    if data is None and os.environ.get("LOCAL_RANK", "0") == "0":
        data = prepare_data(recipe, tokenizer, config)
    dist.barrier()
    return data if data is not None else prepare_data(recipe, tokenizer, config)


def run_job(recipe: Recipe) -> TrainResult:
    """Train `recipe` in this process group (already initialised) and write the run directory on rank 0."""
    import deepspeed

    world, main = dist.world_size(), dist.is_main()
    run_dir = Path(recipe.output.dir).expanduser().resolve()
    # Before any work: a checkpoint from another recipe or world size is refused here, not after loading.
    resume_from = checkpoint.find_resume(recipe, run_dir)
    source, config = load_config(recipe)
    tokenizer = load_tokenizer(recipe, source)
    data = _prepare_everywhere(recipe, tokenizer, config)
    if main and not (dist.world_size() > 1 and data.cache_hit):
        # Under a multi-process launch from lorakit.train, the launcher already reported the data step.
        print(data.describe(), flush=True)
    hidden = getattr(config, "d_model", None) or getattr(config, "hidden_size", None)
    ds_config = build_ds_config(recipe, world, accelerator=accelerator_name(), hidden_size=hidden)
    zero3 = recipe.distributed.zero_stage == 3
    device_kind = "cpu" if accelerator_name() == "cpu" else "cuda"
    # Tensors alive before the model exists, so model states are measured as what the run added.
    tensors_before = live_tensor_bytes(device_kind)
    built = build_model(recipe, ds_config)
    trainable, total = count_parameters(built.model)

    log = _Logger(run_dir if main else None)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in (rundir.ADAPTER, rundir.MODEL, rundir.MERGED):
            shutil.rmtree(run_dir / stale, ignore_errors=True)
        (run_dir / EXIT).unlink(missing_ok=True)
        rundir.write_text(run_dir / rundir.RECIPE, dump_recipe(recipe))
        rundir.write_json(run_dir / rundir.DS_CONFIG, ds_config)
        log.open(keep=resume_from.state["loop"]["metrics_records"] if resume_from else None)

    t = recipe.train
    batching = make_batching(recipe, data, tokenizer, config, built, world, dist.rank())
    sampler = ResumableBatchSampler(batching.sampler)
    # Its own generator: a DataLoader draws a seed from the global torch RNG for every epoch's iterator,
    # which would shift dropout's random stream by one draw in a run resumed mid-epoch.
    loader = DataLoader(
        data.train,
        batch_sampler=sampler,
        collate_fn=batching.collator,
        generator=torch.Generator().manual_seed(t.seed),
    )
    plan = plan_steps(len(sampler), t.gradient_accumulation_steps, t.epochs, t.max_steps)
    if main:
        print(batching.describe(plan, world), flush=True)
    engine, *_ = deepspeed.initialize(
        model=built.model,
        model_parameters=[p for p in built.model.parameters() if p.requires_grad],
        config=ds_config,
        lr_scheduler=lambda_lr_factory(plan.total_steps, t.warmup_ratio, t.lr_schedule),
    )
    # After deepspeed.initialize, so under ZeRO-3 it counts the partitioned base through ds_numel.
    quantization = quantization_summary(engine.module, recipe) if recipe.method.quantization() else None
    if main and quantization:
        print(describe_quantization(quantization), flush=True)
    state, counters = LoopState(), None
    if resume_from is not None:
        state, counters = checkpoint.load_checkpoint(engine, resume_from, adapter=recipe.method.adapter())
        if main:
            print(
                f"resuming from {resume_from.path} (step {state.step} of {plan.total_steps}, epoch "
                f"{state.epoch + 1}, {state.micro_batches_done} micro-batches into it)",
                flush=True,
            )

    def evaluate(epoch: int, step: int) -> dict[str, Any]:
        from lorakit.evaluation import compute_metrics

        ev = recipe.eval
        max_new = auto_max_new_tokens(data) if ev.max_new_tokens == "auto" else ev.max_new_tokens
        out = evaluate_model(
            engine,
            built.inputs,
            data.eval,
            batching.eval_collator,
            tokenizer,
            batch_size=ev.micro_batch_size or t.micro_batch_size,
            generate=ev.generate,
            max_new_tokens=max_new,
            num_beams=ev.num_beams,
            zero3=zero3,
        )
        metrics = {"loss": out["loss"]}
        if ev.generate and main:
            metrics.update(
                compute_metrics(list(ev.metrics), out["predictions"], list(data.eval["reference"]))
            )
            log.predictions(out["predictions"], data.eval["reference"])
        log({"kind": "eval", "step": step, "epoch": epoch, **metrics})
        return metrics

    def save(reason: str) -> Path:
        state.metrics_records = log.count
        meter = trainer.meter
        return checkpoint.save_checkpoint(
            engine,
            recipe,
            run_dir,
            state,
            {"samples": meter.samples, "real": meter.real, "slots": meter.slots},
            adapter=recipe.method.adapter(),
            reason=reason,
        )

    progress = None
    if main:
        from tqdm.auto import tqdm

        progress = tqdm(
            total=plan.total_steps, initial=state.step, desc="training", unit="step", dynamic_ncols=True
        )
    ck = recipe.checkpoint
    stops = StopRequests()
    trainer = Trainer(
        engine,
        built.inputs,
        loader,
        sampler,
        plan,
        t.gradient_accumulation_steps,
        log,
        evaluate if recipe.eval_active() and data.eval is not None else None,
        progress,
        log_every=t.log_every,
        state=state,
        checkpointing=Checkpointing(save, ck.every, ck.at_epoch_end),
        nonfinite=NonFinitePolicy(t.on_nonfinite, t.max_skipped_steps),
        stop_requested=stops.requested,
    )
    if counters is not None:
        trainer.meter.samples, trainer.meter.real, trainer.meter.slots = (
            counters["samples"],
            counters["real"],
            counters["slots"],
        )
    try:
        with stops:
            trainer.run()
    except (Preempted, TrainingDiverged) as e:
        if main:
            # The launching process (lorakit.train over torchrun) reads this to exit with the same code.
            rundir.write_json(
                run_dir / EXIT, {"code": e.exit_code, "error": type(e).__name__, "message": str(e)}
            )
        log.close()
        release(engine, built)
        raise
    finally:
        if progress is not None:
            progress.close()

    # Between steps: what stays resident (weights, gradients, optimizer state), the planner's model states.
    (model_states,) = dist.all_reduce([live_tensor_bytes(device_kind) - tensors_before], op="max")
    saved = save_trained(engine, built, recipe, run_dir) if recipe.output.save_adapter else {}
    memory = peak_memory()
    gpu_peak, rss_peak = dist.all_reduce([memory["gpu"] or 0, memory["cpu_rss"]], op="max")
    summary = {
        "method": recipe.method.kind,
        "model": recipe.model.name_or_path,
        "model_source": built.source,
        "attention": built.attention,
        "dtype": recipe.model.dtype,
        "world_size": world,
        "zero_stage": recipe.distributed.zero_stage,
        "trainable_params": trainable,
        "total_params": total,
        "quantization": quantization,
        "steps": trainer.step,
        "epochs": plan.epochs,
        "train_samples": int(dist.all_reduce([trainer.meter.samples])[0]),
        "train_tokens": trainer.global_real_tokens,
        "padded_tokens": trainer.global_token_slots,
        "packing_efficiency": trainer.global_real_tokens / max(trainer.global_token_slots, 1),
        "batching": batching.summary(plan),
        "tokens_per_second": trainer.tokens_per_second(),
        "train_seconds": trainer.train_seconds,
        "peak_memory_bytes": {
            "gpu": int(gpu_peak) if memory["gpu"] is not None else None,
            "cpu_rss": int(rss_peak),
            "model_states": int(model_states),
        },
        # The memory planner's answer for this recipe and launch, next to what was measured above.
        "plan": _plan_of_run(recipe, config, data, world, device_kind),
        "loss": {
            "first": trainer.losses[0] if trainer.losses else None,
            "last": trainer.losses[-1] if trainer.losses else None,
        },
        "skipped_steps": list(state.skipped_steps),
        "resumed_from": {"checkpoint": str(resume_from.path), "step": resume_from.step}
        if resume_from
        else None,
        "last_checkpoint": str(trainer.last_checkpoint) if trainer.last_checkpoint else None,
        "eval": dict(state.eval) or None,
        "adapter_dir": saved.get("adapter_dir"),
        "model_dir": saved.get("model_dir"),
        # Set by lorakit.train once output.merge has merged (api.merge_after_training).
        "merged_dir": None,
        "data": {
            "cache_dir": str(data.path),
            "max_source_length": data.lengths.max_source_length,
            "max_target_length": data.lengths.max_target_length,
            "max_length": data.lengths.max_length,
            **data.stats,
        },
        "versions": rundir.versions(),
        "git_revision": rundir.git_revision(),
    }
    if main:
        rundir.write_json(run_dir / rundir.SUMMARY, summary)
        log.close()
    dist.barrier()
    release(engine, built)
    return TrainResult(run_dir, summary)


@dataclass
class Batching:
    """How training rows become micro-batches: sampler, collators, and what to report about them."""

    sampler: Any
    collator: Any
    eval_collator: Any
    packing: bool
    max_tokens: int | None = None
    # Tokens / capacity of the packed micro-batches (the sampler's own measure; encoder rows for seq2seq).
    efficiency: float | None = None
    # Encoder-decoder packing: the decoder row's capacity and how full it is.
    max_target_tokens: int | None = None
    target_efficiency: float | None = None
    # Padded micro-batches sized by token budgets (rows x longest <= max_tokens / max_target_tokens): the
    # encoder-decoders that cannot pack.
    token_budget: bool = False
    # Encoder-decoder packing without budgets: packed rows of exactly this many random examples.
    row_examples: int | None = None

    def summary(self, plan) -> dict[str, Any]:
        """The batching facts recorded in summary.json."""
        out: dict[str, Any] = {
            "packing": self.packing,
            "micro_batches_per_epoch_per_rank": plan.micro_batches_per_epoch,
            "steps_per_epoch": plan.steps_per_epoch,
            "examples_dropped_per_epoch": self.sampler.dropped,
        }
        if self.packing or self.token_budget:
            out["max_tokens"] = self.max_tokens
            out["sampler_efficiency_epoch0"] = self.efficiency
        if self.token_budget:
            out["token_budget"] = True
        if self.row_examples is not None:
            out["row_examples"] = self.row_examples
        if self.target_efficiency is not None:
            out["max_target_tokens"] = self.max_target_tokens
            out["source_efficiency"] = self.efficiency
            out["target_efficiency"] = self.target_efficiency
        return out

    def describe(self, plan, world: int) -> str:
        """One line for the terminal at start: micro-batches, steps, packing."""
        line = (
            f"batching: {plan.micro_batches_per_epoch} micro-batches per epoch on each of {world} rank(s) -> "
            f"{plan.steps_per_epoch} steps per epoch, {plan.total_steps} steps in all"
        )
        if self.token_budget:
            line += (
                f"; padded micro-batches of similar lengths, <= {self.max_tokens} source tokens "
                f"({self.efficiency:.1%} real) and <= {self.max_target_tokens} target tokens "
                f"({self.target_efficiency:.1%} real) as rows x longest"
            )
        elif self.row_examples is not None:
            line += (
                f"; packed encoder and decoder rows of {self.row_examples} random examples each, unpadded "
                f"(ranks' rows {self.efficiency:.1%} / {self.target_efficiency:.1%} as long as the longest "
                "of their micro-step)"
            )
        elif self.max_target_tokens is not None:
            line += (
                f"; packed encoder rows of <= {self.max_tokens} tokens ({self.efficiency:.1%} full) and decoder "
                f"rows of <= {self.max_target_tokens} ({self.target_efficiency:.1%} full)"
            )
        elif self.packing:
            line += f"; packed rows of <= {self.max_tokens} tokens, {self.efficiency:.1%} full"
        if self.sampler.dropped:
            line += f"; {self.sampler.dropped} examples per epoch dropped by drop_last"
        return line


def packing_max_tokens(recipe: Recipe, max_length: int) -> int:
    """The token budget of one packed causal row: train.max_tokens, else what a full padded micro-batch
    holds."""
    return recipe.train.max_tokens or recipe.train.micro_batch_size * max_length


# The share of a packed encoder row the two-capacity packer fills (0.94-0.97 measured, docs/packing.md).
_SEQ2SEQ_ROW_FILL = 0.95


def seq2seq_packing_max_tokens(recipe: Recipe, sources: list[int], max_source_length: int) -> int:
    """The encoder row budget of budget-filled rows: train.max_tokens, else (only train.max_target_tokens
    set) one that holds train.micro_batch_size examples on average (micro_batch_size x mean source length /
    the packer's fill), so packing changes neither the examples per optimizer step nor the number of steps
    of an unpacked recipe; never below the longest source, never above what a padded micro-batch holds
    (micro_batch_size x max_source_length)."""
    if recipe.train.max_tokens:
        return recipe.train.max_tokens
    per_row = recipe.train.micro_batch_size * sum(sources) / max(len(sources), 1) / _SEQ2SEQ_ROW_FILL
    padded = recipe.train.micro_batch_size * max_source_length
    return max(max(sources, default=1), min(padded, 8 * math.ceil(per_row / 8)))


def _pair_lengths(data) -> tuple[list[int], list[int]]:
    """Source and target token counts of the training rows."""
    return [len(x) for x in data.train["input_ids"]], [len(x) for x in data.train["labels"]]


def _target_budget(recipe: Recipe, src: list[int], tgt: list[int], max_src: int, what: str) -> int:
    """The target budget that goes with `max_src` (train.max_target_tokens, else the data's target/source
    ratio); refuses budgets that an example exceeds."""
    max_tgt = recipe.train.max_target_tokens or default_max_target_tokens(src, tgt, max_src)
    for name, lengths, cap, setting in (
        ("source", src, max_src, "train.max_tokens"),
        ("target", tgt, max_tgt, "train.max_target_tokens"),
    ):
        if max(lengths) > cap:
            raise DataError(
                f"{setting}={cap} is smaller than the longest {name} ({max(lengths)} tokens): {what} must hold "
                f"any one example; raise {setting} or lower data.max_{name}_length"
            )
    return max_tgt


def _seq2seq_packing(recipe: Recipe, data, config, eval_collator, world: int, rank: int) -> Batching:
    """Packed encoder and decoder rows: by default rows of micro_batch_size random examples (the optimizer
    steps of random padded batches, without the padding); with train.max_tokens or max_target_tokens, rows
    filled to those budgets by the two-capacity multipack sampler."""
    t = recipe.train
    src, tgt = _pair_lengths(data)
    if t.max_tokens is None and t.max_target_tokens is None:
        sampler = BalancedRandomBatchSampler(
            src,
            t.micro_batch_size,
            target_lengths=tgt,
            accumulation=t.gradient_accumulation_steps,
            num_replicas=world,
            rank=rank,
            seed=t.seed,
        )
        return Batching(
            sampler,
            PackedSeq2SeqCollator(None, None, config.decoder_start_token_id),
            eval_collator,
            True,
            efficiency=sampler.efficiency(),
            target_efficiency=sampler.target_efficiency(),
            row_examples=t.micro_batch_size,
        )
    max_src = seq2seq_packing_max_tokens(recipe, src, data.lengths.max_source_length)
    max_tgt = _target_budget(recipe, src, tgt, max_src, "a packed row")
    sampler = Seq2SeqMultipackBatchSampler(
        src, tgt, max_src, max_tgt, num_replicas=world, rank=rank, seed=recipe.train.seed
    )
    collator = PackedSeq2SeqCollator(max_src, max_tgt, config.decoder_start_token_id)
    return Batching(
        sampler,
        collator,
        eval_collator,
        True,
        max_src,
        sampler.efficiency(),
        max_tgt,
        sampler.target_efficiency(),
    )


def _seq2seq_token_budget(recipe: Recipe, data, eval_collator, world: int, rank: int) -> Batching:
    """Encoder-decoders that cannot pack: padded micro-batches of similar lengths, as many rows as the
    budgets allow (rows x longest source <= max_tokens, rows x longest target <= max_target_tokens); by
    default micro_batch_size examples on average, so the optimizer steps are those of fixed batches."""
    t = recipe.train
    src, tgt = _pair_lengths(data)
    max_src = t.max_tokens or token_budget_for_rows(
        t.micro_batch_size, src, tgt, max_length=data.lengths.max_source_length
    )
    max_tgt = _target_budget(recipe, src, tgt, max_src, "a micro-batch")
    sampler = TokenBudgetBatchSampler(
        src,
        max_src,
        target_lengths=tgt,
        max_target_tokens=max_tgt,
        num_replicas=world,
        rank=rank,
        seed=t.seed,
    )
    return Batching(
        sampler,
        eval_collator,
        eval_collator,
        False,
        max_src,
        sampler.efficiency(),
        max_tgt,
        sampler.target_efficiency(),
        token_budget=True,
    )


def make_batching(recipe: Recipe, data, tokenizer, config, built, world: int, rank: int) -> Batching:
    """Sampler and collators for the model family and whether the built model packs."""
    t = recipe.train
    if getattr(config, "is_encoder_decoder", False):
        eval_collator = Seq2SeqCollator(tokenizer.pad_token_id, config.decoder_start_token_id)
        if built.packing:
            return _seq2seq_packing(recipe, data, config, eval_collator, world, rank)
        if recipe.data.packing == "auto" and recipe.data.group_by_length:
            # Packing is not exact for this model or backend: the fallback auto promises. An explicit
            # data.packing: false keeps fixed micro-batches of micro_batch_size.
            return _seq2seq_token_budget(recipe, data, eval_collator, world, rank)
    else:
        eval_collator = CausalCollator(tokenizer.pad_token_id)
        if built.packing:
            max_tokens = packing_max_tokens(recipe, data.lengths.max_length)
            sampler = MultipackBatchSampler(
                data.train["length"], max_tokens, num_replicas=world, rank=rank, seed=t.seed
            )
            return Batching(
                sampler,
                PackedCausalCollator(max_tokens),
                eval_collator,
                True,
                max_tokens,
                sampler.efficiency(),
            )
    sampler = LengthGroupedBatchSampler(
        data.train["length"],
        t.micro_batch_size,
        num_replicas=world,
        rank=rank,
        seed=t.seed,
        group_by_length=recipe.data.group_by_length,
    )
    return Batching(sampler, eval_collator, eval_collator, False)


def _plan_of_run(recipe: Recipe, config, data, world: int, device_kind: str) -> dict[str, Any]:
    """lorakit.plan for this run (its launch shape, data lengths and device), recorded in summary.json so
    every run checks the planner; a model the planner does not know gives {"error": ...}, never a crash."""
    from lorakit.planner import plan

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gpu_memory = torch.cuda.get_device_properties(0).total_memory if device_kind == "cuda" else None
    try:
        return plan(
            recipe,
            gpus=local,
            nodes=max(world // local, 1),
            config=config,
            device=device_kind,
            gpu_memory=gpu_memory,
            seq_len=data.lengths.max_source_length or data.lengths.max_length,
            target_len=data.lengths.max_target_length,
        ).to_dict()
    except Exception as e:  # noqa: BLE001 - the plan is a report; training already succeeded
        return {"error": f"{type(e).__name__}: {e}"}


def auto_max_new_tokens(data) -> int:
    """Generation cap when eval.max_new_tokens is auto: the target cap (seq2seq), else the longest eval
    response (causal: tokens after the prompt)."""
    if data.lengths.max_target_length is not None:
        return data.lengths.max_target_length
    return max(
        (
            length - len(prompt)
            for length, prompt in zip(data.eval["length"], data.eval["prompt_ids"], strict=True)
        ),
        default=1,
    )


def release(engine, built) -> None:
    """Undo the process-wide state a job leaves: ZeRO hooks, and transformers' "ZeRO-3 is on" flag, which
    would otherwise make every later from_pretrained in this process load partitioned."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    engine.destroy()
    built.hf_ds_config = None
    unset_hf_deepspeed_config()


class _Logger:
    """metrics.jsonl and eval predictions, written by rank 0 only."""

    def __init__(self, run_dir: Path | None):
        self.run_dir = run_dir
        self._metrics: rundir.MetricsLog | None = None

    @property
    def count(self) -> int:
        """Lines written to metrics.jsonl so far (0 on the ranks that write none)."""
        return self._metrics.count if self._metrics is not None else 0

    def open(self, keep: int | None = None) -> None:
        self._metrics = rundir.MetricsLog(self.run_dir / rundir.METRICS, keep=keep)

    def __call__(self, record: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.write(record)

    def predictions(self, predictions: list[str], references: list[str]) -> None:
        if self.run_dir is None:
            return
        import json

        lines = (
            json.dumps({"prediction": p, "reference": r})
            for p, r in zip(predictions, references, strict=True)
        )
        rundir.write_text(self.run_dir / "eval_predictions.jsonl", "\n".join(lines) + "\n")

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
