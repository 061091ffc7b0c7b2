"""Source -> template -> tokenize -> cap -> cache: the whole data step, runnable without a GPU.

Encoder-decoder rows (lorakit.data.tokenize) hold `input_ids` (templated source), `labels` (target),
`length` and `reference`; causal-LM rows (lorakit.data.causal) hold `input_ids`, `labels` (unshifted, -100
where no loss is taken), `length`, `prompt_ids` and `reference`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets

from lorakit.data import cache
from lorakit.data.causal import prepare_causal, required_columns
from lorakit.data.sources import load_split, source_fingerprint
from lorakit.data.tokenize import Lengths, model_max_length, prepare_seq2seq
from lorakit.errors import DataError
from lorakit.recipe.schema import DataSection, Recipe


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
        """One line for the terminal: what was prepared, what the caps did to it, and where it is cached."""
        state = "reused cached" if self.cache_hit else "tokenized and cached"
        n_eval = len(self.eval) if self.eval is not None else 0
        if self.lengths.max_length is not None:
            caps = f"format={self.stats.get('format', '?')}, max_length={self.lengths.max_length}"
        else:
            caps = (
                f"max_source_length={self.lengths.max_source_length}, "
                f"max_target_length={self.lengths.max_target_length}"
            )
        line = f"data: {state} {len(self.train)} train / {n_eval} eval rows at {self.path} ({caps})"
        over = self.stats.get("overlong")
        if over:
            line += (
                f"; over-long examples ({over['policy']}): train {over['truncated']} truncated, "
                f"{over['dropped']} dropped"
            )
            if "eval_truncated" in over:
                line += f"; eval {over['eval_truncated']} truncated, {over['eval_dropped']} dropped"
        return line


def _select(ds: datasets.Dataset, limit: int | None) -> datasets.Dataset:
    return ds.select(range(min(limit, len(ds)))) if limit else ds


def check_supported(recipe: Recipe, is_encoder_decoder: bool) -> None:
    """Reject data settings this model family cannot use (yet), naming the field."""
    if not is_encoder_decoder:
        return
    if recipe.data.format != "instruction":
        raise DataError(
            f"data.format {recipe.data.format}: encoder-decoder models (T5 family) take (input, target) "
            "pairs; set data.format: instruction with data.input_column and data.target_column"
        )


def _load(data: DataSection, split: str) -> datasets.Dataset:
    """load_split, checking the columns data.format reads (not input/target for completion and chat)."""
    columns = required_columns(data)
    if data.format == "instruction":
        return load_split(data, split)
    # load_split checks data.input_column and data.target_column: point both at the one column this
    # format reads, and name the real field in its error.
    ((field_name, column),) = columns.items()
    try:
        return load_split(data.model_copy(update={"input_column": column, "target_column": column}), split)
    except DataError as e:
        message = str(e)
        for checked in ("data.input_column: ", "data.target_column: "):
            if message.startswith(checked):
                raise DataError(f"{field_name}: {message.removeprefix(checked)}") from None
        raise


def prepare_data(recipe: Recipe, tokenizer, model_config) -> PreparedData:
    """Load, tokenize and cache the recipe's splits, or reuse the cache from an earlier run."""
    data = recipe.data
    enc_dec = bool(getattr(model_config, "is_encoder_decoder", False))
    check_supported(recipe, enc_dec)
    eval_split = data.eval_split if recipe.eval_active() else None
    split_names = {"train": data.split} | ({"eval": eval_split} if eval_split else {})
    model_max = model_max_length(tokenizer, model_config)
    key = cache.fingerprint(
        {
            "sources": {k: source_fingerprint(data, s) for k, s in split_names.items()},
            # Settings that do not change the rows stay out, so changing them reuses the cache.
            "data": data.model_dump(exclude={"cache_dir", "num_proc", "packing", "group_by_length"}),
            "tokenizer": cache.tokenizer_fingerprint(tokenizer),
            "model_max": model_max,
            "causal": not enc_dec,
            # Packing lowers the causal cap to train.max_tokens when that is smaller.
            "packing_max_tokens": recipe.train.max_tokens if data.packing and not enc_dec else None,
            # The chat template is not part of the tokenizer fingerprint, but shapes chat rows.
            "chat_template": getattr(tokenizer, "chat_template", None) if data.format == "chat" else None,
        }
    )
    path = cache.cache_path(data.cache_dir, key)
    hit = cache.load_cached(path)
    if hit is not None:
        splits, meta = hit
        return PreparedData(
            splits["train"], splits.get("eval"), Lengths(**meta["lengths"]), path, True, meta["stats"]
        )

    raw = {k: _load(data, s) for k, s in split_names.items()}
    raw["train"] = _select(raw["train"], data.max_samples)
    if "eval" in raw:
        raw["eval"] = _select(raw["eval"], data.max_eval_samples)
    if enc_dec:
        splits, lengths, stats = prepare_seq2seq(raw, data, tokenizer, model_max, split_names)
    else:
        splits, lengths, stats = prepare_causal(raw, recipe, tokenizer, model_max, split_names)
    cache.save_cached(path, splits, {"lengths": vars(lengths), "stats": stats, "key": key})
    return PreparedData(splits["train"], splits.get("eval"), lengths, path, False, stats)
