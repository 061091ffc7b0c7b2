"""Tiny random models and tokenizers built locally, for tests, the quickstart and users' smoke tests.

Nothing here touches the network: the tokenizer is trained on the builtin news_summaries dataset and the
weights are random but a pure function of the seed. `model.name_or_path: tiny:t5` (or `tiny:llama`,
`tiny:mistral`, `tiny:qwen2`, `tiny:bart`) in a recipe resolves, through `resolve_model_source`, to a
directory built once under the cache directory.

The builders are the model families' (lorakit.model.families: each family's `Tiny`, driven by
lorakit.model.families.tiny, where production code such as model loading finds them); this module is their
public face, under the names tests, benchmarks and users import.
"""

from __future__ import annotations

from lorakit.model.families.base import TINY_MAX_LENGTH
from lorakit.model.families.mistral import TINY_SLIDING_WINDOW
from lorakit.model.families.registry import family_named, tiny_kinds
from lorakit.model.families.tiny import (
    BOS,
    EOS,
    LLAMA_CHAT_TEMPLATE,
    PAD,
    SPECIAL_TOKENS,
    TINY_VERSION,
    TINY_VOCAB_SIZE,
    UNK,
    build_tiny_model,
    build_tiny_tokenizer,
    resolve_model_source,
    tiny_config,
)

TINY_KINDS: tuple[str, ...] = tiny_kinds()
# The decoder-only kinds: they share the Llama-style tokenizer (BOS prepended, no EOS, chat template).
CAUSAL_KINDS: tuple[str, ...] = tuple(k for k in TINY_KINDS if not family_named(k).encoder_decoder)
# The encoder-decoder kinds: T5's tokenizer layout (</s> appended), a sequence-to-sequence model.
SEQ2SEQ_KINDS: tuple[str, ...] = tuple(k for k in TINY_KINDS if family_named(k).encoder_decoder)

__all__ = [
    "BOS",
    "CAUSAL_KINDS",
    "EOS",
    "LLAMA_CHAT_TEMPLATE",
    "PAD",
    "SEQ2SEQ_KINDS",
    "SPECIAL_TOKENS",
    "TINY_KINDS",
    "TINY_MAX_LENGTH",
    "TINY_SLIDING_WINDOW",
    "TINY_VERSION",
    "TINY_VOCAB_SIZE",
    "UNK",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "resolve_model_source",
    "tiny_config",
]
