"""Source -> template -> tokenize -> truncate -> cache: the whole data step, runnable without a GPU."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from lorakit.data import cache
from lorakit.data.sources import load_split, source_fingerprint
from lorakit.data.tokenize import Lengths, model_max_length, resolve_lengths, tokenize_rows, truncate_rows
from lorakit.errors import DataError
from lorakit.recipe.schema import Recipe


@dataclass
class PreparedData:
    """Tokenized train (and eval) splits with the caps they were cut to."""

    train: datasets.Dataset
    eval: datasets.Dataset | None
    lengths: Lengths
    path: Path
    cache_hit: bool
    stats: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for the terminal: what was prepared and where it is cached."""
        state = "reused cached" if self.cache_hit else "tokenized and cached"
        n_eval = len(self.eval) if self.eval is not None else 0
        return (
            f"data: {state} {len(self.train)} train / {n_eval} eval rows at {self.path} "
            f"(max_source_length={self.lengths.max_source_length}, "
            f"max_target_length={self.lengths.max_target_length})"
        )


def _select(ds: datasets.Dataset, limit: int | None) -> datasets.Dataset:
    return ds.select(range(min(limit, len(ds)))) if limit else ds


def check_supported(recipe: Recipe, is_encoder_decoder: bool) -> None:
    """Reject data settings this model family cannot use yet, naming the field."""
    if not is_encoder_decoder:
        raise DataError(
            "model.name_or_path is a causal LM: lorakit prepares (input, target) data for encoder-decoder "
            "models (T5 family) only; causal-LM data templates are not available in this version"
        )
    if recipe.data.packing:
        raise DataError(
            "data.packing: packing is not available for encoder-decoder models in this version; set "
            "data.packing: false (batches are grouped by length, so padding stays small)"
        )


def prepare_data(recipe: Recipe, tokenizer, model_config) -> PreparedData:
    """Load, tokenize and cache the recipe's splits, or reuse the cache from an earlier run."""
    data = recipe.data
    check_supported(recipe, bool(getattr(model_config, "is_encoder_decoder", False)))
    eval_split = data.eval_split if recipe.eval_active() else None
    split_names = {"train": data.split} | ({"eval": eval_split} if eval_split else {})
    model_max = model_max_length(tokenizer, model_config)
    key = cache.fingerprint(
        {
            "sources": {k: source_fingerprint(data, s) for k, s in split_names.items()},
            "data": data.model_dump(exclude={"cache_dir", "num_proc", "packing"}),
            "tokenizer": cache.tokenizer_fingerprint(tokenizer),
            "model_max": model_max,
        }
    )
    path = cache.cache_path(data.cache_dir, key)
    hit = cache.load_cached(path)
    if hit is not None:
        splits, meta = hit
        return PreparedData(
            splits["train"], splits.get("eval"), Lengths(**meta["lengths"]), path, True, meta["stats"]
        )

    raw = {k: load_split(data, s) for k, s in split_names.items()}
    raw["train"] = _select(raw["train"], data.max_samples)
    if "eval" in raw:
        raw["eval"] = _select(raw["eval"], data.max_eval_samples)
    tokenized = {k: tokenize_rows(ds, data, tokenizer, data.num_proc) for k, ds in raw.items()}
    train_tok = tokenized["train"]
    src_len = np.fromiter((len(x) for x in train_tok["input_ids"]), dtype=np.int64)
    tgt_len = np.fromiter((len(x) for x in train_tok["labels"]), dtype=np.int64)
    lengths = resolve_lengths(data, src_len, tgt_len, model_max)
    splits = {k: truncate_rows(ds, data, tokenizer, lengths) for k, ds in tokenized.items()}
    stats = {
        "train_rows": len(splits["train"]),
        "eval_rows": len(splits["eval"]) if "eval" in splits else 0,
        "source_tokens_untruncated": {"mean": float(src_len.mean()), "max": int(src_len.max())},
        "target_tokens_untruncated": {"mean": float(tgt_len.mean()), "max": int(tgt_len.max())},
        "truncated_sources": int((src_len > lengths.max_source_length).sum()),
        "truncated_targets": int((tgt_len > lengths.max_target_length).sum()),
        "model_max_length": model_max,
    }
    cache.save_cached(path, splits, {"lengths": vars(lengths), "stats": stats, "key": key})
    return PreparedData(splits["train"], splits.get("eval"), lengths, path, False, stats)
