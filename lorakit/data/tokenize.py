"""Encoder-decoder data: templated tokenization of (input, target) rows, caps and the overlong policy."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np

from lorakit.data.caps import policy_rows, record, require_rows
from lorakit.data.rows import SourceRows
from lorakit.data.sources import SOURCE
from lorakit.data.templates import fill, fit_prompts, prompt_columns, render_prompt, rows_of, target_columns
from lorakit.errors import DataError
from lorakit.recipe.schema import DataSection

# Every tokenizer call below passes verbose=False: rows are tokenized untruncated on purpose, then capped,
# truncated or dropped by data.overlong, and the counts reported. Without it transformers logs "Token indices
# sequence length is longer than the specified maximum sequence length" for the first long row, which is
# lorakit's business, not a problem the user has to act on.

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


def token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """`tokenizer(texts)["input_ids"]` (special tokens added, nothing cut or padded). A fast tokenizer's backend
    encodes them directly once the first text, through transformers, showed the same ids: transformers' per-row
    dicts (attention masks, offsets) cost more CPU than the ids themselves on long rows."""
    first = tokenizer(texts[:1], verbose=False)["input_ids"]  # also sets the backend up as transformers does
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if len(texts) < 2 or backend is None or backend.truncation is not None or backend.padding is not None:
        return first if len(texts) < 2 else tokenizer(texts, verbose=False)["input_ids"]
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # fast: no character offsets
    ids = [e.ids for e in encode(texts)]
    return ids if ids[0] == first[0] else tokenizer(texts, verbose=False)["input_ids"]


def tokenize_rows(ds: datasets.Dataset, data: DataSection, tokenizer, num_proc: int = 1) -> datasets.Dataset:
    """Add untruncated `input_ids` (templated source) and `labels` (target) columns; keep the raw target.

    The rows were checked when loaded (lorakit.data.sources): every input and target is non-empty text.
    Batches stay Arrow tables in and out (datasets' per-value type inference is the slow part of a map)."""
    import pyarrow as pa

    prompt, target = prompt_columns(data), target_columns(data)
    fields = sorted(set(prompt.values()) | set(target.values()))
    kept = [SOURCE] if SOURCE in ds.column_names else []  # a mixture's source names stay with their rows

    def fn(batch: pa.Table) -> pa.Table:
        columns = {c: batch.column(c).to_pylist() for c in fields}
        rows = [dict(zip(fields, values, strict=True)) for values in zip(*columns.values(), strict=True)]
        texts = [fill(data.prompt_template, prompt, r) for r in rows]
        if data.target_template is None:
            targets = columns[data.target_column]
        else:
            targets = [fill(data.target_template, target, r) for r in rows]
        out = {c: batch.column(c) for c in kept}
        # The types datasets gave these columns when the map returned lists (its int32 for input_ids).
        out["input_ids"] = pa.array(token_ids(tokenizer, texts), type=pa.list_(pa.int32()))
        out["labels"] = pa.array(token_ids(tokenizer, targets), type=pa.list_(pa.int64()))
        out["reference"] = pa.array(targets, type=pa.string())
        return pa.table(out)

    tokenized = ds.with_format("arrow").map(
        fn,
        batched=True,
        remove_columns=[c for c in ds.column_names if c not in kept],
        num_proc=map_processes(num_proc),
        desc="tokenizing",
        load_from_cache_file=False,
    )
    return tokenized.with_format(None)


def _template_ends(data: DataSection, tokenizer) -> tuple[list[int], list[int]] | None:
    """(tokens before, tokens after) the field of a one-field prompt template, as tokenized alone (the
    tokenizer's BOS kept before, its EOS after); None for templates of several fields."""
    columns = prompt_columns(data)
    if len(columns) != 1:
        return None
    before, after = data.prompt_template.split("{" + next(iter(columns)) + "}", 1)
    before, after = before.replace("{{", "{").replace("}}", "}"), after.replace("{{", "{").replace("}}", "}")
    pre, suf = (tokenizer(t, verbose=False)["input_ids"] for t in (before, after))
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    pre = pre[:-1] if eos is not None and pre[-1:] == [eos] else pre
    suf = suf[1:] if bos is not None and suf[:1] == [bos] else suf
    return pre, suf


def _splice(column, over: np.ndarray, ends, cap: int):
    """((rows, their cut token lists as Arrow), rows left): over-long rows of a one-field template that
    start and end with the template's own tokens are cut to `cap` in the field's tokens, in Arrow and
    numpy (the template's text and the EOS kept, the field's first tokens as the whole text had them); the
    rest go the slow way (fit_prompts)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    empty = (np.zeros(0, dtype=np.int64), pa.array([], type=column.type))
    if ends is None or over.size == 0 or len(ends[0]) + len(ends[1]) >= cap:
        return empty, over
    pre, suf = (np.asarray(x, dtype=np.int64) for x in ends)
    done, parts = [], []
    for start in range(0, over.size, 8192):
        rows = over[start : start + 8192]
        sub = column.take(pa.array(rows))
        values = pc.list_flatten(sub).to_numpy(zero_copy_only=False)
        lens = pc.list_value_length(sub).to_numpy(zero_copy_only=False).astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        tails = starts + lens - len(suf)
        ok = np.ones(len(rows), dtype=bool)
        if len(pre):
            ok &= (values[starts[:, None] + np.arange(len(pre))] == pre).all(1)
        if len(suf):
            ok &= (values[tails[:, None] + np.arange(len(suf))] == suf).all(1)
        head = cap - len(suf)
        index = np.concatenate([starts[ok, None] + np.arange(head), tails[ok, None] + np.arange(len(suf))], 1)
        flat = pa.array(values[index].reshape(-1), type=column.type.value_type)
        parts.append(
            pa.ListArray.from_arrays(pa.array(np.arange(0, flat.__len__() + 1, cap, dtype=np.int32)), flat)
        )
        done.append(rows[ok])
    cut = np.concatenate(done)
    left = np.setdiff1d(over, cut, assume_unique=True)
    return (cut, pa.concat_arrays(parts).cast(column.type)), left


def _replaced(column, at: np.ndarray, values):
    """An Arrow list column with the rows at `at` replaced by `values` (a list of lists or an Arrow array;
    the other rows never leave Arrow)."""
    import pyarrow as pa

    n = len(column)
    keep = np.setdiff1d(np.arange(n), at, assume_unique=True)
    values = values if isinstance(values, pa.Array) else pa.array(values, type=column.type)
    joined = pa.concat_arrays([column.take(keep), values])
    order = np.empty(n, dtype=np.int64)
    order[keep], order[at] = np.arange(len(keep)), len(keep) + np.arange(len(at))
    return joined.take(order)


def truncate_rows(
    ds: datasets.Dataset, data: DataSection, tokenizer, lengths: Lengths, raw: datasets.Dataset
) -> datasets.Dataset:
    """Cut sources and targets to the resolved caps, keeping the template and the final EOS intact.

    Only the rows over a cap are touched, column-wise in Arrow; an over-long source is rendered again from
    its columns in `raw` (the loaded rows, row for row with `ds`: over-long rows are only kept, not dropped,
    under data.overlong truncate)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    eos = tokenizer.eos_token_id
    empty = {c: "" for c in prompt_columns(data).values()}
    overhead = len(tokenizer(render_prompt(data, empty))["input_ids"])
    budget = lengths.max_source_length - overhead
    if budget < 1:
        raise DataError(
            f"data.max_source_length={lengths.max_source_length} leaves no room for the input: the prompt "
            f"template alone is {overhead} tokens"
        )

    def cut(ids: list[int], cap: int) -> list[int]:
        if len(ids) <= cap:
            return ids
        return ids[: cap - 1] + [eos] if eos is not None and ids[-1] == eos else ids[:cap]

    table = ds.with_format("arrow")[:]
    columns = {name: table[name].combine_chunks() for name in table.column_names}
    counts = token_counts(ds, "input_ids")
    over = np.flatnonzero(counts > lengths.max_source_length)
    ends = _template_ends(data, tokenizer)
    spliced, over = _splice(columns["input_ids"], over, ends, lengths.max_source_length)
    new: list[list[int]] = []
    if over.size:
        assert len(raw) == len(ds), "over-long sources are truncated only when no row was dropped"
        fields = sorted(set(prompt_columns(data).values()))
        for start in range(0, over.size, 1000):
            # Cut the columns' text, not the templated sequence, so a suffix like "Summary:" survives.
            part = over[start : start + 1000]
            rows = rows_of(raw.select(part).select_columns(fields).to_dict())
            # Characters per token of each row, so its fields' heads are tokenized in one pass.
            ratios = [
                sum(len(str(r[c])) for c in fields) / int(n) for r, n in zip(rows, counts[part], strict=True)
            ]
            texts = fit_prompts(data, rows, tokenizer, budget, ratios)
            new += [cut(x, lengths.max_source_length) for x in tokenizer(texts, verbose=False)["input_ids"]]
    if spliced[0].size or over.size:
        at = np.concatenate([spliced[0], over])
        values = pa.concat_arrays([spliced[1], pa.array(new, type=columns["input_ids"].type)])
        columns["input_ids"] = _replaced(columns["input_ids"], at, values)
    over = np.flatnonzero(token_counts(ds, "labels") > lengths.max_target_length)
    if over.size:
        targets = columns["labels"].take(over).to_pylist()
        columns["labels"] = _replaced(
            columns["labels"], over, [cut(t, lengths.max_target_length) for t in targets]
        )
    length = pc.add(pc.list_value_length(columns["input_ids"]), pc.list_value_length(columns["labels"]))
    columns["length"] = length.cast(pa.int64())
    return datasets.Dataset(pa.table(columns))


def apply_overlong(
    ds: datasets.Dataset, policy: str, lengths: Lengths, where: Callable[[int], str]
) -> tuple[datasets.Dataset, int, int]:
    """Rows whose source or target is over its cap: kept for truncate_rows (truncate), removed (drop), or
    a DataError naming the first by file and line (error). Returns (rows, truncated count, dropped count)."""
    src, tgt = token_counts(ds, "input_ids"), token_counts(ds, "labels")
    return policy_rows(
        ds,
        policy,
        (src > lengths.max_source_length) | (tgt > lengths.max_target_length),
        lambda i, n: (
            f"data.overlong is error: {where(i)} has a {int(src[i])}-token source "
            f"(data.max_source_length={lengths.max_source_length}) and a {int(tgt[i])}-token target "
            f"(data.max_target_length={lengths.max_target_length}); {n} row(s) are over a cap. Raise "
            "data.max_source_length / data.max_target_length, or set data.overlong: truncate or drop"
        ),
    )


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
        record(overlong, k, truncated, dropped)
        require_rows(
            len(kept),
            f"data.overlong is drop: every row of {raw[k].where.origin} is over data.max_source_length="
            f"{lengths.max_source_length} or data.max_target_length={lengths.max_target_length}, so "
            "none is left; raise them or set data.overlong: truncate",
        )
        splits[k] = truncate_rows(kept, data, tokenizer, lengths, raw[k].rows)
    cut = data.overlong == "truncate"
    stats = {
        "source_tokens_untruncated": {"mean": float(src_len.mean()), "max": int(src_len.max())},
        "target_tokens_untruncated": {"mean": float(tgt_len.mean()), "max": int(tgt_len.max())},
        # Train rows actually cut (none when over-long rows are dropped).
        "truncated_sources": int((src_len > lengths.max_source_length).sum()) if cut else 0,
        "truncated_targets": int((tgt_len > lengths.max_target_length).sum()) if cut else 0,
        "overlong": overlong,
    }
    return splits, lengths, stats
