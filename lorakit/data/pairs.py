"""The `pairs` row layout: preference pairs (train.objective dpo, orpo), (prompt, chosen, rejected) rows -> token ids.

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

from typing import Any

import datasets
import numpy as np

from lorakit.data.caps import apply_policy, auto_cap, cap_ids, record, require_rows
from lorakit.data.causal import check_tokenizer, encode_prompts
from lorakit.data.chat import IGNORE_INDEX, ChatTurns, TemplateFailed, encode_each, read_messages
from lorakit.data.layouts import Collators, Layout
from lorakit.data.rows import MESSAGES, SourceRows, required_columns
from lorakit.data.templates import prompt_columns, render_prompt, rows_of
from lorakit.data.tokenize import Lengths
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


def with_eos(ids: list[int], eos: int) -> list[int]:
    """`ids` ending with `eos` (added unless it is already last)."""
    return ids if ids[-1:] == [eos] else [*ids, eos]


def _causal_pairs(src: SourceRows, recipe: Recipe, tokenizer) -> tuple[dict[str, list], SourceRows]:
    """Token ids of every pair of `src`, and `src` less the pairs the chat template refuses (left out and
    quoted under data.on_bad_rows skip)."""
    data, dpo = recipe.data, section_of(recipe)  # the dpo section, or orpo's (the same columns)
    eos = tokenizer.eos_token_id
    rows = rows_of(src.rows.to_dict())
    columns = (dpo.chosen_column, dpo.rejected_column)
    if data.format != "chat":
        out = {"prompt_ids": encode_prompts(tokenizer, [render_prompt(data, r) for r in rows])}
        for column, key in ((dpo.chosen_column, "chosen_ids"), (dpo.rejected_column, "rejected_ids")):
            texts = [r[column] for r in rows]
            ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
            out[key] = [with_eos(x, eos) for x in ids]
        out["reference"] = [r[dpo.chosen_column] for r in rows]
        return out, src
    chat = ChatTurns(tokenizer)

    def encode(i: int, r: dict) -> tuple:
        chat.where = src.where(i)
        responses = [read_messages(r[c]) for c in columns]
        prompt, (chosen, rejected) = chat_pair(chat, read_messages(r[data.messages_column]), responses)
        return prompt, chosen, rejected, last_text(responses[0])

    names = ("prompt_ids", "chosen_ids", "rejected_ids", "reference")
    return encode_each(src, rows, names, data.on_bad_rows, encode)


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


def _seq2seq_pairs(src: SourceRows, recipe: Recipe, tokenizer) -> tuple[dict[str, list], SourceRows]:
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
    return out, src


def _over_causal(pairs: dict[str, list], cap: int) -> list[tuple[str, int, int, str] | None]:
    """Of every pair, why it is over the cap (what, tokens, cap, field), or None."""
    out = []
    for prompt, chosen, rejected in zip(*(pairs[k] for k in _CAUSAL_IDS), strict=True):
        longest = len(prompt) + max(len(chosen), len(rejected))
        out.append(("prompt + response", longest, cap, "data.max_length") if longest > cap else None)
    return out


def _over_seq2seq(
    pairs: dict[str, list], src_cap: int, tgt_cap: int
) -> list[tuple[str, int, int, str] | None]:
    """Of every pair, the first of its sequences over its cap (what, tokens, cap, field), or None."""
    out = []
    for i, source in enumerate(pairs["input_ids"]):
        checks = [("the source", len(source), src_cap, "data.max_source_length")]
        checks += [("a response", len(pairs[k][i]), tgt_cap, "data.max_target_length") for k in PAIR_COLUMNS]
        out.append(next(((w, n, c, f) for w, n, c, f in checks if n > c), None))
    return out


def _cap_causal(pairs: dict[str, list], kept, cap: int) -> dict[str, list]:
    """The `kept` pairs, each of prompt + chosen and prompt + rejected within `cap` tokens: the responses are
    cut first, the prompt (from its start) only when it leaves fewer than half the cap to them."""
    out: dict[str, list] = {k: [] for k in pairs}
    for i in kept:
        prompt, chosen, rejected = (pairs[k][i] for k in _CAUSAL_IDS)
        if len(prompt) + max(len(chosen), len(rejected)) > cap:
            prompt = cap_ids(prompt, max(cap - max(len(chosen), len(rejected)), cap // 2), keep_end=True)
            chosen, rejected = (cap_ids(r, cap - len(prompt), keep_end=False) for r in (chosen, rejected))
        for key, value in (("prompt_ids", prompt), ("chosen_ids", chosen), ("rejected_ids", rejected)):
            out[key].append(value)
        out["reference"].append(pairs["reference"][i])
    out["length"] = [
        2 * len(p) + len(c) + len(r) for p, c, r in zip(*(out[k] for k in _CAUSAL_IDS), strict=True)
    ]
    return out


_CAUSAL_IDS = ("prompt_ids", "chosen_ids", "rejected_ids")


def _cap_seq2seq(pairs: dict[str, list], kept, src_cap: int, tgt_cap: int) -> dict[str, list]:
    """The `kept` pairs, sources within `src_cap`, both targets within `tgt_cap` (EOS kept)."""
    out: dict[str, list] = {k: [] for k in pairs}
    for i in kept:
        out["input_ids"].append(cap_ids(pairs["input_ids"][i], src_cap, keep_end=False))
        for key in PAIR_COLUMNS:
            out[key].append(cap_ids(pairs[key][i], tgt_cap, keep_end=False))
        out["reference"].append(pairs["reference"][i])
    out["length"] = [
        len(s) + len(c) + len(r)
        for s, c, r in zip(out["input_ids"], *(out[k] for k in PAIR_COLUMNS), strict=True)
    ]
    return out


def _lengths(recipe: Recipe, pairs: dict[str, dict], enc_dec: bool, model_max: int | None) -> Lengths:
    """The caps of data.max_length (max_source_length, max_target_length); auto: the longest pair's."""
    data = recipe.data
    if enc_dec:
        src_cap = auto_cap(
            data.max_source_length, [len(x) for p in pairs.values() for x in p["input_ids"]], model_max
        )
        tgt_lengths = [len(x) for p in pairs.values() for k in PAIR_COLUMNS for x in p[k]]
        return Lengths(
            max_source_length=src_cap,
            max_target_length=auto_cap(data.max_target_length, tgt_lengths, model_max),
        )
    seq_lengths = [
        len(p) + max(len(c), len(r))
        for split in pairs.values()
        for p, c, r in zip(*(split[k] for k in _CAUSAL_IDS), strict=True)
    ]
    return Lengths(max_length=auto_cap(data.max_length, seq_lengths, model_max))


def _refusal(where, over: list):
    """data.overlong error's message for pair i (`over`: as _over_causal gives it)."""

    def message(i: int, n: int) -> str:
        what, tokens, cap, field = over[i]
        return (
            f"data.overlong is error: {where(i)}: {what} is {tokens} tokens, longer than the cap of {cap} "
            f"({field}); raise {field}, or set data.overlong: truncate or drop"
        )

    return message


class Pairs(Layout):
    """Preference pairs (DPO, ORPO): a prompt, a chosen and a rejected response (module docstring)."""

    name = "pairs"

    def check(self, recipe: Recipe, enc_dec: bool, tokenizer) -> None:
        data = recipe.data
        if data.format == "alpaca":
            raise DataError(
                "data.format alpaca: preference pairs are (prompt, chosen, rejected); use data.format "
                "instruction (a text prompt through data.prompt_template) or chat (the prompt as text or messages)"
            )
        text_prompt(recipe, enc_dec, tokenizer)

    def columns(self, recipe: Recipe) -> dict[str, str]:
        return preference_columns(recipe)

    def aliases(self, recipe: Recipe) -> dict[str, str]:
        return trl_prompt(recipe)

    def key(self, recipe: Recipe, enc_dec: bool) -> dict[str, Any]:
        # The response columns only (the prompt's are in the data section): the key pairs were cached under
        # before the layouts shared one skeleton, so those caches stay valid.
        return {
            "objective": recipe.train.objective,
            "columns": list(section_of(recipe).pair_columns().values()),
        }

    def rows(self, raw, recipe: Recipe, tokenizer, model_max, enc_dec: bool):
        tokenize = _seq2seq_pairs if enc_dec else _causal_pairs
        pairs = {}
        for k, src in raw.items():
            pairs[k], raw[k] = tokenize(src, recipe, tokenizer)
        lengths = _lengths(recipe, pairs, enc_dec, model_max)
        splits, overlong = {}, {"policy": recipe.data.overlong}
        for k, split in pairs.items():
            if enc_dec:
                src_cap, tgt_cap = lengths.max_source_length, lengths.max_target_length
                over = _over_seq2seq(split, src_cap, tgt_cap)
            else:
                over = _over_causal(split, lengths.max_length)
            where = raw[k].where
            flagged = np.array([o is not None for o in over], dtype=bool)
            kept, truncated, dropped = apply_policy(recipe.data.overlong, flagged, _refusal(where, over))
            if enc_dec:
                rows = _cap_seq2seq(split, kept, src_cap, tgt_cap)
            else:
                rows = _cap_causal(split, kept, lengths.max_length)
            require_rows(len(rows["length"]), f"data.overlong is drop: no pair of {where.origin} is left")
            splits[k] = datasets.Dataset.from_dict(rows)
            record(overlong, k, truncated, dropped)
        return splits, lengths, {"objective": recipe.train.objective, "overlong": overlong}

    def collators(self, tokenizer, config) -> Collators:
        from lorakit.data.pair_collate import pair_collators

        return pair_collators(tokenizer, config)


def text_prompt(recipe: Recipe, enc_dec: bool, tokenizer) -> None:
    """DataError when an encoder-decoder is given anything but a text prompt, or the tokenizer cannot render
    the rows (a causal LM: a chat template for chat, an EOS token for the others)."""
    data = recipe.data
    if enc_dec and data.format != "instruction":
        raise DataError(
            f"data.format {data.format}: encoder-decoder models (T5 family) take a text prompt; set "
            "data.format: instruction with data.input_column (through data.prompt_template)"
        )
    if not enc_dec:
        check_tokenizer(data, tokenizer)


def trl_prompt(recipe: Recipe) -> dict[str, str]:
    """TRL's standard columns as they come: in chat form, with data.messages_column at its default, a source
    without a `messages` column gives the prompt (text or messages) in `prompt`."""
    data = recipe.data
    return {MESSAGES: "prompt"} if data.format == "chat" and data.messages_column == MESSAGES else {}


LAYOUT = Pairs()
