"""Row layouts: the only variable part of preparing and batching data.

lorakit.data.prepare loads the splits, keys and fills the cache, applies data.overlong (lorakit.data.caps)
and records the statistics for every layout alike; lorakit.data.batching chooses the sampler for every
layout alike. A layout says the rest, in one module:

- `columns`: what a row must have ({recipe field: column}; None: what data.format reads), with the
  columns holding yes/no labels (`flags`) and those read instead when a source lacks one (`aliases`);
- `rows`: how the checked rows become token ids, their caps and their per-row `length`;
- `collators`: how its rows become micro-batches (padded, packed), and the lengths a packed row budgets.

An objective names the layout it reads (Objective.layout). Adding one is a module with a `LAYOUT` and a
line in LAYOUTS.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from lorakit.errors import DataError

if TYPE_CHECKING:
    import datasets

    from lorakit.data.rows import SourceRows
    from lorakit.data.tokenize import Lengths
    from lorakit.recipe.schema import Recipe

# {layout name: the module whose LAYOUT it is}; modules are imported on first use.
LAYOUTS = {
    "examples": "lorakit.data.examples",  # SFT: one sequence (or source and target) per row
    "pairs": "lorakit.data.pairs",  # preference pairs: a prompt, a chosen and a rejected response
    "unpaired": "lorakit.data.unpaired",  # KTO: a prompt, a completion, a label
    "prompts": "lorakit.data.prompts",  # GRPO: a prompt to sample from, an optional reference answer
}


@dataclass(frozen=True)
class Collators:
    """How a layout's rows are batched; lorakit.data.batching picks among them from the recipe and model."""

    padded: Callable  # padded rows: training without packing, and evaluation
    packed_causal: Callable[[int], Callable]  # max_tokens -> the collator of one packed causal row
    packed_seq2seq: Callable  # (max source, max target, decoder start) -> packed encoder-decoder collator
    seq2seq_lengths: Callable[[Any], tuple[list[int], list[int]]]  # PreparedData -> (source, target) tokens
    # Sequences one row puts in a packed causal row (a pair: prompt + chosen and prompt + rejected), what a
    # row is called, and what its length counts (in the error for a row longer than a packed row).
    sequences: int = 1
    unit: str = "example"
    packed_as: str = ""
    # Encoder-decoders that cannot pack may fall back to token-budget padded batches (SFT's examples).
    token_budget: bool = False
    # Causal rows that can share their prompt in a packed row (preference pairs: dpo.share_prompt): (the
    # rows' lengths so packed, PreparedData's train split -> list; max_tokens -> its collator).
    shared_prompt: tuple[Callable[[Any], list[int]], Callable[[int], Callable]] | None = None
    # Applied to every collator chosen: what rides in a batch beside the tokens (reference log-probs...).
    wrap: Callable[[Callable], Callable] | None = None


class Layout:
    """A row layout; see the module docstring. Defaults: SFT's columns (those data.format reads)."""

    name: ClassVar[str]
    # Whether a data.source list (a mixture) can feed it.
    mixes: ClassVar[bool] = False

    def check(self, recipe: Recipe, enc_dec: bool, tokenizer) -> None:
        """DataError for data settings this layout cannot read on this model (`tokenizer`: with
        data.chat_template applied)."""

    def columns(self, recipe: Recipe) -> dict[str, str] | None:
        """{recipe field: column} a row must have; None: those data.format reads."""
        return None

    def flags(self, recipe: Recipe) -> frozenset[str]:
        """Columns holding yes/no labels (read as bool), not text."""
        return frozenset()

    def aliases(self, recipe: Recipe) -> dict[str, str] | None:
        """{column: the column read instead when a source has none} (e.g. TRL's `prompt` for `messages`);
        None: data.format's (ShareGPT's `conversations` for chat examples, lorakit.data.rows)."""
        return None

    def key(self, recipe: Recipe, enc_dec: bool) -> dict[str, Any]:
        """What the prepared rows depend on beyond the source, data section, tokenizer and model maximum."""
        return {}

    def rows(
        self, raw: dict[str, SourceRows], recipe: Recipe, tokenizer, model_max: int | None, enc_dec: bool
    ) -> tuple[dict[str, datasets.Dataset], Lengths, dict[str, Any]]:
        """(splits, caps, statistics) of the checked rows of every split; `raw` is updated in place for rows
        the chat template refuses (data.on_bad_rows skip)."""
        raise NotImplementedError

    def collators(self, tokenizer, config) -> Collators:
        """How the rows are batched on a model of `config`."""
        raise NotImplementedError


def layout_named(name: str) -> Layout:
    """The registered layout `name`."""
    if name not in LAYOUTS:
        raise DataError(f"no row layout {name!r}; known: {', '.join(LAYOUTS)}")
    return importlib.import_module(LAYOUTS[name]).LAYOUT
