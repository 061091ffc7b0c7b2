"""The `examples` row layout (SFT): one training sequence per row.

Encoder-decoder rows (lorakit.data.tokenize) hold `input_ids` (templated source), `labels` (target),
`length` and `reference`; causal-LM rows (lorakit.data.causal) hold `input_ids`, `labels` (unshifted, -100
where no loss is taken), `length`, `prompt_ids` and `reference`. The columns are those data.format reads
(lorakit.data.rows), Alpaca rows read as one rendered prompt and one target.
"""

from __future__ import annotations

from typing import Any

from lorakit.data.causal import prepare_causal
from lorakit.data.collate import PackedCausalCollator, PackedSeq2SeqCollator, padded_collator
from lorakit.data.layouts import Collators, Layout
from lorakit.data.rows import ALPACA_PROMPT, ALPACA_TARGET
from lorakit.data.tokenize import prepare_seq2seq, token_counts
from lorakit.errors import DataError
from lorakit.recipe.schema import DataSection, Recipe


def as_instruction(data: DataSection) -> DataSection:
    """The data section tokenizers read for data.format alpaca: instruction rows of one rendered prompt
    column and one target column (lorakit.data.rows turns every Alpaca row into them)."""
    if data.format != "alpaca":
        return data
    update = {"format": "instruction", "input_column": ALPACA_PROMPT, "prompt_template": "{input}"}
    return data.model_copy(update={**update, "target_column": ALPACA_TARGET, "target_template": None})


def source_target_lengths(data) -> tuple[list[int], list[int]]:
    """Source and target token counts of the training rows (from Arrow's offsets: on a large dataset,
    reading the rows as Python lists took seconds of every run's start)."""
    return token_counts(data.train, "input_ids").tolist(), token_counts(data.train, "labels").tolist()


class Examples(Layout):
    """SFT's examples: the columns of data.format, tokenized whole, capped by data.max_length (causal) or
    data.max_source_length and max_target_length (encoder-decoders)."""

    name = "examples"
    mixes = True

    def check(self, recipe: Recipe, enc_dec: bool, tokenizer) -> None:
        if enc_dec and recipe.data.format not in ("instruction", "alpaca"):
            raise DataError(
                f"data.format {recipe.data.format}: encoder-decoder models (T5 family) take (input, target) "
                "pairs; set data.format: instruction with data.input_column and data.target_column"
            )

    def key(self, recipe: Recipe, enc_dec: bool) -> dict[str, Any]:
        # Packing lowers the causal cap to train.max_tokens when that is smaller.
        return {
            "packing_max_tokens": recipe.train.max_tokens if recipe.data.packing and not enc_dec else None
        }

    def rows(self, raw, recipe: Recipe, tokenizer, model_max, enc_dec: bool):
        view = as_instruction(recipe.data)
        if enc_dec:
            splits, lengths, stats = prepare_seq2seq(raw, view, tokenizer, model_max)
        else:
            splits, lengths, stats = prepare_causal(
                raw, recipe.model_copy(update={"data": view}), tokenizer, model_max
            )
        if raw["train"].labels is not None:
            stats["labels"] = raw["train"].labels
        return splits, lengths, stats

    def collators(self, tokenizer, config) -> Collators:
        return Collators(
            padded=padded_collator(tokenizer, config),
            packed_causal=PackedCausalCollator,
            packed_seq2seq=PackedSeq2SeqCollator,
            seq2seq_lengths=source_target_lengths,
            token_budget=True,
        )


LAYOUT = Examples()
