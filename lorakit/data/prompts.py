"""The `prompts` row layout (train.objective grpo): prompts to sample completions from, no targets.

A row's prompt is data.prompt_template over its columns (data.format instruction), or with data.format chat
(causal LMs) data.messages_column's text or messages rendered by the chat template with its generation
prompt; a row the template refuses is a bad row (data.on_bad_rows). The optional reference answer
(grpo.answer_column) rides along as text for the rewards. Rows hold `prompt_ids` (causal: the tokenizer's
BOS, no EOS; encoder-decoders: the source with its EOS), `prompt` (the prompt's text), `answer` ("" when none)
and `length` (prompt tokens). A prompt over its cap (data.max_length for a causal LM, data.max_source_length
for an encoder-decoder; auto: the longest) follows data.overlong, cut at its start (the end is what the
completion continues).

Batches (PromptCollator) hold `input_ids` and `attention_mask` left-padded for a causal LM, so every
prompt ends where generation begins, or right-padded sources for an encoder-decoder, and the rows' `prompt`
and `answer` texts. Prompts are not packed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import datasets
import numpy as np

from lorakit.data.caps import apply_policy, auto_cap, cap_ids, record, require_rows
from lorakit.data.causal import chat_prompt, encode_prompts
from lorakit.data.chat import encode_each, read_messages
from lorakit.data.layouts import Collators, Layout
from lorakit.data.pairs import last_text, text_prompt, trl_prompt
from lorakit.data.rows import SourceRows
from lorakit.data.templates import prompt_columns, render_prompt, rows_of
from lorakit.data.tokenize import Lengths
from lorakit.errors import DataError

# Bump when the prepared rows change for the same inputs, so stale caches are not reused.
FORMAT_VERSION = 1


def answer_column(recipe) -> str | None:
    """The reference-answer column of the recipe's grpo section, None when it names none (or has none)."""
    section = (recipe.model_extra or {}).get("grpo")
    return getattr(section, "answer_column", None)


def prompt_row_columns(recipe) -> dict[str, str]:
    """{recipe field: column} a prompt row must have: its prompt's columns (chat: data.messages_column) and
    the answer column when one is named."""
    data = recipe.data
    if data.format == "chat":
        columns = {"data.messages_column": data.messages_column}
    elif data.format == "instruction":
        columns = {}
        for p, column in prompt_columns(data).items():
            field = "data.input_column" if p == "input" else f"data.prompt_template {{{p}}}"
            columns.setdefault(field, column)
    else:
        raise DataError(
            f"prompt rows read data.format instruction (the prompt through data.prompt_template) or chat "
            f"(data.messages_column: the prompt as text or messages); not data.format {data.format}"
        )
    answer = answer_column(recipe)
    return columns | ({"grpo.answer_column": answer} if answer else {})


def encode_prompts_of(
    recipe, src: SourceRows, tokenizer, enc_dec: bool
) -> tuple[dict[str, list], SourceRows]:
    """(`prompt` texts, `ids`, `answer`) of the split's rows, and the split less the rows the chat template
    refuses (skipped and counted, or the error under data.on_bad_rows error)."""
    data, answer = recipe.data, answer_column(recipe)
    rows = rows_of(src.rows.to_dict())
    # Chat rows store text-or-messages columns as JSON (lorakit.data.rows): an answer given as messages is
    # its last text.
    answers = [
        (last_text(read_messages(r[answer])) if data.format == "chat" else r[answer]) if answer else ""
        for r in rows
    ]
    if data.format != "chat":
        texts = [render_prompt(data, r) for r in rows]
        ids = tokenizer(texts, verbose=False)["input_ids"] if enc_dec else encode_prompts(tokenizer, texts)
        return {"prompt": texts, "ids": ids, "answer": answers}, src

    def encode(i: int, r: dict) -> tuple:
        return (*chat_prompt(tokenizer, read_messages(r[data.messages_column]), src.where(i)), answers[i])

    return encode_each(src, rows, ("prompt", "ids", "answer"), data.on_bad_rows, encode)


class Prompts(Layout):
    """GRPO's prompts: text or messages through the chat template, and an optional reference answer."""

    name = "prompts"

    def check(self, recipe, enc_dec: bool, tokenizer) -> None:
        text_prompt(recipe, enc_dec, tokenizer)
        if recipe.data.packing is True:
            raise DataError(
                "data.packing: prompt rows are generated from, not packed; set data.packing: auto or false"
            )

    def columns(self, recipe) -> dict[str, str]:
        return prompt_row_columns(recipe)

    def aliases(self, recipe) -> dict[str, str]:
        return trl_prompt(recipe)

    def key(self, recipe, enc_dec: bool) -> dict[str, Any]:
        return {"layout": self.name, "version": FORMAT_VERSION, "answer": answer_column(recipe)}

    def rows(self, raw, recipe, tokenizer, model_max, enc_dec: bool):
        data = recipe.data
        encoded = {}
        for split in raw:
            encoded[split], raw[split] = encode_prompts_of(recipe, raw[split], tokenizer, enc_dec)
        setting = data.max_source_length if enc_dec else data.max_length
        cap = auto_cap(setting, [len(p) for p in encoded["train"]["ids"]], model_max)
        lengths = Lengths(max_source_length=cap) if enc_dec else Lengths(max_length=cap)
        overlong: dict[str, Any] = {"policy": data.overlong}
        splits = {}
        for split, enc in encoded.items():
            where = raw[split].where

            def refusal(i: int, n: int, where=where) -> str:
                field = "data.max_source_length" if enc_dec else "data.max_length"
                return (
                    f"data.overlong is error: {where(i)}: its prompt is longer than {field} {cap} ({n} row(s) "
                    f"over); raise {field}, or set data.overlong: truncate or drop"
                )

            over = np.asarray([len(p) > cap for p in enc["ids"]], dtype=bool)
            kept, truncated, dropped = apply_policy(data.overlong, over, refusal)
            require_rows(len(kept), f"data.overlong drop left no {split} prompt within the cap {cap}")
            record(overlong, split, truncated, dropped)
            # Causal prompts keep their end (what generation continues); T5 sources their start and EOS.
            ids = [cap_ids(enc["ids"][i], cap, keep_end=not enc_dec) for i in kept]
            splits[split] = datasets.Dataset.from_dict(
                {
                    "prompt_ids": ids,
                    "prompt": [enc["prompt"][i] for i in kept],
                    "answer": [enc["answer"][i] for i in kept],
                    "length": [len(x) for x in ids],
                }
            )
        return splits, lengths, {"overlong": overlong}

    def collators(self, tokenizer, config) -> Collators:
        enc_dec = bool(getattr(config, "is_encoder_decoder", False))
        return Collators(
            padded=PromptCollator(tokenizer.pad_token_id, left=not enc_dec),
            packed_causal=_no_packing,
            packed_seq2seq=_no_packing,
            seq2seq_lengths=lambda data: (data.train["length"], [0] * len(data.train)),
            unit="prompt",
        )


def _no_packing(*_: Any):
    raise DataError(
        "data.packing: prompt rows are generated from, not packed; set data.packing: auto or false"
    )


class PromptCollator:
    """Prompts as a generation batch: left-padded (causal: every prompt ends where generation begins) or
    right-padded (encoder sources), with their mask and the rows' prompt and answer texts."""

    def __init__(self, pad_token_id: int, left: bool):
        self.pad_token_id, self.left = pad_token_id, left

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        import torch

        ids = [r["prompt_ids"] for r in rows]
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, x in enumerate(ids):
            where = slice(width - len(x), width) if self.left else slice(0, len(x))
            input_ids[i, where] = torch.as_tensor(x, dtype=torch.long)
            mask[i, where] = 1
        real = int(mask.sum())
        return {
            "input_ids": input_ids,
            "attention_mask": mask,
            "prompt": [r["prompt"] for r in rows],
            "answer": [r["answer"] for r in rows],
            "num_target_tokens": 0,
            "num_real_tokens": real,
            "num_token_slots": input_ids.numel(),
            "num_examples": len(rows),
        }


LAYOUT = Prompts()
