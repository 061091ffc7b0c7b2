"""Source -> template -> tokenize -> cap -> cache: the whole data step, runnable without a GPU.

Encoder-decoder rows (lorakit.data.tokenize) hold `input_ids` (templated source), `labels` (target),
`length` and `reference`; causal-LM rows (lorakit.data.causal) hold `input_ids`, `labels` (unshifted, -100
where no loss is taken), `length`, `prompt_ids` and `reference`.
"""

from __future__ import annotations

from pathlib import Path

from lorakit.data import cache
from lorakit.data.causal import prepare_causal
from lorakit.data.chat import use_template
from lorakit.data.prepared import PreparedData, bad_rows_stats
from lorakit.data.rows import ALPACA_PROMPT, ALPACA_TARGET, SourceRows
from lorakit.data.sources import eval_source, load_split, source_fingerprint, split_holdout
from lorakit.data.tokenize import Lengths, model_max_length, prepare_seq2seq
from lorakit.errors import DataError
from lorakit.recipe.schema import DataSection, Recipe, data_parts


def as_instruction(data: DataSection) -> DataSection:
    """The data section tokenizers read for data.format alpaca: instruction rows of one rendered prompt
    column and one target column (lorakit.data.rows turns every Alpaca row into them)."""
    if data.format != "alpaca":
        return data
    update = {"format": "instruction", "input_column": ALPACA_PROMPT, "prompt_template": "{input}"}
    return data.model_copy(update={**update, "target_column": ALPACA_TARGET, "target_template": None})


def load_rows(data: DataSection, split_names: dict[str, str], held_out: bool) -> dict[str, SourceRows]:
    """The checked rows of "train" (and "eval"): each its own split, or eval held out of train's."""
    if not held_out:
        limits = {"train": data.max_samples, "eval": data.max_eval_samples}
        return {k: load_split(data, s, limits[k]) for k, s in split_names.items()}
    train, held = split_holdout(data, load_split(data, data.split))
    return {"train": train, "eval": held}


def check_supported(recipe: Recipe, is_encoder_decoder: bool) -> None:
    """Reject data settings this model family cannot use (yet), naming the field."""
    if not is_encoder_decoder:
        return
    if recipe.data.format not in ("instruction", "alpaca"):
        raise DataError(
            f"data.format {recipe.data.format}: encoder-decoder models (T5 family) take (input, target) "
            "pairs; set data.format: instruction with data.input_column and data.target_column"
        )


def _cache_entry(recipe: Recipe, tokenizer, model_config, sources) -> tuple[str, Path, PreparedData | None]:
    """(key, path, the cached data or None) of the recipe's tokenized data; `sources` fingerprints the rows."""
    data = recipe.data
    enc_dec = bool(getattr(model_config, "is_encoder_decoder", False))
    key = cache.fingerprint(
        {
            "sources": sources,
            # Settings that do not change the rows stay out, so changing them reuses the cache.
            "data": data.model_dump(exclude={"cache_dir", "num_proc", "packing", "group_by_length"}),
            "tokenizer": cache.tokenizer_fingerprint(tokenizer),
            "model_max": model_max_length(tokenizer, model_config),
            "causal": not enc_dec,
            # Packing lowers the causal cap to train.max_tokens when that is smaller.
            "packing_max_tokens": recipe.train.max_tokens if data.packing and not enc_dec else None,
            # The chat template is not part of the tokenizer fingerprint, but shapes chat rows.
            "chat_template": getattr(tokenizer, "chat_template", None) if data.format == "chat" else None,
        }
    )
    path = cache.cache_path(data.cache_dir, key)
    hit = cache.load_cached(path)
    if hit is None:
        return key, path, None
    splits, meta = hit
    found = PreparedData(
        splits["train"], splits.get("eval"), Lengths(**meta["lengths"]), path, True, meta["stats"]
    )
    return key, path, found


def prepare_data(recipe: Recipe, tokenizer, model_config) -> PreparedData:
    """Load, tokenize and cache the recipe's splits, or reuse the cache from an earlier run."""
    data = recipe.data
    enc_dec = bool(getattr(model_config, "is_encoder_decoder", False))
    check_supported(recipe, enc_dec)
    tokenizer = use_template(tokenizer, data.chat_template)
    if isinstance(data.source, list):
        return _prepare_mixture(recipe, tokenizer, model_config)
    eval_split, held_out = eval_source(data) if recipe.eval_active() else (None, False)
    split_names = {"train": data.split} | ({"eval": eval_split} if eval_split else {})
    sources = {k: source_fingerprint(data, s) for k, s in split_names.items()}
    key, path, cached = _cache_entry(recipe, tokenizer, model_config, sources)
    if cached is not None:
        return cached
    model_max = model_max_length(tokenizer, model_config)

    raw = load_rows(data, split_names, held_out)
    view = as_instruction(data)
    if enc_dec:
        splits, lengths, stats = prepare_seq2seq(raw, view, tokenizer, model_max)
    else:
        splits, lengths, stats = prepare_causal(
            raw, recipe.model_copy(update={"data": view}), tokenizer, model_max
        )
    stats["format"] = data.format
    stats["bad_rows"] = bad_rows_stats(data.on_bad_rows, raw)
    if eval_split:
        stats["eval_source"] = {"split": eval_split, "held_out": held_out, "rows": len(raw["eval"].rows)}
    labels = raw["train"].labels
    if labels is not None:
        stats["labels"] = labels
    cache.save_cached(path, splits, {"lengths": vars(lengths), "stats": stats, "key": key})
    return PreparedData(splits["train"], splits.get("eval"), lengths, path, False, stats)


def _prepare_mixture(recipe: Recipe, tokenizer, model_config) -> PreparedData:
    """prepare_data for a data.source list: every source loaded, drawn by weight, rendered into one dataset."""
    from lorakit.data.mixture import load_mixture, mixed_view, source_counts

    data = recipe.data
    enc_dec = bool(getattr(model_config, "is_encoder_decoder", False))
    model_max = model_max_length(tokenizer, model_config)
    parts = data_parts(data)
    with_eval = recipe.eval_active()
    sources = [
        {"train": source_fingerprint(part, part.split)}
        | ({"eval": source_fingerprint(part, eval_source(part)[0])} if with_eval and part.eval_split else {})
        for _, part, _ in parts
    ]
    key, path, cached = _cache_entry(recipe, tokenizer, model_config, sources)
    if cached is not None:
        return cached
    raw, info = load_mixture(data, with_eval)
    view = mixed_view(data)
    mixed = recipe.model_copy(update={"data": view})
    if enc_dec:
        splits, lengths, stats = prepare_seq2seq(raw, view, tokenizer, model_max)
    else:
        splits, lengths, stats = prepare_causal(raw, mixed, tokenizer, model_max)
    stats["bad_rows"] = bad_rows_stats(data.on_bad_rows, raw)
    train_counts, eval_counts = source_counts(splits["train"]), source_counts(splits.get("eval"))
    for name, entry in info.items():
        entry["train"] = train_counts.get(name, {"examples": 0, "tokens": 0})
        if "eval" in splits:
            entry["eval"] = eval_counts.get(name, {"examples": 0, "tokens": 0})
    stats["sources"] = info
    if raw["train"].labels is not None:
        stats["labels"] = raw["train"].labels
    cache.save_cached(path, splits, {"lengths": vars(lengths), "stats": stats, "key": key})
    return PreparedData(splits["train"], splits.get("eval"), lengths, path, False, stats)
