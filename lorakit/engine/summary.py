"""summary.json: what a finished run was and what it measured.

`RunSummary` names every key, in the order summary.json writes them. lorakit.compare (report/runs.py),
lorakit.api (merged_dir) and the benchmarks read these keys: add new ones, never rename or drop one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from lorakit import dist, rundir
from lorakit.backends import Engine, backend_for
from lorakit.meter import flops_summary, live_tensor_bytes, matmul_params, peak_memory
from lorakit.model import bias_attention
from lorakit.model.compile import compile_summary
from lorakit.model.families.start import decoder_start_summary
from lorakit.objectives import objective_type
from lorakit.observe import trackers

if TYPE_CHECKING:
    from lorakit.engine.loop import Trainer
    from lorakit.engine.session import Job


@dataclass(frozen=True)
class PeakMemory:
    """Peak memory over ranks, in bytes: accelerator (None without one), resident CPU, and the model states
    (weights, gradients, optimizer state) alive between steps, the quantity lorakit.plan predicts."""

    gpu: int | None
    cpu_rss: int
    model_states: int


@dataclass(frozen=True)
class LossEnds:
    """The first and last finite training loss (None before any step)."""

    first: float | None
    last: float | None

    @classmethod
    def of(cls, losses: list[float]) -> LossEnds:
        """The ends of `losses`."""
        return cls(losses[0], losses[-1]) if losses else cls(None, None)


@dataclass(frozen=True)
class ResumedFrom:
    """The checkpoint a resumed run continued."""

    checkpoint: str
    step: int


@dataclass(frozen=True)
class RunSummary:
    """Every key of summary.json (docs/architecture.md#run-directory-and-summary describes them)."""

    method: str
    # method.kind's options as comparisons label them (dora, rslora, pissa, lora+ x16, ...); [] for none.
    method_options: list[str]
    # train.objective, as registered (sft, dpo, orpo, kto, a plugin's): lorakit.compare and the Hub card
    # read it here rather than guess it from the metrics (ORPO reports DPO's).
    objective: str
    model: str
    model_source: str
    attention: str
    # Packed rows: {attention kind: {kernel: calls}} (causal, encoder, decoder, cross -> varlen, flex, loop;
    # lorakit.model.fused_attention), training and evaluation on rank 0; {} without packed rows.
    attention_kernels: dict[str, dict[str, int]]
    # T5's position bias: the SDPA backend calls per (device, dtype, head_dim), as the probe of
    # lorakit.model.bias_attention chose it (cudnn, efficient, flash; default: SDPA's own dispatch where none
    # took the bias; math: forced by LORAKIT_BIAS_SDPA).
    attention_bias: list[dict[str, Any]]
    # Encoder-decoders: the token the decoder started on in training, evaluation and generation, and the
    # checkpoint config attribute it was read from ({token_id, token, field}; families/start.py); else None.
    decoder_start: dict[str, Any] | None
    dtype: str
    # How the linear layers multiply: `fp32` (bf16 on a CPU without a fast bf16 kernel, products formed in
    # fp32: lorakit.model.cpu_products), else `native` (torch's kernels for the dtype).
    matmul: str
    world_size: int
    # distributed.strategy: deepspeed (ZeRO, zero_stage says which), or fsdp (FSDP2; zero_stage is the
    # recipe's value and does not apply: the sharding is in fsdp_config.json).
    strategy: str
    zero_stage: int
    # How the run was sharded, as its backend describes it (Backend.describe_run): strategy, a label for
    # people (ZeRO-3, FSDP2 full sharding) and its settings. Absent from summaries written before it.
    backend: dict[str, Any]
    trainable_params: int
    total_params: int
    # QLoRA: type, bits, dtypes, quantized layers and base bytes (model/quantize.py); else None.
    quantization: dict[str, Any] | None
    # The optimizer's parameter groups read back from the engine: {peak_lr, last_lr} each (LoRA+: the
    # lora_B group at train.lr x method.lr_ratio_b).
    optimizer_groups: list[dict[str, float]]
    steps: int
    epochs: int
    train_samples: int
    # Non-pad tokens trained on, and the token slots spent on them (padding, or packed rows' capacity).
    train_tokens: int
    padded_tokens: int
    packing_efficiency: float
    batching: dict[str, Any]
    tokens_per_second: float
    # Linear-layer training FLOPs per token as lorakit and NeMo AutoModel count LoRA, and the MFU of each
    # against the device's bf16 datasheet peak (lorakit.meter.flops_summary; None where no peak is known).
    flops: dict[str, Any]
    # model.compile: the blocks compiled regionally and what dynamo did in training (graphs, graph_breaks,
    # compile_seconds; lorakit.model.compile); None when the blocks ran eager.
    compile: dict[str, Any] | None
    # model.gradient_checkpointing as run: {mode (off, selective, whole), every (selective: every k-th
    # block), why} (lorakit.model.checkpointing; auto: the planner's choice).
    gradient_checkpointing: dict[str, Any] | None
    train_seconds: float
    peak_memory_bytes: PeakMemory
    # The memory planner's answer for this recipe and launch, next to what was measured.
    plan: dict[str, Any]
    loss: LossEnds
    skipped_steps: list[int]
    resumed_from: ResumedFrom | None
    last_checkpoint: str | None
    # Why training ended: epochs / max_steps (as planned), or early_stopping (train.early_stopping_patience).
    stop_reason: str
    eval: dict[str, Any] | None
    # checkpoint.best_metric: {metric, mode, value, step, epoch, evals_since, dir} of the best evaluation,
    # whose weights are in dir (run_dir/best); else None.
    best: dict[str, Any] | None
    # Classification runs: the last evaluation's per-class counts and confusion matrix.
    classification: dict[str, Any] | None
    adapter_dir: str | None
    model_dir: str | None
    # Set by lorakit.train once output.merge has merged (api.merge_after_training).
    merged_dir: str | None
    # output.report_to: where each tracking backend's records went (log_dir, run id, tracking URI).
    trackers: dict[str, Any]
    # What the objective measured over the run beyond the loss, by its own names (grpo: the rollouts' rewards
    # first and last, zero-variance groups, the engine that generated); None for the others.
    objective_metrics: dict[str, Any] | None
    # The data cache, its caps and what preparing the data counted (overlong, bad rows, format).
    data: dict[str, Any]
    versions: dict[str, str | None]
    git_revision: str | None

    def to_json(self) -> dict[str, Any]:
        """summary.json's object (nested parts as plain dicts, keys in field order)."""
        return asdict(self)


class MemoryProbe:
    """Counts live tensor bytes before the model is built, so the model states are measured as what the
    run added to them."""

    def __init__(self, device_kind: str):
        self.device_kind = device_kind
        self.before = live_tensor_bytes(device_kind)

    def model_states(self) -> int:
        """Tensor bytes the run keeps alive between steps (the most on any rank); collective."""
        (states,) = dist.all_reduce([live_tensor_bytes(self.device_kind) - self.before], op="max")
        return int(states)

    @staticmethod
    def peak(model_states: int) -> PeakMemory:
        """The peaks of this process, the most on any rank; collective."""
        memory = peak_memory()
        gpu, rss = dist.all_reduce([memory["gpu"] or 0, memory["cpu_rss"]], op="max")
        return PeakMemory(int(gpu) if memory["gpu"] is not None else None, int(rss), model_states)


def data_summary(data) -> dict[str, Any]:
    """The data block of summary.json for PreparedData `data`."""
    return {
        "cache_dir": str(data.path),
        "max_source_length": data.lengths.max_source_length,
        "max_target_length": data.lengths.max_target_length,
        "max_length": data.lengths.max_length,
        **data.stats,
    }


def stop_reason(recipe, state) -> str:
    """Why the loop ended: the state's reason (early_stopping), else the plan's end (max_steps, epochs)."""
    if state.stop_reason is not None:
        return state.stop_reason
    return "max_steps" if recipe.train.max_steps is not None else "epochs"


def best_summary(run_dir, state) -> dict[str, Any] | None:
    """summary.json's `best`: the best evaluation, the evaluations since it and its weights' directory."""
    if state.best is None:
        return None
    return {**state.best, "evals_since": state.evals_since_best, "dir": str(run_dir / rundir.BEST)}


def optimizer_groups(engine: Engine) -> list[dict[str, float]]:
    """Each optimizer parameter group's peak learning rate (LambdaLR's initial_lr) and its last one."""
    return [
        {"peak_lr": float(g.get("initial_lr", g["lr"])), "last_lr": float(g["lr"])}
        for g in engine.param_groups
    ]


def objective_metrics(job: Job) -> dict[str, Any] | None:
    """The objective's own summary of the run from metrics.jsonl (rank 0, which writes summary.json)."""
    file = job.run_dir / rundir.METRICS
    records = rundir.read_metrics(job.run_dir) if dist.is_main() and file.is_file() else []
    return objective_type(job.recipe).run_summary(job.recipe, records)


def summarize(
    job: Job, trainer: Trainer, memory: PeakMemory, saved: dict[str, str], plan: dict[str, Any]
) -> RunSummary:
    """The summary of `job` trained by `trainer`, with its peak `memory`, what save_trained wrote and the
    memory planner's `plan` of the run (collective: sums over ranks)."""
    recipe, world, ckpt, st = job.recipe, dist.world_size(), job.resumed_from, job.state
    return RunSummary(
        method=recipe.method.kind,
        # A DPO run reads `lora (dpo beta=0.1)` beside its SFT twin in lorakit.compare.
        method_options=recipe.method.options() + objective_type(recipe).method_options(recipe),
        objective=recipe.train.objective,
        model=recipe.model.name_or_path,
        model_source=job.built.source,
        attention=job.built.attention,
        attention_kernels=job.built.inputs.kernels.counts(),
        attention_bias=bias_attention.chosen(),
        decoder_start=decoder_start_summary(job.config, job.tokenizer),
        dtype=recipe.model.dtype,
        matmul="fp32" if job.built.fp32_products else "native",
        world_size=world,
        strategy=recipe.distributed.strategy,
        zero_stage=recipe.distributed.zero_stage,
        backend=backend_for(recipe).describe_run(),
        trainable_params=job.params[0],
        total_params=job.params[1],
        quantization=job.quantization,
        optimizer_groups=optimizer_groups(job.engine),
        steps=st.step,
        epochs=job.plan.epochs,
        train_samples=int(dist.all_reduce([job.meter.samples])[0]),
        train_tokens=st.global_real_tokens,
        padded_tokens=st.global_token_slots,
        packing_efficiency=st.global_real_tokens / max(st.global_token_slots, 1),
        batching=job.batching.summary(job.plan),
        tokens_per_second=st.tokens_per_second(),
        flops=flops_summary(
            matmul_params(job.built.model),
            full=recipe.method.kind == "full",
            seq2seq=job.built.is_encoder_decoder,
            tokens_per_second=st.tokens_per_second(),
            world_size=world,
        ),
        compile=compile_summary(job.built.compiled),
        gradient_checkpointing=job.built.checkpointing.to_dict() if job.built.checkpointing else None,
        train_seconds=st.train_seconds,
        peak_memory_bytes=memory,
        plan=plan,
        loss=LossEnds.of(st.losses),
        skipped_steps=list(st.skipped_steps),
        resumed_from=ResumedFrom(str(ckpt.path), ckpt.step) if ckpt else None,
        last_checkpoint=str(trainer.last_checkpoint) if trainer.last_checkpoint else None,
        stop_reason=stop_reason(recipe, st),
        eval=dict(st.eval) or None,
        best=best_summary(job.run_dir, st),
        classification=rundir.read_json_if_exists(job.run_dir / rundir.CLASSIFICATION),
        adapter_dir=saved.get("adapter_dir"),
        model_dir=saved.get("model_dir"),
        merged_dir=None,
        trackers=trackers.where(job.run_dir),
        objective_metrics=objective_metrics(job),
        data=data_summary(job.data),
        versions=rundir.versions(),
        git_revision=rundir.git_revision(),
    )
