"""THE recipe schema: every key, type, default and cross-field check lives here.

A recipe is frozen after validation; values derived from it are functions, not stored fields.
"""

from __future__ import annotations

import string
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


def placeholders(template: str) -> list[str]:
    """The column names in `template`'s braces, in order of first use; ValueError for anything else in
    braces (an index, an attribute, a format spec) or an unbalanced brace."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"{e} (write {{{{ and }}}} for literal braces)") from None
    names: list[str] = []
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            shown = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise ValueError(
                f"{{{shown}}}: a placeholder is a column name in braces, like {{premise}} "
                "(write {{ and }} for literal braces)"
            )
        if name not in names:
            names.append(name)
    return names


class _Section(BaseModel):
    # extra="forbid": a misspelled key is an error naming it, never silently None.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelSection(_Section):
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
    gradient_checkpointing: bool = Field(
        True, description="Non-reentrant activation checkpointing: trades ~30% compute for much less memory."
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


class MethodSection(_Section):
    """What is trained: a peft adapter (LoRA on a base in model.dtype or in 4 bits, or IA3) or every
    parameter. See docs/methods.md."""

    kind: Literal["lora", "qlora", "full", "ia3"] = Field(
        "lora",
        description="lora: train a LoRA adapter on the frozen base, kept in model.dtype; qlora: the same on "
        "a base quantized to 4 bits (bitsandbytes NF4, double quantization, compute and storage in "
        'model.dtype; needs pip install "lorakit[qlora]"), for when GPU memory is short; full: train every '
        "weight; ia3: train IA3 scaling vectors (peft's IA3Config), far fewer weights than LoRA.",
    )
    quant_type: Literal["nf4", "fp4"] | None = Field(
        None,
        description="kind qlora: the 4-bit data type of the base. null means nf4 (NormalFloat4, the QLoRA "
        "paper's choice); fp4 is plain 4-bit float. Only kind qlora quantizes: set with full or lora it is "
        "an error.",
    )
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (the update is scaled by alpha / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear",
        description="Modules that get the adapter: `all-linear` (LoRA: every linear layer but the output "
        "head; ia3: peft's IA3 defaults for the architecture, e.g. T5 k, v, wo and Llama k_proj, v_proj, "
        "down_proj) or a list of module-name suffixes such as [q, k, v, o].",
    )
    use_dora: bool = Field(
        False,
        description="LoRA, qlora: DoRA (peft use_dora), a LoRA direction plus a trained magnitude per output "
        "feature of each adapted layer.",
    )
    use_rslora: bool = Field(
        False,
        description="LoRA, qlora: rank-stabilized LoRA (peft use_rslora), scaling the update by "
        "alpha / sqrt(r) instead of alpha / r.",
    )
    init: Literal["default", "pissa", "olora", "gaussian"] = Field(
        "default",
        description="LoRA: how the adapter starts (peft init_lora_weights). default: B = 0; gaussian: A "
        "Gaussian, B = 0; pissa / olora: A and B from the base weight's principal singular vectors / a QR "
        "decomposition, subtracted from the base. The saved adapter is converted to a plain LoRA adapter of "
        "rank 2r on the original base (docs/methods.md), so it loads and merges like any other.",
    )
    lr_ratio_b: float | None = Field(
        None,
        gt=0,
        description="LoRA+: the lora_B matrices (and 1-D trainable weights, as peft's LoRA+ groups them) "
        "train at train.lr x this ratio, through their own optimizer parameter group; null: one learning "
        "rate. The LoRA+ paper suggests 16.",
    )
    modules_to_save: list[str] | None = Field(
        None,
        description="Adapters: modules trained in full next to the adapter and saved with it (peft "
        "modules_to_save), e.g. [embed_tokens, lm_head] for an extended vocabulary.",
    )
    feedforward_modules: list[str] | None = Field(
        None,
        description="kind ia3: the target modules whose input (not output) is scaled, a subset of "
        "target_modules; null: peft's defaults with target_modules all-linear, else none.",
    )

    @model_validator(mode="after")
    def _check(self) -> MethodSection:
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError("method.target_modules: give at least one module name, or `all-linear`")
        if self.quant_type is not None and self.kind == "full":
            raise ValueError(
                "method.quant_type: full fine-tuning cannot train a 4-bit base (bitsandbytes' 4-bit weights "
                "are frozen, and full has no adapter to train on top of them); use method.kind: qlora, or "
                "remove method.quant_type"
            )
        if self.quant_type is not None and self.kind == "ia3":
            raise ValueError(
                "method.quant_type: kind ia3 keeps the base in model.dtype (lorakit quantizes the base for a "
                "LoRA adapter only); use method.kind: qlora, or remove method.quant_type"
            )
        if self.quant_type is not None and self.kind == "lora":
            raise ValueError(
                "method.quant_type: kind lora keeps the base in model.dtype; use method.kind: qlora for a "
                "4-bit base"
            )
        if not self.lora():
            for name in self._lora_options_set():
                raise ValueError(
                    f"method.{name}: a LoRA option, and kind {self.kind} trains no LoRA adapter; use kind "
                    "lora or qlora, or remove it"
                )
        if self.modules_to_save is not None and (self.kind == "full" or not self.modules_to_save):
            raise ValueError(
                "method.modules_to_save: kind full trains every module already"
                if self.kind == "full"
                else "method.modules_to_save: give at least one module name, or null"
            )
        if self.feedforward_modules is not None and self.kind != "ia3":
            raise ValueError("method.feedforward_modules: only kind ia3 scales feedforward inputs")
        if self.feedforward_modules is not None and not (
            isinstance(self.target_modules, list)
            and set(self.feedforward_modules) <= set(self.target_modules)
        ):
            raise ValueError(
                "method.feedforward_modules: must be a subset of a method.target_modules list (with all-linear "
                "peft picks both for the architecture)"
            )
        self._check_combinations()
        return self

    def _lora_options_set(self) -> list[str]:
        options = {"use_dora": self.use_dora, "use_rslora": self.use_rslora, "lr_ratio_b": self.lr_ratio_b}
        named = [name for name, value in options.items() if value]
        return named + (["init"] if self.init != "default" else [])

    def _check_combinations(self) -> None:
        """What peft cannot do, found by trying (tests/unit/test_methods.py shows the failure)."""
        if self.kind == "qlora" and self.init == "pissa":
            # peft's pissa_init decomposes the weight tensor as it finds it: a 4-bit weight stored as uint8 is
            # refused (TypeError), and one stored in model.dtype (lorakit's quant storage) is the packed 4-bit
            # bytes read as numbers: the SVD fails on non-finite values. olora_init dequantizes first.
            raise ValueError(
                "method.init: pissa decomposes the base weights, which peft cannot do on a 4-bit base; use kind "
                "lora, or init olora / default / gaussian"
            )

    def adapter(self) -> bool:
        """Whether the method trains a peft adapter (lora, qlora, ia3) rather than every weight (full)."""
        return self.kind in ("lora", "qlora", "ia3")

    def lora(self) -> bool:
        """Whether the adapter is LoRA (lora, qlora), the kind the LoRA options (DoRA, rsLoRA, init, LoRA+)
        apply to."""
        return self.kind in ("lora", "qlora")

    def mutates_base(self) -> bool:
        """Whether the adapter's init rewrites the base weights (pissa, olora): its saved form is converted."""
        return self.init in ("pissa", "olora")

    def options(self) -> list[str]:
        """The options set on the method, as comparisons label runs: dora, rslora, pissa, lora+ x16, ..."""
        named = [name for name, on in (("dora", self.use_dora), ("rslora", self.use_rslora)) if on]
        named += [self.init] if self.init != "default" else []
        named += [f"lora+ x{self.lr_ratio_b:g}"] if self.lr_ratio_b else []
        named += [f"full {','.join(self.modules_to_save)}"] if self.modules_to_save else []
        return named

    def quantization(self) -> str | None:
        """The base's 4-bit data type (nf4, fp4), or None when the base is not quantized."""
        if self.kind != "qlora":
            return None
        return self.quant_type or "nf4"


def _check_templates(owner: str, prompt_template: str | None, target_template: str | None) -> None:
    for name, template in (("prompt_template", prompt_template), ("target_template", target_template)):
        if template is None:
            continue
        try:
            fields = placeholders(template)
        except ValueError as e:
            raise ValueError(f"{owner}.{name} has a bad placeholder: {e}") from None
        if not fields:
            raise ValueError(
                f"{owner}.{name} names no column: put one in braces, e.g. {{input}} or {{premise}}"
            )


class SourceSpec(_Section):
    """One source of a dataset mixture (data.source given as a list). Keys left unset take the data
    section's value; each source may name its own columns and templates."""

    source: str = Field(description="As data.source: a hub id, a local file or directory, or builtin:NAME.")
    name: str | None = Field(
        None, description="Name in summary.json and per-source metrics; default: the source's last path part."
    )
    config: str | None = Field(None, description="Hub configuration name.")
    split: str | None = Field(None, description="Split to train on; default data.split.")
    eval_split: str | None = Field(
        "auto", description="Split to evaluate on (as data.eval_split); null: this source adds no eval rows."
    )
    weight: float | None = Field(
        None,
        gt=0,
        description="Share of the mixture's training examples, relative to the other weighted sources.",
    )
    max_samples: int | None = Field(
        None, ge=1, description="Exactly this many training examples from this source (instead of a weight)."
    )
    input_column: str | None = None
    target_column: str | None = None
    text_column: str | None = None
    messages_column: str | None = None
    prompt_template: str | None = None
    target_template: str | None = None
    label_names: list[str] | None = None

    @model_validator(mode="after")
    def _check(self) -> SourceSpec:
        if self.weight is not None and self.max_samples is not None:
            raise ValueError(
                f"data.source {self.source!r}: give a weight or max_samples, not both (a weight is a share of "
                "the mixture, max_samples an exact count)"
            )
        _check_templates("data.source[]", self.prompt_template, self.target_template)
        return self

    def display_name(self) -> str:
        """The source's name in summaries: `name`, else the last part of its path or id."""
        return self.name or self.source.removeprefix("builtin:").rstrip("/").rsplit("/", 1)[-1]


# Per-source keys a mixture entry may set for itself (None: the data section's value).
_PER_SOURCE = (
    "config",
    "split",
    "eval_split",
    "input_column",
    "target_column",
    "text_column",
    "messages_column",
    "prompt_template",
    "target_template",
    "label_names",
)


class DataSection(_Section):
    """Where examples come from and how they become tokens."""

    source: str | list[SourceSpec] = Field(
        description="Hub dataset id (loaded with datasets.load_dataset), a local .json/.jsonl/.csv/.parquet "
        "file, a local directory holding {split}.{ext} files, or `builtin:NAME` for a dataset shipped "
        "with lorakit (builtin:news_summaries). Or a mixture: a list of {source, name, config, split, "
        "eval_split, weight | max_samples, columns and templates} whose training rows are drawn by weight "
        "(with data.split_seed); every example keeps its source's name (docs/data.md#dataset-mixtures)."
    )
    config: str | None = Field(None, description="Hub dataset configuration name, e.g. `3.0.0`.")
    split: str = Field("train", description="Split to train on.")
    eval_split: str | None = Field(
        "auto",
        description="Split to evaluate on. auto: the source's `validation` split when it has one, else a "
        "held-out part of the training split (data.val_size); null disables evaluation data.",
    )
    val_size: float | int | None = Field(
        None,
        description="Hold out this part of the training split for evaluation, never trained on: a fraction "
        "(0 < x < 1) or a number of rows, picked at random with data.split_seed (the same rows on every run "
        "of the same data, however max_samples is set). Unset with eval_split auto and no `validation` split: "
        "5% of the rows, at least 1 and at most 1000. Needs eval_split auto.",
    )
    split_seed: int = Field(0, description="Seed of the held-out rows that data.val_size picks.")
    format: Literal["instruction", "completion", "chat"] = Field(
        "instruction",
        description="instruction: (input, target) text pairs, the input put through prompt_template (the "
        "only format for encoder-decoder models); completion: one text column, every token trained "
        "(causal LMs); chat: a column of messages [{role, content}, ...] rendered with the tokenizer's chat "
        "template, loss on the assistant turns (causal LMs).",
    )
    input_column: str = Field(
        "input", description="instruction: the column `{input}` reads in data.prompt_template."
    )
    target_column: str = Field(
        "target",
        description="instruction: column with the text the model must produce, or with class ids (integers) "
        "that become label words (the dataset's ClassLabel names, or data.label_names).",
    )
    target_template: str | None = Field(
        None,
        description="instruction: template of the target, `{name}` taking column `name` (`{target}`: "
        "data.target_column); null: data.target_column as it is.",
    )
    label_names: list[str] | None = Field(
        None,
        description="instruction: the words for class ids 0, 1, ... in data.target_column (e.g. [entailment, "
        "neutral, contradiction]); default: the dataset's ClassLabel names when it has them. With labels "
        "known, evaluation reports per-class counts and a confusion matrix.",
    )
    text_column: str = Field("text", description="completion: column with the text to train on.")
    messages_column: str = Field("messages", description="chat: column with the list of messages.")
    train_on_inputs: bool = Field(
        False,
        description="Causal LMs: also take the loss on prompt tokens (instruction) or on system and user "
        "turns (chat). Off by default: the loss is on responses only.",
    )
    prompt_template: str = Field(
        "{input}",
        description="instruction: template of the model input; `{name}` takes column `name` of the data "
        "(`{input}`: data.input_column), e.g. `mnli hypothesis: {hypothesis} premise: {premise}`. Every "
        "named column must exist (checked before anything is written); `{{`/`}}` are literal braces.",
    )
    max_samples: int | None = Field(None, ge=1, description="Use at most this many training rows.")
    max_eval_samples: int | None = Field(None, ge=1, description="Use at most this many evaluation rows.")
    max_source_length: int | Literal["auto"] = Field(
        "auto",
        description="Token cap on the templated input. auto: the longest templated input, capped at the "
        "model's maximum length.",
    )
    max_target_length: int | Literal["auto"] = Field(
        "auto",
        description="Token cap on the target. auto: the 95th percentile of target lengths (with "
        "data.overlong drop or error: the longest target, capped at the model's maximum length).",
    )
    max_length: int | Literal["auto"] = Field(
        "auto",
        description="Causal LMs: token cap on a whole example (prompt and response). auto: the longest "
        "example, capped at the model's maximum length.",
    )
    overlong: Literal["truncate", "drop", "error"] = Field(
        "truncate",
        description="What happens to an example longer than its cap (max_length, or train.max_tokens when "
        "packing; max_source/target_length for encoder-decoders): truncate it, drop it, or stop with an "
        "error naming the row. Truncated and dropped examples are counted in summary.json.",
    )
    on_bad_rows: Literal["error", "skip"] = Field(
        "error",
        description="A row that cannot become an example: a line that is not valid JSON (.jsonl), a missing "
        "column, a null, empty or non-text field, or (chat) messages that are not a list of {role, content} "
        "texts. error: stop with a message naming the file and line (the row index for hub datasets and "
        "parquet files); skip: leave it out, print how many were left out with the first reasons, and count "
        "them in summary.json (data.bad_rows). Over-long examples are data.overlong's business. See "
        "docs/data.md.",
    )
    packing: bool | Literal["auto"] = Field(
        "auto",
        description="Pack several examples into one row, so no compute goes to padding; attention never "
        "crosses examples. Causal LMs: rows of up to train.max_tokens tokens (multipack sampler). "
        "Encoder-decoders: an encoder row and a decoder row per micro-batch, of micro_batch_size random "
        "examples (the optimizer steps of random padded batches), or with train.max_tokens / "
        "max_target_tokens set, filled to those budgets by a two-capacity multipack sampler; T5-family "
        "models on sdpa or eager. auto: on for causal LMs and for T5 on "
        "sdpa or eager, off for other encoder-decoders (padded micro-batches of similar lengths sized by "
        "train.max_tokens / max_target_tokens); false: fixed micro-batches of micro_batch_size "
        "grouped by length and padded to their longest member. See docs/packing.md.",
    )
    group_by_length: bool = Field(
        True,
        description="Without packing: put examples of similar length in the same micro-batch, so padding to "
        "the longest member wastes little. false: random micro-batches (more padding, fully random order).",
    )
    cache_dir: str = Field(
        "~/.cache/lorakit", description="Where tokenized datasets and built tiny models are cached."
    )
    num_proc: int = Field(1, ge=1, description="Processes for tokenization (datasets.map).")

    @model_validator(mode="after")
    def _check(self) -> DataSection:
        _check_templates("data", self.prompt_template, self.target_template)
        if isinstance(self.source, list):
            if not self.source:
                raise ValueError("data.source: an empty list; give one source or a list of several")
            names = [spec.display_name() for spec in self.source]
            if len(set(names)) != len(names):
                raise ValueError(f"data.source: two sources share a name ({names}); give each a `name`")
        if self.label_names is not None and (
            len(self.label_names) < 2 or len(set(self.label_names)) != len(self.label_names)
        ):
            raise ValueError("data.label_names: give at least two different label words")
        if self.val_size is not None:
            if isinstance(self.val_size, float) and not 0 < self.val_size < 1:
                raise ValueError("data.val_size: a fraction must be between 0 and 1 (or give a row count)")
            if isinstance(self.val_size, int) and self.val_size < 1:
                raise ValueError("data.val_size: a row count must be >= 1")
            if self.eval_split != "auto":
                raise ValueError(
                    f"data.val_size holds rows out of the training split for evaluation, but data.eval_split "
                    f"is {self.eval_split!r}; set data.eval_split: auto, or remove data.val_size"
                )
        for name in ("max_source_length", "max_target_length", "max_length"):
            value = getattr(self, name)
            if isinstance(value, int) and value < 1:
                raise ValueError(f"data.{name} must be >= 1 or 'auto'")
        return self


def _part(data: DataSection, spec: SourceSpec) -> DataSection:
    own = {k: getattr(spec, k) for k in _PER_SOURCE if getattr(spec, k) is not None}
    if spec.eval_split is None:
        own["eval_split"] = None
    # Built from validated parts: no re-validation (a copy, not a recipe of its own).
    return data.model_copy(update={"source": spec.source, **own})


def data_parts(data: DataSection) -> list[tuple[str, DataSection, SourceSpec | None]]:
    """(name, the data section as seen by one source, its mixture entry) for every source: one part with no
    entry for a single data.source."""
    if not isinstance(data.source, list):
        return [(str(data.source), data, None)]
    return [(spec.display_name(), _part(data, spec), spec) for spec in data.source]


class TrainSection(_Section):
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
    resume: str = Field(
        "auto",
        description="auto: continue from the newest complete checkpoint in output.dir/checkpoints (see the "
        "checkpoint section) when there is one, so a relaunch of the same recipe picks up where it stopped; "
        "never: start fresh (existing checkpoints are deleted); or the path of one checkpoint directory to "
        "resume from.",
    )


class CheckpointSection(_Section):
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


class DistributedSection(_Section):
    """How the work is spread over processes with DeepSpeed ZeRO."""

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

    @model_validator(mode="after")
    def _check(self) -> DistributedSection:
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


class EvalSection(_Section):
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


class OutputSection(_Section):
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
    merge: bool = Field(
        False,
        description="After saving, merge the adapter into the base (full runs: re-export the model) as "
        "sharded safetensors in run_dir/merged, in model.dtype, verified like `python -m lorakit.merge` "
        "(rank 0, in the training process); summary.json records merged_dir. See docs/merge.md.",
    )

    @model_validator(mode="after")
    def _check(self) -> OutputSection:
        if len(set(self.report_to)) != len(self.report_to):
            raise ValueError(f"output.report_to names a backend twice: {self.report_to}")
        if self.merge and not self.save_adapter:
            raise ValueError(
                "output.merge needs output.save_adapter: true (the merge reads the saved adapter or model)"
            )
        return self


class Recipe(_Section):
    """A complete, validated, frozen training recipe."""

    model: ModelSection
    method: MethodSection = MethodSection()
    data: DataSection
    train: TrainSection = TrainSection()
    distributed: DistributedSection = DistributedSection()
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    output: OutputSection

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
        self._check_best()
        return self

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
        if self.eval.generate:
            from lorakit.evaluation.scoring import metric_keys

            names |= {f"eval.{key}" for name in self.eval.metrics for key in metric_keys(name)}
        return names

    def eval_active(self) -> bool:
        """Whether the run evaluates (evaluation enabled and an eval split given)."""
        return self.eval.enabled and self.data.eval_split is not None
