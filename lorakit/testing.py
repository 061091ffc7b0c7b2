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

import os
from pathlib import Path

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
    "build_tiny_gemma3_multimodal",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "resolve_model_source",
    "tiny_config",
]


# The hub's Gemma 3 multimodal checkpoints (google/gemma-3-4b-it and up) name their tensors
# language_model.model.*, vision_tower.vision_model.* and multi_modal_projector.*; transformers 5 renames
# them on loading (its checkpoint conversion mapping) and, for a model built from scratch, saves the vision
# tower without `vision_model.`: put it back, so the tiny checkpoint is stored as the real ones are.
_HUB_VISION_PREFIX = ("vision_tower.", "vision_tower.vision_model.")


def build_tiny_gemma3_multimodal(path: str | os.PathLike, seed: int = 0):
    """A tiny Gemma3ForConditionalGeneration (the class gemma-3-4b/12b/27b-it are) in `path`, with its
    tokenizer (tiny:gemma3's) and generation config: the tiny Gemma 3 language model, a small SigLIP vision
    tower (one layer, 28-pixel images of 14-pixel patches) and the projector, saved under the hub
    checkpoints' key names; returns the model."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = build_tiny_tokenizer(path, kind="gemma3")
    text = tiny_config("gemma3").to_dict()
    n = len(tokenizer)
    # The image tokens come after the text vocabulary, as in the real checkpoints (262144 of 262208).
    text["vocab_size"] = n + 3
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14, vision_use_head=False)  # fmt: skip
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          boi_token_index=n, eoi_token_index=n + 1, image_token_index=n + 2)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma3ForConditionalGeneration(config)
        with torch.no_grad():
            # As the tiny causal models' heads (families/decoder.init_tiny_head): logits of order 1-10.
            torch.nn.init.normal_(model.lm_head.weight, std=config.text_config.hidden_size**-0.5)
    model.save_pretrained(str(path))
    weights = Path(path) / "model.safetensors"
    old, new = _HUB_VISION_PREFIX
    tensors = {
        (new + k[len(old) :] if k.startswith(old) and not k.startswith(new) else k): v
        for k, v in load_file(str(weights)).items()
    }
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return model
