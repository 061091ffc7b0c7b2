"""Preparing data, one skeleton for every row layout: load the splits, key the cache, let the layout encode
and cap the rows (lorakit.data.layouts), record the statistics, cache the result.

The layout is the only variable part: SFT's examples (lorakit.data.examples), preference pairs
(lorakit.data.pairs), KTO's unpaired rows (lorakit.data.unpaired). Every step below is done here once; PreparedData is what it hands on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets

from lorakit.data import cache
from lorakit.data.chat import use_template
from lorakit.data.layouts import Layout, layout_named
from lorakit.data.rows import MAX_QUOTED, SourceRows
from lorakit.data.sources import eval_source, load_split, source_fingerprint, split_holdout
from lorakit.data.tokenize import Lengths, model_max_length
from lorakit.recipe.schema import DataSection, Recipe, data_parts


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
        targetless = self.stats.get("rows_without_loss", 0)
        if targetless:
            line += (
                f"\nwarning: {targetless} train row(s) have no target tokens (an empty target, or truncation "
                "cut all of it): they add nothing to the loss. Raise the length cap, or set data.overlong: drop"
            )
        bad = self.stats.get("bad_rows") or {}
        skipped = bad.get("skipped", 0) + bad.get("eval_skipped", 0)
        if skipped:
            counts = f"train {bad['skipped']}" + (
                f", eval {bad['eval_skipped']}" if "eval_skipped" in bad else ""
            )
            line += f"\nbad rows left out (data.on_bad_rows skip): {counts}; the first:"
            line += "".join(f"\n  {reason}" for reason in bad["first"])
        return line


def bad_rows_stats(policy: str, loaded: dict[str, SourceRows]) -> dict[str, Any]:
    """What summary.json records about bad rows: the policy, rows left out per split, the first reasons."""
    out: dict[str, Any] = {"policy": policy, "skipped": loaded["train"].skipped}
    if "eval" in loaded:
        out["eval_skipped"] = loaded["eval"].skipped
    out["first"] = [q for src in loaded.values() for q in src.quoted][:MAX_QUOTED]
    return out


def load_rows(
    data: DataSection, split_names: dict[str, str], held_out: bool, reading: dict[str, Any] | None = None
) -> dict[str, SourceRows]:
    """The checked rows of "train" (and "eval"): each its own split, or eval held out of train's.
    `reading`: load_split's columns, flags and aliases (the layout's; default: what data.format reads)."""
    reading = reading or {}
    if not held_out:
        limits = {"train": data.max_samples, "eval": data.max_eval_samples}
        return {k: load_split(data, s, limits[k], **reading) for k, s in split_names.items()}
    train, held = split_holdout(data, load_split(data, data.split, None, **reading))
    return {"train": train, "eval": held}


def cache_entry(
    recipe: Recipe, layout: Layout, tokenizer, model_config, sources
) -> tuple[str, Path, PreparedData | None]:
    """(key, path, the cached data or None) of the recipe's prepared rows; `sources` fingerprints the rows."""
    data = recipe.data
    enc_dec = bool(getattr(model_config, "is_encoder_decoder", False))
    parts = {
        "sources": sources,
        # Settings that do not change the rows stay out, so changing them reuses the cache.
        "data": data.model_dump(exclude={"cache_dir", "num_proc", "packing", "group_by_length"}),
        "tokenizer": cache.tokenizer_fingerprint(tokenizer),
        "model_max": model_max_length(tokenizer, model_config),
        "causal": not enc_dec,
        # The chat template is not part of the tokenizer fingerprint, but shapes chat rows.
        "chat_template": getattr(tokenizer, "chat_template", None) if data.format == "chat" else None,
    }
    columns = layout.columns(recipe)
    if columns is not None:
        parts["columns"] = list(columns.values())
    key = cache.fingerprint(parts | layout.key(recipe, enc_dec))
    path = cache.cache_path(data.cache_dir, key)
    hit = cache.load_cached(path)
    if hit is None:
        return key, path, None
    splits, meta = hit
    found = PreparedData(
        splits["train"], splits.get("eval"), Lengths(**meta["lengths"]), path, True, meta["stats"]
    )
    return key, path, found


def prepare_data(recipe: Recipe, tokenizer, model_config, layout: str = "examples") -> PreparedData:
    """Load, encode, cap and cache the recipe's splits in row layout `layout`, or reuse the cache from an
    earlier run."""
    rows = layout_named(layout)
    data = recipe.data
    enc_dec = bool(getattr(model_config, "is_encoder_decoder", False))
    tokenizer = use_template(tokenizer, data.chat_template)
    rows.check(recipe, enc_dec, tokenizer)
    if isinstance(data.source, list) and rows.mixes:
        return _prepare_mixture(recipe, rows, tokenizer, model_config)
    eval_split, held_out = eval_source(data) if recipe.eval_active() else (None, False)
    split_names = {"train": data.split} | ({"eval": eval_split} if eval_split else {})
    sources = {k: source_fingerprint(data, s) for k, s in split_names.items()}
    key, path, cached = cache_entry(recipe, rows, tokenizer, model_config, sources)
    if cached is not None:
        return cached
    model_max = model_max_length(tokenizer, model_config)
    reading = {"columns": rows.columns(recipe), "flags": rows.flags(recipe), "aliases": rows.aliases(recipe)}
    raw = load_rows(data, split_names, held_out, reading)
    splits, lengths, stats = rows.rows(raw, recipe, tokenizer, model_max, enc_dec)
    stats["format"] = data.format
    if eval_split:
        stats["eval_source"] = {"split": eval_split, "held_out": held_out, "rows": len(raw["eval"].rows)}
    return _finish(recipe, raw, splits, lengths, stats, path, key, model_max)


def _finish(recipe, raw, splits, lengths, stats, path, key, model_max) -> PreparedData:
    """The statistics every layout records, and the splits cached under `key`."""
    stats.update(train_rows=len(splits["train"]), eval_rows=len(splits["eval"]) if "eval" in splits else 0)
    stats["model_max_length"] = model_max
    stats["bad_rows"] = bad_rows_stats(recipe.data.on_bad_rows, raw)
    cache.save_cached(path, splits, {"lengths": vars(lengths), "stats": stats, "key": key})
    return PreparedData(splits["train"], splits.get("eval"), lengths, path, False, stats)


def _prepare_mixture(recipe: Recipe, rows: Layout, tokenizer, model_config) -> PreparedData:
    """prepare_data for a data.source list: every source loaded, drawn by weight, rendered into one dataset."""
    from lorakit.data.mixture import load_mixture, mixed_view, source_counts

    data = recipe.data
    enc_dec = bool(getattr(model_config, "is_encoder_decoder", False))
    model_max = model_max_length(tokenizer, model_config)
    with_eval = recipe.eval_active()
    sources = [
        {"train": source_fingerprint(part, part.split)}
        | ({"eval": source_fingerprint(part, eval_source(part)[0])} if with_eval and part.eval_split else {})
        for _, part, _ in data_parts(data)
    ]
    key, path, cached = cache_entry(recipe, rows, tokenizer, model_config, sources)
    if cached is not None:
        return cached
    raw, info = load_mixture(data, with_eval)
    mixed = recipe.model_copy(update={"data": mixed_view(data)})
    splits, lengths, stats = rows.rows(raw, mixed, tokenizer, model_max, enc_dec)
    train_counts, eval_counts = source_counts(splits["train"]), source_counts(splits.get("eval"))
    for name, entry in info.items():
        entry["train"] = train_counts.get(name, {"examples": 0, "tokens": 0})
        if "eval" in splits:
            entry["eval"] = eval_counts.get(name, {"examples": 0, "tokens": 0})
    stats["sources"] = info
    stats["format"] = mixed.data.format
    return _finish(recipe, raw, splits, lengths, stats, path, key, model_max)
