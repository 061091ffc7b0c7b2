"""The `unpaired` row layout (train.objective kto): (prompt, completion, label) rows -> token ids.

Each row is laid out as a preference pair is (lorakit.data.pairs), so the pair batching, the
shared-prompt packed rows, the packed encoder-decoder rows and full fine-tuning's cached reference all take
it unchanged: its own completion in the `chosen_ids` place and, in the `rejected_ids` place, a MISMATCHED
completion, that of another row with another prompt, from which the objective estimates KTO's reference
point z0 = KL(policy || reference) (lorakit.objectives.kto). Rows also hold `label` (True: desirable).

The mismatched completion of row i is that of the next row (cyclically, in the split's order) whose prompt
differs: fixed at preparation, as TRL's KTO fixes it by shifting completions over blocks of the dataset, so
a packed row's length is known to the sampler and the full fine-tuning reference is scored once per row.

The prompt is what SFT and DPO give the model: data.prompt_template over its columns (data.format
instruction), or with data.format chat (causal LMs) data.messages_column's text or messages, rendered with
the completion (text or assistant messages) by the chat template through the row builder DPO shares
(lorakit.data.pairs.chat_pair); a row the template refuses is a bad row (data.on_bad_rows), left out
before the mismatched completions are chosen, and those are keyed on the prompt's token ids.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import datasets
import numpy as np

from lorakit.data.caps import apply_policy, auto_cap, cap_ids, record, require_rows
from lorakit.data.causal import encode_prompts
from lorakit.data.chat import ChatTurns, encode_each, read_messages
from lorakit.data.layouts import Collators, Layout
from lorakit.data.pairs import chat_pair, last_text, text_prompt, trl_prompt, with_eos
from lorakit.data.rows import SourceRows
from lorakit.data.templates import prompt_columns, render_prompt, rows_of
from lorakit.data.tokenize import Lengths
from lorakit.errors import DataError

# Bump when the prepared rows change for the same inputs, so stale caches are not reused.
FORMAT_VERSION = 1
# The completion's and the mismatched completion's columns in the pair layout (lorakit.data.pairs).
OWN, MISMATCHED = "chosen_ids", "rejected_ids"


def unpaired_columns(recipe) -> dict[str, str]:
    """{recipe field: column} a KTO row must have: its prompt's columns (chat: data.messages_column), the
    completion and the label."""
    data, kto = recipe.data, recipe.kto
    if data.format == "chat":
        return {"data.messages_column": data.messages_column} | kto.pair_columns()
    if data.format != "instruction":
        raise DataError(
            f"train.objective kto reads data.format instruction (the prompt through data.prompt_template) or "
            f"chat (data.messages_column: the prompt as text or messages); not data.format {data.format}"
        )
    columns: dict[str, str] = {}
    for p, column in prompt_columns(data).items():
        columns.setdefault("data.input_column" if p == "input" else f"data.prompt_template {{{p}}}", column)
    return columns | kto.pair_columns()


def mismatched(prompts: Sequence[Hashable]) -> list[int]:
    """For every row, the row whose completion is its mismatched one: the next (cyclically) whose prompt
    differs; the row itself when every prompt is the same (z0 then estimates nothing but is still finite)."""
    n = len(prompts)
    out = []
    for i in range(n):
        j = next((k % n for k in range(i + 1, i + n) if prompts[k % n] != prompts[i]), i)
        out.append(j)
    return out


def _encode_causal(recipe, tokenizer, rows: list[dict]) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, completion ids ending with EOS) of every row: the row builder of text-form rows."""
    prompts = encode_prompts(tokenizer, [render_prompt(recipe.data, r) for r in rows])
    texts = [r[recipe.kto.completion_column] for r in rows]
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return prompts, [with_eos(x, tokenizer.eos_token_id) for x in ids]


def _encode_chat(recipe, src: SourceRows, tokenizer) -> tuple[dict[str, list], SourceRows]:
    """The rows of `src` in chat form as (prompt ids, completion ids), labels and references, and `src` less
    the rows the chat template refuses (bad rows: skipped and counted, or the error under on_bad_rows error)."""
    data, kto = recipe.data, recipe.kto
    chat = ChatTurns(tokenizer)

    def encode(i: int, r: dict) -> tuple:
        chat.where = src.where(i)
        completion = read_messages(r[kto.completion_column])
        prompt, (ids,) = chat_pair(chat, read_messages(r[data.messages_column]), [completion])
        return prompt, ids, bool(r[kto.label_column]), last_text(completion)

    columns = ("prompt", OWN, "label", "reference")
    return encode_each(src, rows_of(src.rows.to_dict()), columns, data.on_bad_rows, encode)


def _encode_seq2seq(recipe, tokenizer, rows: list[dict]) -> tuple[list[list[int]], list[list[int]]]:
    """(source ids, completion ids) of every row (T5's tokenizer appends EOS)."""
    sources = tokenizer([render_prompt(recipe.data, r) for r in rows], verbose=False)["input_ids"]
    texts = [r[recipe.kto.completion_column] for r in rows]
    ids = tokenizer(texts, verbose=False)["input_ids"]
    return sources, [with_eos(x, tokenizer.eos_token_id) for x in ids]


def _encode(recipe, src, tokenizer, enc_dec: bool) -> tuple[dict[str, list], SourceRows]:
    """Every kept row of the split as (prompt, completion, mismatched completion) ids, label and reference,
    and the split's rows less those the chat template refused."""
    if recipe.data.format == "chat":
        out, src = _encode_chat(recipe, src, tokenizer)
        # Keyed on the rendered prompt, so a prompt given as text and as one user message is one prompt.
        partner = mismatched([tuple(p) for p in out["prompt"]])
    else:
        rows = rows_of(src.rows.to_dict())
        prompts, completions = (_encode_seq2seq if enc_dec else _encode_causal)(recipe, tokenizer, rows)
        kto = recipe.kto
        out = {
            "prompt": prompts,
            OWN: completions,
            "label": [bool(r[kto.label_column]) for r in rows],
            "reference": [r[kto.completion_column] for r in rows],
        }
        partner = mismatched([render_prompt(recipe.data, r) for r in rows])
    out[MISMATCHED] = [out[OWN][j] for j in partner]
    return out, src


def _caps(recipe, encoded: list[dict], enc_dec: bool, model_max: int | None) -> Lengths:
    """The caps of data.max_length (max_source_length, max_target_length); auto: the longest row's."""
    data = recipe.data
    responses = [max(len(a), len(b)) for e in encoded for a, b in zip(e[OWN], e[MISMATCHED], strict=True)]
    prompts = [len(p) for e in encoded for p in e["prompt"]]
    if enc_dec:
        return Lengths(
            max_source_length=auto_cap(data.max_source_length, prompts, model_max),
            max_target_length=auto_cap(data.max_target_length, responses, model_max),
        )
    return Lengths(
        max_length=auto_cap(
            data.max_length, [p + r for p, r in zip(prompts, responses, strict=True)], model_max
        )
    )


def _over(encoded: dict, enc_dec: bool, lengths: Lengths) -> np.ndarray:
    """Whether each row's prompt and completion (or mismatched completion) are over their caps."""
    over = []
    for prompt, own, other in zip(encoded["prompt"], encoded[OWN], encoded[MISMATCHED], strict=True):
        longest = max(len(own), len(other))
        if enc_dec:
            over.append(len(prompt) > lengths.max_source_length or longest > lengths.max_target_length)
        else:
            over.append(len(prompt) + longest > lengths.max_length)
    return np.asarray(over, dtype=bool)


def _capped(encoded: dict, kept, over: np.ndarray, enc_dec: bool, lengths: Lengths) -> dict[str, list]:
    """The `kept` rows in the pair layout, each sequence within its cap (those `over` them cut)."""
    first = "input_ids" if enc_dec else "prompt_ids"
    out: dict[str, list] = {first: [], OWN: [], MISMATCHED: [], "label": [], "reference": [], "length": []}
    for i in kept:
        prompt, own, other = encoded["prompt"][i], encoded[OWN][i], encoded[MISMATCHED][i]
        if over[i]:
            if enc_dec:
                prompt = cap_ids(prompt, lengths.max_source_length, keep_end=False)
                response_cap = lengths.max_target_length
            else:
                cap = lengths.max_length
                prompt = cap_ids(prompt, max(cap - max(len(own), len(other)), cap // 2), keep_end=True)
                response_cap = cap - len(prompt)
            own, other = cap_ids(own, response_cap, False), cap_ids(other, response_cap, False)
        for key, value in ((first, prompt), (OWN, own), (MISMATCHED, other)):
            out[key].append(value)
        out["label"].append(encoded["label"][i])
        out["reference"].append(encoded["reference"][i])
        # Packed causal rows hold prompt + completion and prompt + mismatched completion (sharing the
        # prompt: less); encoder-decoders the source once and both completions.
        out["length"].append((1 if enc_dec else 2) * len(prompt) + len(own) + len(other))
    return out


def _refusal(where):
    def message(i: int, n: int) -> str:
        return (
            f"data.overlong is error: {where(i)}: its prompt and completion (or the mismatched "
            "completion it is scored with) are longer than the cap; raise data.max_length "
            "(data.max_source_length, max_target_length), or set data.overlong: truncate or drop"
        )

    return message


class Unpaired(Layout):
    """KTO's rows: a prompt, a completion and a label, with a mismatched completion (module docstring)."""

    name = "unpaired"

    def check(self, recipe, enc_dec: bool, tokenizer) -> None:
        unpaired_columns(recipe)  # refuses formats other than instruction and chat
        text_prompt(recipe, enc_dec, tokenizer)

    def columns(self, recipe) -> dict[str, str]:
        return unpaired_columns(recipe)

    def flags(self, recipe) -> frozenset[str]:
        return frozenset({recipe.kto.label_column})

    def aliases(self, recipe) -> dict[str, str]:
        return trl_prompt(recipe)

    def key(self, recipe, enc_dec: bool) -> dict[str, Any]:
        return {"unpaired": FORMAT_VERSION, "objective": recipe.train.objective}

    def rows(self, raw, recipe, tokenizer, model_max, enc_dec: bool):
        encoded = {}
        for k, src in raw.items():
            encoded[k], raw[k] = _encode(recipe, src, tokenizer, enc_dec)
        lengths = _caps(recipe, list(encoded.values()), enc_dec, model_max)
        splits, overlong = {}, {"policy": recipe.data.overlong}
        for k, src in raw.items():
            over = _over(encoded[k], enc_dec, lengths)
            kept, truncated, dropped = apply_policy(recipe.data.overlong, over, _refusal(src.where))
            rows = _capped(encoded[k], kept, over, enc_dec, lengths)
            require_rows(len(rows["length"]), f"data.overlong is drop: no row of {src.where.origin} is left")
            splits[k] = datasets.Dataset.from_dict(rows)
            record(overlong, k, truncated, dropped)
        stats = {"objective": recipe.train.objective, "desirable_rows": sum(splits["train"]["label"])}
        return splits, lengths, stats | {"overlong": overlong}

    def collators(self, tokenizer, config) -> Collators:
        from lorakit.data.pair_collate import pair_collators

        return pair_collators(tokenizer, config, labels=True)


LAYOUT = Unpaired()
