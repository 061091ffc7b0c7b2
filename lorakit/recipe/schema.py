"""THE recipe schema: the Recipe, its sections and their cross-section checks. Every key, type, default and
check lives in this package: the method section in method.py, the data section in data_section.py, the rest
here; docs/recipes.md is generated from them (reference.py).

A recipe is frozen after validation; values derived from it are functions, not stored fields.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lorakit.recipe.data_section import DataSection, SourceSpec, data_parts
from lorakit.recipe.dpo_section import DPO_METRICS, DpoSection, check_objective
from lorakit.recipe.fsdp_section import FsdpSection, check_fsdp
from lorakit.recipe.method import MethodSection
from lorakit.recipe.section import Section, placeholders

__all__ = [
    "CheckpointSection",
    "DataSection",
    "DistributedSection",
    "DpoSection",
    "EvalSection",
    "FsdpSection",
    "MethodSection",
    "ModelSection",
    "OutputSection",
    "PushToHubSection",
    "PreflightSection",
    "Recipe",
    "SourceSpec",
    "TrainSection",
    "data_parts",
    "placeholders",
]


class ModelSection(Section):
    """The pretrained base model and how it is loaded."""

    name_or_path: str = Field(
        description="Hub model id, local directory, or `tiny:t5` (a tiny random T5 built locally by "
        "lorakit.testing, for smoke tests and the quickstart)."
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of the model.")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Weights and compute dtype; bf16 is the default on every modern GPU."
    )
    attention: Literal["auto", "flash_attention_2", "sdpa", "eager"] = Field(
        "auto",
        description="Attention backend. auto: flash_attention_2 when flash-attn is importable, a GPU is "
        "present and the model supports it; else sdpa; else eager.",
    )
    attention_dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on attention probabilities in training. 0 (the default) lets packed rows on a "
        "CUDA GPU run the fused kernels (varlen_attn, compiled FlexAttention), which cannot apply it. It "
        "replaces T5's `dropout_rate` for attention weights only: FLAN-T5 (dropout_rate 0.1) still drops "
        "hidden states (embeddings, attention and feed-forward outputs) at 0.1. Above 0, packed T5 rows take "
        "per-example SDPA in training, as the console says. Causal LMs: replaces the config's "
        "`attention_dropout` (0 for Llama, Mistral, Qwen2).",
    )
    gradient_checkpointing: bool = Field(
        True, description="Non-reentrant activation checkpointing: trades ~30% compute for much less memory."
    )
    # issue 33: long rows (lorakit.model.tiled_mlp).
    tiled_mlp: bool | Literal["auto"] = Field(
        "auto",
        description="Compute each decoder layer's MLP over tiles of the sequence (ALST's tiled MLP): only one "
        "tile's intermediate activations (tile x intermediate_size, 14336 wide for Llama-3-8B) are alive at "
        "a time, for one more MLP forward per step. auto: on with distributed.sequence_parallel > 1 or "
        "train.max_tokens of 32768 or more; a forward of at most one tile runs the MLP as is. Causal LMs "
        "with dense MLPs (Llama, Mistral, Qwen2 and the like); tested with LoRA, QLoRA, full fine-tuning, "
        "gradient checkpointing, ZeRO-2 and ZeRO-3. See docs/long-context.md.",
    )
    mlp_tile_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens per MLP tile when model.tiled_mlp tiles. null: the model's hidden_size (a "
        "tile's intermediate is then about one MLP weight matrix).",
    )
    tiled_loss: bool | Literal["auto"] = Field(
        "auto",
        description="Compute the output head and the cross-entropy over tiles of the sequence (ALST's tiled "
        "loss): the last hidden states go to the loss, and no logits of the whole row exist (at most one "
        "tile x vocabulary, in fp32), for one more head forward per step. auto: on with "
        "distributed.sequence_parallel > 1 or train.max_tokens of 32768 or more, for SFT on causal LMs "
        "whose logits are the head's output (Llama, Mistral, Mixtral, Qwen2/3, Phi-3, Gemma, OLMo 2). "
        "Not with train.objective dpo. See docs/long-context.md.",
    )
    loss_tile_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens per loss tile when model.tiled_loss tiles. null: about 2**25 logits per tile "
        "(261 tokens of a 128k vocabulary, 1024 of a 32k one).",
    )
    trust_remote_code: bool = Field(
        False,
        description="Run the Python code a model repository ships (config.json `auto_map`) when loading its "
        "config, tokenizer and weights. Off: such a model is refused with a message naming this key. Turn it "
        "on only for a repository you trust: its code runs with your permissions.",
    )
    allow_pickle: bool = Field(
        False,
        description="Allow loading base weights from pickle files (pytorch_model.bin, *.pt), which can run "
        "code when read. Off: weights load only from safetensors, and a model that has none is refused with "
        "a message naming this key. What lorakit writes (adapter, full model, merged model) is safetensors.",
    )

    @model_validator(mode="after")
    def _check_tiles(self) -> ModelSection:
        if self.mlp_tile_tokens is not None and self.tiled_mlp is False:
            raise ValueError(
                "model.mlp_tile_tokens sizes the tiles of model.tiled_mlp, which is false: remove "
                "mlp_tile_tokens or set tiled_mlp: true (or auto)"
            )
        if self.loss_tile_tokens is not None and self.tiled_loss is False:
            raise ValueError(
                "model.loss_tile_tokens sizes the tiles of model.tiled_loss, which is false: remove "
                "loss_tile_tokens or set tiled_loss: true (or auto)"
            )
        return self


class TrainSection(Section):
    """Optimisation hyper-parameters."""

    epochs: int = Field(1, ge=1, description="Passes over the training data (ignored when max_steps is set).")
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps to take; overrides epochs.")
    lr: float = Field(2e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Fraction of steps spent warming up linearly.")
    lr_schedule: Literal["linear", "cosine", "constant"] = Field("linear", description="Decay after warmup.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm; 0 disables clipping.")
    micro_batch_size: int = Field(
        8,
        ge=1,
        description="Examples per process per forward pass (without packing; packed encoder-decoders "
        "without train.max_tokens: the examples packed into one row).",
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="With packing: the token budget of one packed micro-batch (one row per process per "
        "forward pass; the encoder row for encoder-decoders). Default for causal LMs: micro_batch_size x "
        "data.max_length, what a full padded micro-batch would hold. Encoder-decoders: unset, each row "
        "holds micro_batch_size random examples; set, rows are filled to this budget (and "
        "max_target_tokens) by a two-capacity multipack sampler, so which examples share an optimizer step "
        "depends on their lengths (docs/packing.md; with only max_target_tokens set, the budget is "
        "micro_batch_size x the mean source length / 0.95). A larger budget holds more examples per row: "
        "lower gradient_accumulation_steps to keep the step; docs/packing.md has measured budgets. "
        "Encoder-decoders that cannot pack (data.packing: auto on BART and the like): the source budget of a "
        "padded micro-batch of similar lengths (rows x longest), by default micro_batch_size examples on "
        "average.",
    )
    max_target_tokens: int | None = Field(
        None,
        ge=1,
        description="Encoder-decoders: the token budget of the decoder row (packed), or of a padded "
        "micro-batch's targets (rows x longest, when the model cannot pack). Default: max_tokens x "
        "the training data's target/source token ratio (at least its longest target), so both rows fill "
        "alike (the sampler packs under both budgets at once).",
    )
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    seed: int = Field(42, description="Seed for model init, LoRA init, shuffling and dropout.")
    log_every: int = Field(1, ge=1, description="Write a metrics.jsonl line every this many steps.")
    on_nonfinite: Literal["error", "skip"] = Field(
        "error",
        description="A step whose loss or gradient norm is NaN or infinite. error: stop with a message naming "
        "the step (exit code 4), keeping the last checkpoint; skip: drop that step's update (weights, "
        "optimizer and learning-rate schedule unchanged) and count it in summary.json.",
    )
    max_skipped_steps: int = Field(
        10,
        ge=0,
        description="With on_nonfinite skip: stop as with error once more steps than this were skipped.",
    )
    early_stopping_patience: int | None = Field(
        None,
        ge=1,
        description="Stop training cleanly after this many evaluations in a row that did not improve "
        "checkpoint.best_metric (evaluations without that metric do not count); summary.json records "
        "stop_reason early_stopping. Needs checkpoint.best_metric. null: train for every planned step.",
    )
    objective: Literal["sft", "dpo"] = Field(
        "sft",
        description="sft: token-weighted cross-entropy on the targets; dpo: preference tuning on (prompt, "
        "chosen, rejected) pairs, configured in the dpo section (docs/dpo.md).",
    )
    resume: str = Field(
        "auto",
        description="auto: continue from the newest complete checkpoint in output.dir/checkpoints (see the "
        "checkpoint section) when there is one, so a relaunch of the same recipe picks up where it stopped; "
        "never: start fresh (existing checkpoints are deleted); or the path of one checkpoint directory to "
        "resume from.",
    )


class CheckpointSection(Section):
    """Resumable checkpoints: DeepSpeed engine state (weights, optimizer, scheduler), sampler position, RNG
    states and loop counters, written atomically under output.dir/checkpoints. See docs/resume.md."""

    every: int | None = Field(
        None, ge=1, description="Save a checkpoint every this many optimizer steps; null: only at epoch ends."
    )
    at_epoch_end: bool = Field(True, description="Save a checkpoint at the end of every epoch.")
    keep: int = Field(2, ge=1, description="Keep the newest this many checkpoints; older ones are deleted.")
    best_metric: str | None = Field(
        None,
        description="Keep the adapter (full: the model) of the best evaluation so far in output.dir/best, "
        "judged by this metric: `eval.loss`, or with eval.generate a generation metric such as `eval.rouge1`, "
        "`eval.rougeL`, `eval.exact_match`, `eval.accuracy`. summary.json records the best step and value. "
        "null: no best checkpoint.",
    )
    best_mode: Literal["auto", "max", "min"] = Field(
        "auto",
        description="Whether a larger (max) or smaller (min) checkpoint.best_metric is better. auto: min for "
        "eval.loss, max for the generation metrics (percentages).",
    )

    def best_direction(self) -> str | None:
        """`min` or `max` for checkpoint.best_metric (best_mode, or what auto means for it); None without one."""
        if self.best_metric is None:
            return None
        if self.best_mode != "auto":
            return self.best_mode
        return "min" if self.best_metric == "eval.loss" else "max"


# The ZeRO++ keys of DistributedSection (zero_stage 3 only); deepspeed_config.py writes them.
ZERO_PLUS_PLUS = ("hpz_partition_size", "quantized_weights", "quantized_gradients")


class DistributedSection(Section):
    """How the work is spread over processes: DeepSpeed ZeRO (the default) or PyTorch FSDP2."""

    num_processes: int = Field(
        1, ge=1, description="Processes per node; `python -m lorakit.run` starts torchrun when it needs more."
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(3, description="DeepSpeed ZeRO stage.")
    offload_optimizer: Literal["none", "cpu", "nvme"] = Field(
        "none", description="Where ZeRO keeps optimizer state."
    )
    offload_params: Literal["none", "cpu", "nvme"] = Field(
        "none", description="Where ZeRO-3 keeps parameters between uses."
    )
    nvme_path: str | None = Field(None, description="Directory on a fast local disk for nvme offload.")
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="torch.distributed backend; auto: nccl on GPUs, gloo on CPU."
    )
    hpz_partition_size: int = Field(
        1,
        ge=1,
        description="ZeRO++ hierarchical partitioning (hpZ, zero_stage 3): each process also keeps a secondary "
        "copy of the parameters partitioned over a group of this many consecutive ranks, so the forward and "
        "backward all-gathers stay inside the group; set it to the processes (GPUs) per node when the nodes "
        "lack a fast interconnect such as InfiniBand. Costs params x dtype bytes / hpz_partition_size more "
        "memory per process. Must divide the processes per node (checked at start). 1: off. See "
        "docs/multinode.md#zero.",
    )
    quantized_weights: bool = Field(
        False,
        description="ZeRO++ qwZ (zero_stage 3): all-gather the parameters in int8 instead of model.dtype, "
        "halving that traffic. Needs GPUs (DeepSpeed's CUDA quantizer kernels); refused on CPU.",
    )
    quantized_gradients: bool = Field(
        False,
        description="ZeRO++ qgZ (zero_stage 3): reduce-scatter the gradients in int4 with a two-step "
        "all-to-all (within, then across nodes). Needs GPUs (DeepSpeed's CUDA quantizer kernels); refused on "
        "CPU.",
    )
    # issue 38: no hang, ever.
    timeout_minutes: float = Field(
        30.0,
        gt=0,
        description="How long a collective (all-reduce, barrier, broadcast) waits for every process before it "
        "fails with an error naming the phase and step it was in, instead of hanging: covers a process that "
        "stalls or dies without its peers noticing (another node, a lost network). Raise it when one "
        "process legitimately works alone for longer (rank 0 tokenizing a large dataset that "
        "`python -m lorakit.prepare` did not cache beforehand). See docs/faults.md.",
    )

    sequence_parallel: int = Field(
        1,
        ge=1,
        description="Sequence parallelism (DeepSpeed Ulysses): each packed row is split along the sequence "
        "over this many consecutive ranks, which exchange attention heads with all-to-alls; each rank holds "
        "1/N of the row's activations, so rows N times longer train. The ranks of a group see the same "
        "rows (the data-parallel replicas are the groups). Causal LMs with packed rows on sdpa or "
        "flash_attention_2; must divide distributed.num_processes and the model's attention and key/value "
        "heads (checked when the model config loads). 1: off. See docs/long-context.md.",
    )

    # issue 36: the sharding backend.
    strategy: Literal["deepspeed", "fsdp"] = Field(
        "deepspeed",
        description="The sharding backend: deepspeed (ZeRO, the zero_stage and offload keys) or fsdp (PyTorch "
        "FSDP2, the distributed.fsdp section). The same recipe trains on either. See docs/backends.md.",
    )
    fsdp: FsdpSection = Field(FsdpSection(), description="strategy fsdp: how FSDP2 shards the model.")

    @model_validator(mode="after")
    def _check(self) -> DistributedSection:
        if self.sequence_parallel > 1 and self.num_processes % self.sequence_parallel:
            raise ValueError(
                f"distributed.sequence_parallel {self.sequence_parallel} must divide the processes per node "
                f"(distributed.num_processes {self.num_processes}): a row is split over ranks of one node"
            )
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ValueError("distributed.offload_optimizer needs zero_stage 1, 2 or 3")
        if self.offload_params != "none" and self.zero_stage != 3:
            raise ValueError("distributed.offload_params needs zero_stage 3")
        if "nvme" in (self.offload_optimizer, self.offload_params) and not self.nvme_path:
            raise ValueError("distributed.nvme_path is required when offloading to nvme")
        asked = [k for k in ZERO_PLUS_PLUS if getattr(self, k) != type(self).model_fields[k].default]
        if asked and self.zero_stage != 3:
            key = asked[0]
            raise ValueError(
                f"distributed.{key} is a ZeRO++ option of ZeRO stage 3 (it partitions or quantizes "
                f"the stage-3 parameter and gradient exchange); set distributed.zero_stage: 3 or remove it"
            )
        if self.hpz_partition_size > 1 and self.offload_params == "nvme":
            # DeepSpeed 0.19 allocates the secondary partition with torch.empty(device=<offload device>),
            # which fails for "nvme" (partition_parameters.py, _partition_param_sec).
            raise ValueError(
                "distributed.hpz_partition_size > 1 cannot be combined with offload_params: nvme: DeepSpeed "
                "keeps hpZ's secondary parameter partition on the offload device and cannot allocate it on "
                "nvme; offload_params to cpu, or hpz_partition_size: 1"
            )
        if self.num_processes > 1 and self.num_processes % self.hpz_partition_size:
            raise ValueError(
                f"distributed.hpz_partition_size {self.hpz_partition_size} must divide the processes per node "
                f"(distributed.num_processes {self.num_processes}); set it to {self.num_processes} (or a "
                "divisor of it)"
            )
        return self


class EvalSection(Section):
    """Evaluation during training, after each epoch and every eval.every steps: loss, and generation
    metrics. See docs/observe.md."""

    enabled: bool = Field(
        True, description="Evaluate after each epoch and every eval.every steps (needs data.eval_split)."
    )
    every: int | None = Field(
        None,
        ge=1,
        description="Also evaluate every this many optimizer steps (every rank takes part, as at epoch "
        "ends). null: only at epoch ends. An evaluation never changes training: the same losses follow.",
    )
    max_samples: int | None = Field(
        None,
        ge=1,
        description="Evaluate on the first this many eval rows during training (after data.max_eval_samples), "
        "to keep frequent evaluations cheap; `python -m lorakit.evaluate` afterwards uses every row. null: "
        "all rows.",
    )
    generate_at: Literal["every_eval", "epoch_end"] = Field(
        "every_eval",
        description="With eval.generate: which evaluations generate and score predictions. every_eval: all "
        "of them; epoch_end: only those at epoch ends (the eval.every ones take the loss only, much cheaper).",
    )
    metrics: list[Literal["rouge", "exact_match", "accuracy"]] = Field(
        ["rouge"], description="Generation metrics: rouge (summaries), exact_match/accuracy (labels)."
    )
    generate: bool = Field(True, description="Generate predictions for the metrics (else loss only).")
    max_new_tokens: int | Literal["auto"] = Field(
        "auto", description="Generation length cap; auto: data.max_target_length."
    )
    num_beams: int = Field(1, ge=1, description="Beam search width for generation.")
    micro_batch_size: int | None = Field(None, ge=1, description="Eval batch size; default train's.")


# A Hub repository id: OWNER/NAME (what the Hub accepts for both parts, without its length limits).
REPO_ID_PATTERN = r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$"


class PushToHubSection(Section):
    """output.push_to_hub: where the trained model goes on the Hugging Face Hub (docs/publish.md)."""

    repo_id: str = Field(
        pattern=REPO_ID_PATTERN,
        description="The model repository, OWNER/NAME (your user or organization name); created when it "
        "does not exist.",
    )
    private: bool = Field(
        False, description="Create the repository private (an existing repository keeps its visibility)."
    )
    revision: str | None = Field(
        None, description="Branch to commit to, created when missing; null: main.", min_length=1
    )
    create_pr: bool = Field(
        False, description="Open a pull request with the commit instead of committing to the branch."
    )


class OutputSection(Section):
    """Where the run directory goes."""

    dir: str = Field(
        description="Run directory: recipe.yaml, ds_config.json, metrics.jsonl, summary.json, adapter/ "
        "(merged/ with output.merge)."
    )
    save_adapter: bool = Field(
        True, description="Save the trained adapter (LoRA) or model (full) at the end."
    )
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        ["tensorboard"],
        description="Where the metric records of metrics.jsonl also go (rank 0), with the resolved recipe as "
        "hyper-parameters: tensorboard (event files in output.dir/tensorboard), wandb (offline unless "
        'WANDB_MODE or a W&B login says otherwise; pip install "lorakit[wandb]"), mlflow (a file store in '
        'output.dir/mlruns unless MLFLOW_TRACKING_URI is set; pip install "lorakit[mlflow]"). []: only '
        "metrics.jsonl. See docs/observe.md.",
    )
    # issue 38: a tracker never stops training.
    tracker_timeout_seconds: float = Field(
        60.0,
        gt=0,
        description="How long rank 0 waits for a remote tracker (wandb, mlflow) to start before training "
        "goes on without it (a warning; summary.json lists it under trackers as failed); the records stay "
        "in metrics.jsonl. Also the longest a run's end waits for a tracker to take its last records.",
    )
    merge: bool = Field(
        False,
        description="After saving, merge the adapter into the base (full runs: re-export the model) as "
        "sharded safetensors in run_dir/merged, in model.dtype, verified like `python -m lorakit.merge` "
        "(rank 0, in the training process); summary.json records merged_dir. See docs/merge.md.",
    )
    push_to_hub: PushToHubSection | None = Field(
        None,
        description="{repo_id: OWNER/NAME (required), private: false, revision: null (main; a branch is "
        "created when missing), create_pr: false}: at the end of a run whose every check passed "
        "(the merge's included), rank 0 pushes the adapter (or model), and the merged model with "
        "output.merge, to the Hugging Face Hub in one commit, with a model card, recipe.yaml and loss.png; "
        "the token comes from HF_TOKEN or `hf auth login`, checked before training. A failed push leaves the "
        "run complete (exit code 69; push it again with `python -m lorakit.push`). See docs/publish.md.",
    )

    @model_validator(mode="after")
    def _check(self) -> OutputSection:
        if len(set(self.report_to)) != len(self.report_to):
            raise ValueError(f"output.report_to names a backend twice: {self.report_to}")
        if self.merge and not self.save_adapter:
            raise ValueError(
                "output.merge needs output.save_adapter: true (the merge reads the saved adapter or model)"
            )
        if self.push_to_hub is not None and not self.save_adapter:
            raise ValueError(
                "output.push_to_hub needs output.save_adapter: true (the push uploads the saved adapter or model)"
            )
        return self


class PreflightSection(Section):
    """Checks of the machine before training starts. See docs/doctor.md."""

    doctor: bool = Field(
        False,
        description="Run `python -m lorakit.doctor RECIPE --quick` before training (in the launching process, "
        "after the run lock is taken): the environment, the packing / loss / merge / accumulation contracts "
        "on a small model of the recipe's architecture with its kernels and dtype, one block's speed and the "
        "memory plan. Its report goes to output.dir/doctor; a failed check stops the run (exit code 3) "
        "before the training model is loaded. Under a launcher other than lorakit's (torchrun, the deepspeed "
        "launcher) it does not run: run the doctor before launching.",
    )


class Recipe(Section):
    """A complete, validated, frozen training recipe."""

    model: ModelSection
    method: MethodSection = MethodSection()
    data: DataSection
    train: TrainSection = TrainSection()
    distributed: DistributedSection = DistributedSection()
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    dpo: DpoSection = DpoSection()
    output: OutputSection
    preflight: PreflightSection = PreflightSection()

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        if self.data.format == "completion" and self.eval_active() and self.eval.generate:
            raise ValueError(
                "eval.generate: data.format completion has no reference outputs to score generations "
                "against; set eval.generate: false (the eval loss is still computed)"
            )
        if self.train.on_nonfinite == "skip" and self.distributed.zero_stage == 0:
            raise ValueError(
                "train.on_nonfinite: skip needs distributed.zero_stage 1, 2 or 3: ZeRO's optimizers leave out an "
                "update whose gradients are not finite, while stage 0 applies it before lorakit sees the "
                "gradient norm; use a ZeRO stage or on_nonfinite: error"
            )
        if self.eval.enabled and self.eval.generate and not self.eval.metrics:
            raise ValueError(
                "eval.metrics is empty while eval.generate is true: name a metric or set generate: false"
            )
        if self.method.kind == "qlora" and self.method.use_dora and self.distributed.zero_stage == 3:
            # Tried (2 processes, tiny Llama and T5): peft's DoRA layer hands DeepSpeed a 4-bit weight that
            # ZeRO-3 never partitioned ("'Params4bit' object has no attribute 'ds_status'" in the first
            # forward), with or without checkpointing; ZeRO-2 trains it.
            raise ValueError(
                "method.use_dora: DoRA on a 4-bit base (kind qlora) fails under ZeRO-3 (peft's DoRA layer reaches "
                "a 4-bit weight DeepSpeed did not partition); use distributed.zero_stage 2, or kind lora"
            )
        self._check_sequence_parallel()
        check_fsdp(self)
        check_objective(self)
        self._check_best()
        return self

    def _check_sequence_parallel(self) -> None:
        if self.model.tiled_loss is True and self.train.objective != "sft":
            raise ValueError(
                "model.tiled_loss: true tiles the token cross-entropy of SFT; train.objective dpo needs each "
                "sequence's log-probabilities from the logits: set model.tiled_loss: auto or false"
            )
        if self.distributed.sequence_parallel == 1:
            return
        if self.model.attention == "eager":
            raise ValueError(
                "distributed.sequence_parallel > 1 needs model.attention sdpa, flash_attention_2 or auto: "
                "eager attention over a split row would need the whole row's T x T mask on every rank"
            )
        if self.data.packing is False:
            raise ValueError(
                "distributed.sequence_parallel > 1 splits packed rows: set data.packing: auto or true"
            )
        if self.train.objective != "sft":
            raise ValueError(
                "distributed.sequence_parallel > 1 splits SFT rows; train.objective dpo keeps each preference "
                "pair's sequences whole on one rank: use distributed.sequence_parallel 1 with dpo"
            )

    def _check_best(self) -> None:
        ck, ev = self.checkpoint, self.eval
        if ev.every is not None and not self.eval_active():
            raise ValueError(
                "eval.every needs evaluation: eval.enabled true and a data.eval_split (or remove eval.every)"
            )
        if ck.best_metric is not None:
            if not self.eval_active():
                raise ValueError(
                    f"checkpoint.best_metric {ck.best_metric!r} needs evaluation: eval.enabled true and a "
                    "data.eval_split"
                )
            produced = self.eval_metric_names()
            if ck.best_metric not in produced:
                raise ValueError(
                    f"checkpoint.best_metric {ck.best_metric!r} is not a metric this recipe's evaluation "
                    f"produces; choose one of {sorted(produced)}"
                    + ("" if ev.generate else " (generation metrics need eval.generate: true)")
                )
        if self.train.early_stopping_patience is not None and ck.best_metric is None:
            raise ValueError(
                "train.early_stopping_patience counts evaluations without improvement of "
                "checkpoint.best_metric: set checkpoint.best_metric (e.g. eval.loss)"
            )

    def eval_metric_names(self) -> set[str]:
        """`eval.NAME` for every metric this recipe's in-run evaluation reports: loss, and with eval.generate
        the keys of eval.metrics (rouge: rouge1, rouge2, rougeL, rougeLsum)."""
        names = {"eval.loss"}
        if self.train.objective == "dpo":
            names |= {f"eval.{key}" for key in DPO_METRICS}
        if self.eval.generate:
            from lorakit.evaluation.scoring import metric_keys

            names |= {f"eval.{key}" for name in self.eval.metrics for key in metric_keys(name)}
        return names

    def eval_active(self) -> bool:
        """Whether the run evaluates (evaluation enabled and an eval split given)."""
        return self.eval.enabled and self.data.eval_split is not None
