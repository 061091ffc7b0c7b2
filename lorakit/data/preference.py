"""Preference pairs for train.objective dpo: (prompt, chosen, rejected) rows -> token ids, capped and cached.

The prompt is what SFT would give the model: data.prompt_template over its columns (data.format
instruction), or the messages of data.messages_column rendered with the tokenizer's chat template and its
generation prompt (chat, causal LMs); so `lorakit.generate` prompts a DPO run exactly as it was trained.
The responses come from dpo.chosen_column and dpo.rejected_column. Rows are read and checked by
lorakit.data.sources (data.on_bad_rows), as SFT rows are.

Causal rows hold `prompt_ids`, `chosen_ids` and `rejected_ids` (responses end with EOS), `length` (the
tokens of the pair's two sequences, prompt + chosen and prompt + rejected, which a packed row holds) and
`reference` (the chosen text). Encoder-decoder rows hold `input_ids` (the source, encoded once per pair),
`chosen_ids`, `rejected_ids`, `length` (source + both targets) and `reference`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import datasets

from lorakit.data import cache
from lorakit.data.causal import check_tokenizer, encode_prompts
from lorakit.data.chat import IGNORE_INDEX, ChatTurns, TemplateFailed, read_messages, use_template
from lorakit.data.prepared import PreparedData, bad_rows_stats
from lorakit.data.rows import MAX_QUOTED, SourceRows, required_columns
from lorakit.data.sources import OVERLONG_DOC, eval_source, load_split, source_fingerprint, split_holdout
from lorakit.data.templates import prompt_columns, render_prompt, rows_of
from lorakit.data.tokenize import Lengths, model_max_length
from lorakit.errors import DataError
from lorakit.recipe.known_objectives import section_of
from lorakit.recipe.schema import Recipe

PAIR_COLUMNS = ("chosen_ids", "rejected_ids")


def preference_columns(recipe: Recipe) -> dict[str, str]:
    """{recipe field: column} a preference row must have: the prompt's columns and the two responses."""
    data = recipe.data
    if data.format == "chat":
        columns = required_columns(data)
    else:
        columns = {}
        for p, column in prompt_columns(data).items():
            columns.setdefault(
                "data.input_column" if p == "input" else f"data.prompt_template {{{p}}}", column
            )
    return columns | section_of(recipe).pair_columns()  # dpo.chosen_column, ... (orpo., kto.)


def _load(recipe: Recipe, split_names: dict[str, str], held_out: bool) -> dict[str, SourceRows]:
    data, columns = recipe.data, preference_columns(recipe)
    if not held_out:
        limits = {"train": data.max_samples, "eval": data.max_eval_samples}
        return {k: load_split(data, s, limits[k], columns) for k, s in split_names.items()}
    train, held = split_holdout(data, load_split(data, data.split, None, columns))
    return {"train": train, "eval": held}


def with_eos(ids: list[int], eos: int) -> list[int]:
    """`ids` ending with `eos` (added unless it is already last)."""
    return ids if ids[-1:] == [eos] else [*ids, eos]


def _causal_pairs(src: SourceRows, recipe: Recipe, tokenizer) -> tuple[dict[str, list], list[str]]:
    """Token ids of every pair of `src`; with data.on_bad_rows skip, pairs the chat template refuses are
    left out and their reasons returned."""
    data, dpo = recipe.data, section_of(recipe)  # the dpo section, or orpo's (the same columns)
    eos = tokenizer.eos_token_id
    rows = rows_of(src.rows.to_dict())
    out: dict[str, list] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "reference": []}
    refused: list[str] = []
    columns = (dpo.chosen_column, dpo.rejected_column)
    if data.format != "chat":
        prompts = encode_prompts(tokenizer, [render_prompt(data, r) for r in rows])
        for column, key in ((dpo.chosen_column, "chosen_ids"), (dpo.rejected_column, "rejected_ids")):
            texts = [r[column] for r in rows]
            ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
            out[key] = [with_eos(x, eos) for x in ids]
        out["prompt_ids"], out["reference"] = prompts, [r[dpo.chosen_column] for r in rows]
        return out, refused
    chat = ChatTurns(tokenizer)
    for i, r in enumerate(rows):
        chat.where = src.where(i)
        try:
            prompt, responses = chat_pair(
                chat, read_messages(r[data.messages_column]), [read_messages(r[c]) for c in columns]
            )
        except TemplateFailed as e:
            if data.on_bad_rows == "error":
                raise
            refused.append(str(e))
            continue
        out["prompt_ids"].append(prompt)
        out["chosen_ids"].append(responses[0])
        out["rejected_ids"].append(responses[1])
        out["reference"].append(last_text(read_messages(r[dpo.chosen_column])))
    return out, refused


def _as_messages(value: str | list[dict], role: str) -> list[dict]:
    return [{"role": role, "content": value}] if isinstance(value, str) else value


def last_text(value: str | list[dict]) -> str:
    """A response's text: itself, or its last message's content (a row's reference)."""
    return value if isinstance(value, str) else (value[-1].get("content") or "")


def chat_pair(
    chat: ChatTurns, prompt: str | list[dict], responses: list[str | list[dict]]
) -> tuple[list[int], list[list[int]]]:
    """(prompt ids, [ids of each response]) of one preference row in chat form, the row builder every
    preference objective shares (DPO's two responses, one for an unpaired objective).

    `prompt` is text (one user turn) or messages; each response is text (one assistant turn) or messages.
    Each response is rendered after the prompt as one conversation, and its assistant turns are located in
    that rendering (lorakit.data.chat), so templates that rewrite earlier turns work too: the prompt's
    tokens are those before the response's first turn, the response's those through its last turn. A
    prompt that renders differently before the responses (or a turn not found) raises TemplateFailed."""
    # The prompt's own assistant turns (a multi-turn prompt) are context, not response.
    before = [{**m, "weight": 0} for m in _as_messages(prompt, "user")]
    prompt_ids: list[int] | None = None
    out = []
    for response in responses:
        messages = [*before, *_as_messages(response, "assistant")]
        ids, labels = chat.labels(messages, train_on_inputs=False)
        trained = [k for k, label in enumerate(labels) if label != IGNORE_INDEX]
        if not trained:
            raise TemplateFailed(f"{chat.where}: a response has no assistant turn to train on")
        head, body = ids[: trained[0]], ids[trained[0] : trained[-1] + 1]
        if prompt_ids is not None and head != prompt_ids:
            raise TemplateFailed(
                f"{chat.where}: the chat template renders the prompt differently before the chosen and the "
                "rejected response, so they cannot share one prompt"
            )
        prompt_ids = head
        out.append(body)
    return prompt_ids or [], out


def _seq2seq_pairs(src: SourceRows, recipe: Recipe, tokenizer) -> tuple[dict[str, list], list[str]]:
    """Source and target ids of every pair of `src` (the tokenizer appends EOS, as T5's does)."""
    data, dpo = recipe.data, section_of(recipe)  # the dpo section, or orpo's (the same columns)
    rows = rows_of(src.rows.to_dict())
    eos = tokenizer.eos_token_id
    out: dict[str, list] = {
        "input_ids": tokenizer([render_prompt(data, r) for r in rows], verbose=False)["input_ids"]
    }
    for column, key in ((dpo.chosen_column, "chosen_ids"), (dpo.rejected_column, "rejected_ids")):
        out[key] = [
            with_eos(x, eos) for x in tokenizer([r[column] for r in rows], verbose=False)["input_ids"]
        ]
    out["reference"] = [r[dpo.chosen_column] for r in rows]
    return out, []


def _cap_ids(ids: list[int], cap: int, keep_end: bool) -> list[int]:
    """`ids` cut to `cap` tokens: the end kept (a prompt: the part next to the response), or the start with
    the last token (EOS) kept."""
    if len(ids) <= cap:
        return ids
    return ids[len(ids) - cap :] if keep_end else [*ids[: cap - 1], ids[-1]]


class _Caps:
    """data.overlong applied pair by pair: each sequence of a pair within its cap, counted."""

    def __init__(self, policy: str, where: Callable[[int], str]):
        self.policy, self.where = policy, where
        self.truncated = self.dropped = 0

    def over(self, i: int, what: str, n: int, cap: int, field: str) -> bool:
        """Whether to drop the pair (raises under policy error)."""
        if self.policy == "error":
            raise DataError(
                f"data.overlong is error: {self.where(i)}: {what} is {n} tokens, longer than the cap of {cap} "
                f"({field}); raise {field}, or set data.overlong: truncate or drop",
                doc=OVERLONG_DOC,
            )
        if self.policy == "drop":
            self.dropped += 1
            return True
        self.truncated += 1
        return False


def _cap_causal(pairs: dict[str, list], cap: int, caps: _Caps) -> dict[str, list]:
    """Each of prompt + chosen and prompt + rejected within `cap` tokens: the responses are cut first, the
    prompt (from its start) only when it leaves fewer than half the cap to them."""
    out: dict[str, list] = {k: [] for k in pairs}
    for i, prompt in enumerate(pairs["prompt_ids"]):
        chosen, rejected = pairs["chosen_ids"][i], pairs["rejected_ids"][i]
        longest = len(prompt) + max(len(chosen), len(rejected))
        if longest > cap:
            if caps.over(i, "prompt + response", longest, cap, "data.max_length"):
                continue
            prompt = _cap_ids(prompt, max(cap - max(len(chosen), len(rejected)), cap // 2), keep_end=True)
            chosen, rejected = (_cap_ids(r, cap - len(prompt), keep_end=False) for r in (chosen, rejected))
        for key, value in (("prompt_ids", prompt), ("chosen_ids", chosen), ("rejected_ids", rejected)):
            out[key].append(value)
        out["reference"].append(pairs["reference"][i])
    out["length"] = [
        2 * len(p) + len(c) + len(r) for p, c, r in zip(*(out[k] for k in _CAUSAL_IDS), strict=True)
    ]
    return out


_CAUSAL_IDS = ("prompt_ids", "chosen_ids", "rejected_ids")


def _cap_seq2seq(pairs: dict[str, list], src_cap: int, tgt_cap: int, caps: _Caps) -> dict[str, list]:
    """Sources within `src_cap`, both targets within `tgt_cap` (EOS kept)."""
    out: dict[str, list] = {k: [] for k in pairs}
    for i, source in enumerate(pairs["input_ids"]):
        targets = [pairs[k][i] for k in PAIR_COLUMNS]
        checks = [("the source", len(source), src_cap, "data.max_source_length")]
        checks += [("a response", len(t), tgt_cap, "data.max_target_length") for t in targets]
        bad = next(((w, n, c, f) for w, n, c, f in checks if n > c), None)
        if bad is not None and caps.over(i, *bad):
            continue
        out["input_ids"].append(_cap_ids(source, src_cap, keep_end=False))
        for key, t in zip(PAIR_COLUMNS, targets, strict=True):
            out[key].append(_cap_ids(t, tgt_cap, keep_end=False))
        out["reference"].append(pairs["reference"][i])
    out["length"] = [
        len(s) + len(c) + len(r)
        for s, c, r in zip(out["input_ids"], *(out[k] for k in PAIR_COLUMNS), strict=True)
    ]
    return out


def auto_cap(value: int | str, lengths: list[int], model_max: int | None) -> int:
    """A length cap: `value`, or with "auto" the longest of `lengths` within the model's maximum."""
    if value != "auto":
        return int(value)
    top = max(lengths, default=1)
    return min(top, model_max) if model_max else top


class PairSetup(NamedTuple):
    """Where preparing rows in the pair layout (preference pairs, KTO's rows) starts from."""

    enc_dec: bool
    tokenizer: Any  # with data.chat_template applied (causal models)
    split_names: dict[str, str]  # {"train": split, "eval": split} as the recipe evaluates
    eval_split: str | None
    held_out: bool  # the eval rows are held out of the train split
    model_max: int | None


def pair_setup(recipe: Recipe, tokenizer, model_config) -> PairSetup:
    """The model kind, the tokenizer with the recipe's chat template, the splits and the model's maximum
    length; DataError when an encoder-decoder is given anything but a text prompt."""
    data = recipe.data
    enc_dec = bool(getattr(model_config, "is_encoder_decoder", False))
    if enc_dec and data.format != "instruction":
        raise DataError(
            f"data.format {data.format}: encoder-decoder models (T5 family) take a text prompt; set "
            "data.format: instruction with data.input_column (through data.prompt_template)"
        )
    if not enc_dec:
        tokenizer = use_template(tokenizer, data.chat_template)
        check_tokenizer(data, tokenizer)
    eval_split, held_out = eval_source(data) if recipe.eval_active() else (None, False)
    split_names = {"train": data.split} | ({"eval": eval_split} if eval_split else {})
    return PairSetup(
        enc_dec, tokenizer, split_names, eval_split, held_out, model_max_length(tokenizer, model_config)
    )


def cached_rows(path) -> PreparedData | None:
    """The prepared rows cached at `path`, or None."""
    hit = cache.load_cached(path)
    if hit is None:
        return None
    splits, meta = hit
    lengths = Lengths(**meta["lengths"])
    return PreparedData(splits["train"], splits.get("eval"), lengths, path, True, meta["stats"])


def prepare_preference(recipe: Recipe, tokenizer, model_config) -> PreparedData:
    """Load, tokenize, cap and cache the recipe's preference pairs (train and eval), or reuse the cache."""
    data = recipe.data
    if data.format == "alpaca":
        raise DataError(
            "data.format alpaca: preference pairs are (prompt, chosen, rejected); use data.format instruction "
            "(a text prompt through data.prompt_template) or chat (the prompt as text or messages)"
        )
    enc_dec, tokenizer, split_names, eval_split, held_out, model_max = pair_setup(
        recipe, tokenizer, model_config
    )
    key = cache.fingerprint(
        {
            "objective": recipe.train.objective,
            "sources": {k: source_fingerprint(data, s) for k, s in split_names.items()},
            "data": data.model_dump(exclude={"cache_dir", "num_proc", "packing", "group_by_length"}),
            "columns": list(section_of(recipe).pair_columns().values()),
            "tokenizer": cache.tokenizer_fingerprint(tokenizer),
            "model_max": model_max,
            "causal": not enc_dec,
            "chat_template": getattr(tokenizer, "chat_template", None) if data.format == "chat" else None,
        }
    )
    path = cache.cache_path(data.cache_dir, key)
    found = cached_rows(path)
    if found is not None:
        return found
    raw = _load(recipe, split_names, held_out)
    tokenize = _seq2seq_pairs if enc_dec else _causal_pairs
    pairs = {}
    for k, src in raw.items():
        pairs[k], refused = tokenize(src, recipe, tokenizer)
        if refused:
            raw[k] = SourceRows(
                src.rows, src.where, src.skipped + len(refused), (src.quoted + refused)[:MAX_QUOTED]
            )
    overlong: dict[str, Any] = {"policy": data.overlong}
    if enc_dec:
        src_cap = auto_cap(
            data.max_source_length, [len(x) for p in pairs.values() for x in p["input_ids"]], model_max
        )
        tgt_lengths = [len(x) for p in pairs.values() for k in PAIR_COLUMNS for x in p[k]]
        tgt_cap = auto_cap(data.max_target_length, tgt_lengths, model_max)
        lengths = Lengths(max_source_length=src_cap, max_target_length=tgt_cap)
    else:
        seq_lengths = [
            len(p) + max(len(c), len(r))
            for split in pairs.values()
            for p, c, r in zip(*(split[k] for k in _CAUSAL_IDS), strict=True)
        ]
        lengths = Lengths(max_length=auto_cap(data.max_length, seq_lengths, model_max))
    splits = {}
    for k, split in pairs.items():
        caps = _Caps(data.overlong, raw[k].where)
        if enc_dec:
            rows = _cap_seq2seq(split, lengths.max_source_length, lengths.max_target_length, caps)
        else:
            rows = _cap_causal(split, lengths.max_length, caps)
        if not rows["length"]:
            raise DataError(
                f"data.overlong is drop: no pair of {raw[k].where.origin} is left", doc=OVERLONG_DOC
            )
        splits[k] = datasets.Dataset.from_dict(rows)
        prefix = "" if k == "train" else f"{k}_"
        overlong[f"{prefix}truncated"], overlong[f"{prefix}dropped"] = caps.truncated, caps.dropped
    stats: dict[str, Any] = {
        "format": data.format,
        "objective": recipe.train.objective,
        "train_rows": len(splits["train"]),
        "eval_rows": len(splits["eval"]) if "eval" in splits else 0,
        "overlong": overlong,
        "model_max_length": model_max,
        "bad_rows": bad_rows_stats(data.on_bad_rows, raw),
    }
    if eval_split:
        stats["eval_source"] = {"split": eval_split, "held_out": held_out, "rows": len(raw["eval"].rows)}
    cache.save_cached(path, splits, {"lengths": vars(lengths), "stats": stats, "key": key})
    return PreparedData(splits["train"], splits.get("eval"), lengths, path, False, stats)
