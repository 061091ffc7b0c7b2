"""Encoder-decoder data: templated tokenization of (input, target) rows, caps and the overlong policy."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np

from lorakit.data.rows import SourceRows
from lorakit.data.sources import OVERLONG_DOC, SOURCE
from lorakit.data.templates import fit_prompt, prompt_columns, render_prompt, render_target, rows_of
from lorakit.errors import DataError
from lorakit.recipe.schema import DataSection

# Every tokenizer call below passes verbose=False: rows are tokenized untruncated on purpose, then capped,
# truncated or dropped by data.overlong, and the counts reported. Without it transformers logs "Token indices
# sequence length is longer than the specified maximum sequence length" for the first long row, which is
# lorakit's business, not a problem the user has to act on.

# Prefix of the columns that carry a prompt's fields from tokenizing to truncation.
_FIELD = "_in:"
# Tokenizers report "no limit" as a huge sentinel (int(1e30)); anything above this is not a real cap.
_NO_LIMIT = 1_000_000


def map_processes(num_proc: int) -> int | None:
    """datasets.map's num_proc for data.num_proc: None (this process) for 1. datasets 5 runs num_proc=1 in a
    pool of one worker, which pickles the tokenizer and every batch across to it and back."""
    return num_proc if num_proc > 1 else None


def token_counts(ds: datasets.Dataset, column: str) -> np.ndarray:
    """The length of every row's list in `column`, read from Arrow's offsets: no row becomes a Python list."""
    import pyarrow.compute as pc

    if not isinstance(ds, datasets.Dataset):  # plain columns (a dict of lists)
        return np.fromiter((len(x) for x in ds[column]), dtype=np.int64)
    lengths = pc.list_value_length(ds.with_format("arrow")[column])
    return lengths.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def model_max_length(tokenizer, model_config) -> int | None:
    """The longest sequence the model was trained for, from its tokenizer and config (None: unknown)."""
    candidates = [getattr(tokenizer, "model_max_length", None)]
    for key in ("max_position_embeddings", "n_positions"):
        candidates.append(getattr(model_config, key, None))
    real = [int(c) for c in candidates if isinstance(c, int | float) and 0 < c < _NO_LIMIT]
    return min(real) if real else None


@dataclass(frozen=True)
class Lengths:
    """Resolved token caps for one prepared dataset: source and target caps for an encoder-decoder (then
    max_length is None), or the whole-sequence cap for a causal LM (then the other two are None)."""

    max_source_length: int | None = None
    max_target_length: int | None = None
    max_length: int | None = None


def resolve_lengths(
    data: DataSection, source_lengths: np.ndarray, target_lengths: np.ndarray, model_max: int | None
) -> Lengths:
    """Turn `auto` caps into numbers: longest source (capped at the model max); for targets the p95 when
    over-long rows are truncated, else (drop, error) the longest target, capped at the model max."""
    src = longest(source_lengths, model_max) if data.max_source_length == "auto" else data.max_source_length
    if data.max_target_length == "auto" and data.overlong == "truncate":
        # ceil so that at least 95% of targets fit whole.
        tgt = int(math.ceil(np.percentile(target_lengths, 95)))
    elif data.max_target_length == "auto":
        # A p95 cap would drop, or stop on, the 5% longest targets: auto means "fit the data" here.
        tgt = longest(target_lengths, model_max)
    else:
        tgt = data.max_target_length
    return Lengths(max(src, 2), max(tgt, 2))


def longest(lengths: np.ndarray, model_max: int | None) -> int:
    """The longest of `lengths`, capped at the model's maximum where it has one: what an `auto` cap fits."""
    top = int(lengths.max())
    return top if model_max is None else min(top, model_max)


def tokenize_rows(ds: datasets.Dataset, data: DataSection, tokenizer, num_proc: int = 1) -> datasets.Dataset:
    """Add untruncated `input_ids` (templated source) and `labels` (target) columns; keep the raw target.

    The rows were checked when loaded (lorakit.data.sources): every input and target is non-empty text."""

    fields = sorted(set(prompt_columns(data).values()))

    def fn(batch):
        rows = rows_of(batch)
        texts = [render_prompt(data, r) for r in rows]
        targets = [render_target(data, r) for r in rows]
        return {
            "input_ids": tokenizer(texts, verbose=False)["input_ids"],
            "labels": tokenizer(targets, verbose=False)["input_ids"],
            "reference": targets,
            # The prompt's columns, kept until truncation, which re-renders the rare over-long inputs from
            # their text (prefixed: a dataset column may be called `labels`).
            **{_FIELD + c: batch[c] for c in fields},
        }

    return ds.map(
        fn,
        batched=True,
        # A mixture's source names stay with their rows.
        remove_columns=[c for c in ds.column_names if c != SOURCE],
        num_proc=map_processes(num_proc),
        desc="tokenizing",
        load_from_cache_file=False,
    )


def truncate_rows(ds: datasets.Dataset, data: DataSection, tokenizer, lengths: Lengths) -> datasets.Dataset:
    """Cut sources and targets to the resolved caps, keeping the template and the final EOS intact."""
    eos = tokenizer.eos_token_id
    empty = {c: "" for c in prompt_columns(data).values()}
    overhead = len(tokenizer(render_prompt(data, empty))["input_ids"])
    budget = lengths.max_source_length - overhead
    kept_fields = [c for c in ds.column_names if c.startswith(_FIELD)]
    if budget < 1:
        raise DataError(
            f"data.max_source_length={lengths.max_source_length} leaves no room for the input: the prompt "
            f"template alone is {overhead} tokens"
        )

    def cut(ids: list[int], cap: int) -> list[int]:
        if len(ids) <= cap:
            return ids
        return ids[: cap - 1] + [eos] if eos is not None and ids[-1] == eos else ids[:cap]

    def fn(batch):
        sources = []
        for i, ids in enumerate(batch["input_ids"]):
            if len(ids) > lengths.max_source_length:
                # Cut the columns' text, not the templated sequence, so a suffix like "Summary:" survives.
                row = {c.removeprefix(_FIELD): batch[c][i] for c in kept_fields}
                text = fit_prompt(data, row, tokenizer, budget)
                ids = cut(tokenizer(text, verbose=False)["input_ids"], lengths.max_source_length)
            sources.append(ids)
        labels = [cut(t, lengths.max_target_length) for t in batch["labels"]]
        length = [len(s) + len(t) for s, t in zip(sources, labels, strict=True)]
        return {"input_ids": sources, "labels": labels, "length": length}

    return ds.map(fn, batched=True, remove_columns=kept_fields, desc="truncating", load_from_cache_file=False)


def apply_overlong(
    ds: datasets.Dataset, policy: str, lengths: Lengths, where: Callable[[int], str]
) -> tuple[datasets.Dataset, int, int]:
    """Rows whose source or target is over its cap: kept for truncate_rows (truncate), removed (drop), or
    a DataError naming the first by file and line (error). Returns (rows, truncated count, dropped count)."""
    src, tgt = token_counts(ds, "input_ids"), token_counts(ds, "labels")
    over = (src > lengths.max_source_length) | (tgt > lengths.max_target_length)
    n_over = int(over.sum())
    if n_over == 0:
        return ds, 0, 0
    if policy == "error":
        i = int(np.flatnonzero(over)[0])
        raise DataError(
            f"data.overlong is error: {where(i)} has a {int(src[i])}-token source "
            f"(data.max_source_length={lengths.max_source_length}) and a {int(tgt[i])}-token target "
            f"(data.max_target_length={lengths.max_target_length}); {n_over} row(s) are over a cap. Raise "
            "data.max_source_length / data.max_target_length, or set data.overlong: truncate or drop",
            doc=OVERLONG_DOC,
        )
    if policy == "drop":
        return ds.select(np.flatnonzero(~over)), 0, n_over
    return ds, n_over, 0


def prepare_seq2seq(
    raw: dict[str, SourceRows], data: DataSection, tokenizer, model_max: int | None
) -> tuple[dict[str, datasets.Dataset], Lengths, dict[str, Any]]:
    """Tokenize, cap and count encoder-decoder splits ("train" and maybe "eval"): (splits, lengths, stats)."""
    tokenized = {k: tokenize_rows(src.rows, data, tokenizer, data.num_proc) for k, src in raw.items()}
    train_tok = tokenized["train"]
    src_len, tgt_len = token_counts(train_tok, "input_ids"), token_counts(train_tok, "labels")
    lengths = resolve_lengths(data, src_len, tgt_len, model_max)
    overlong: dict[str, Any] = {"policy": data.overlong}
    splits = {}
    for k, ds in tokenized.items():
        kept, truncated, dropped = apply_overlong(ds, data.overlong, lengths, raw[k].where)
        prefix = "" if k == "train" else f"{k}_"
        overlong[f"{prefix}truncated"], overlong[f"{prefix}dropped"] = truncated, dropped
        if len(kept) == 0:
            raise DataError(
                f"data.overlong is drop: every row of {raw[k].where.origin} is over data.max_source_length="
                f"{lengths.max_source_length} or data.max_target_length={lengths.max_target_length}, so "
                "none is left; raise them or set data.overlong: truncate",
                doc=OVERLONG_DOC,
            )
        splits[k] = truncate_rows(kept, data, tokenizer, lengths)
    cut = data.overlong == "truncate"
    stats = {
        "format": data.format,
        "train_rows": len(splits["train"]),
        "eval_rows": len(splits["eval"]) if "eval" in splits else 0,
        "source_tokens_untruncated": {"mean": float(src_len.mean()), "max": int(src_len.max())},
        "target_tokens_untruncated": {"mean": float(tgt_len.mean()), "max": int(tgt_len.max())},
        # Train rows actually cut (none when over-long rows are dropped).
        "truncated_sources": int((src_len > lengths.max_source_length).sum()) if cut else 0,
        "truncated_targets": int((tgt_len > lengths.max_target_length).sum()) if cut else 0,
        "overlong": overlong,
        "model_max_length": model_max,
    }
    return splits, lengths, stats
