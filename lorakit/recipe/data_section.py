"""The recipe's data section: one source or a mixture of them (SourceSpec), templates, lengths, packing."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lorakit.recipe.section import Section, check_templates


class SourceSpec(Section):
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
    message_keys: dict[str, str] | None = None
    roles: dict[str, str] | None = None
    data_files: str | list[str] | None = None
    revision: str | None = None
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
        check_templates("data.source[]", self.prompt_template, self.target_template)
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
    "message_keys",
    "roles",
    "data_files",
    "revision",
    "prompt_template",
    "target_template",
    "label_names",
)


class DataSection(Section):
    """Where examples come from and how they become tokens."""

    source: str | list[SourceSpec] = Field(
        description="Hub dataset id (loaded with datasets.load_dataset), a local .json/.jsonl/.csv/.parquet "
        "file, a local directory holding {split}.{ext} files, or `builtin:NAME` for a dataset shipped "
        "with lorakit (builtin:news_summaries). Or a mixture: a list of {source, name, config, split, "
        "eval_split, weight | max_samples, columns and templates} whose training rows are drawn by weight "
        "(with data.split_seed); every example keeps its source's name (docs/data.md#dataset-mixtures)."
    )
    config: str | None = Field(None, description="Hub dataset configuration name, e.g. `3.0.0`.")
    revision: str | None = Field(
        None,
        description="Hub datasets: the branch, tag or commit to read (default: the main branch). The commit "
        "it resolves to is part of the token cache key, so an updated dataset is prepared again.",
    )
    data_files: str | list[str] | dict[str, str | list[str]] | None = Field(
        None,
        description="Files to read instead of data.source's own layout: a path or glob, a list of them (the "
        "`train` split), or {split: path, glob or list}; .jsonl/.json/.csv/.parquet. data.source is then "
        "only the name, or the directory the paths are relative to.",
    )
    transform: str | None = Field(
        None,
        description="`package.module:function`, called on every row (a dict of columns) before it is checked "
        "and tokenized; it returns the row to use, or None to leave the row out. Runs in prepare; its "
        "source text is part of the token cache key.",
    )
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
    format: Literal["instruction", "completion", "chat", "alpaca"] = Field(
        "instruction",
        description="instruction: (input, target) text pairs, the input put through prompt_template (the "
        "only format for encoder-decoder models); completion: one text column, every token trained "
        "(causal LMs); chat: a column of messages [{role, content}, ...] rendered with the tokenizer's chat "
        "template, loss on the assistant turns (causal LMs); alpaca: columns instruction, input (optional) and "
        "output, put through the two standard Alpaca prompts (with and without input).",
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
    messages_column: str = Field(
        "messages",
        description="chat: column with the list of messages; with the default, a source without a "
        "`messages` column is read from ShareGPT's `conversations`.",
    )
    message_keys: dict[str, str] | None = Field(
        None,
        description="chat: the keys of a message, {role: KEY, content: KEY}; default: role/content, or "
        "ShareGPT's from/value, per message.",
    )
    roles: dict[str, str] = Field(
        {},
        description="chat: source role -> chat role, over the defaults (human/user -> user, gpt/assistant/"
        "bot/model -> assistant, system, tool/observation -> tool).",
    )
    chat_template: str | None = Field(
        None,
        description="chat: a Jinja chat template (the text, or a path to a file holding it) that supplies "
        "or replaces the tokenizer's.",
    )
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
        check_templates("data", self.prompt_template, self.target_template)
        if isinstance(self.source, list):
            if not self.source:
                raise ValueError("data.source: an empty list; give one source or a list of several")
            names = [spec.display_name() for spec in self.source]
            if len(set(names)) != len(names):
                raise ValueError(f"data.source: two sources share a name ({names}); give each a `name`")
        if self.transform is not None and not _is_import_path(self.transform):
            raise ValueError(f"data.transform: {self.transform!r} is not `package.module:function`")
        if self.message_keys is not None and set(self.message_keys) != {"role", "content"}:
            raise ValueError(
                "data.message_keys: give exactly the keys role and content, e.g. {role: from, content: value}"
            )
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


def _is_import_path(value: str) -> bool:
    module, _, name = value.partition(":")
    return bool(name) and name.isidentifier() and all(p.isidentifier() for p in module.split("."))


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
