"""Choosing the fastest attention backend the hardware, the installed packages and the model allow."""

from __future__ import annotations

import importlib.util

import torch

from lorakit.errors import RecipeError
from lorakit.model.families import family_for_type


def flash_attn_available() -> bool:
    """flash-attn is installed and a CUDA GPU is present."""
    return importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


def choose_attention(requested: str, model_cls) -> str:
    """The attn_implementation to load `model_cls` with.

    auto: flash_attention_2 when flash-attn is importable, a GPU is present and the model supports it;
    else sdpa when the model supports it; else eager. A forced backend the model or machine cannot run
    is an error naming model.attention. `model_cls` None (transformers maps no class to the config: remote
    code): auto takes eager, which every model runs; a forced backend is left to transformers to check.
    """
    if model_cls is None:
        return "eager" if requested == "auto" else requested
    supports = {
        "flash_attention_2": bool(getattr(model_cls, "_supports_flash_attn", False)),
        "sdpa": bool(getattr(model_cls, "_supports_sdpa", False)),
        "eager": True,
    }
    if requested == "auto":
        if supports["flash_attention_2"] and flash_attn_available():
            return "flash_attention_2"
        return "sdpa" if supports["sdpa"] else "eager"
    if not supports[requested]:
        raise RecipeError(f"model.attention: {model_cls.__name__} does not support {requested}")
    if requested == "flash_attention_2" and not flash_attn_available():
        raise RecipeError(
            "model.attention: flash_attention_2 needs a CUDA GPU and flash-attn (pip install 'lorakit[flash]')"
        )
    return requested


def packing_enabled(
    setting: bool | str, attention: str, is_encoder_decoder: bool, model_type: str | None = None
) -> bool:
    """data.packing resolved, as the model family allows (lorakit.model.families.Family.packs). `auto`
    packs causal LMs on every backend (varlen flash, per-example SDPA, masks) and T5-family encoder-decoders
    on sdpa or eager (per-example SDPA, or masks); other encoder-decoders (BART & co., whose absolute
    position embeddings would run across the row) and backends train on length-grouped padded batches.
    `true` where packing is not exact is a recipe error."""
    family = family_for_type(model_type, is_encoder_decoder)
    packable = family.packs(attention)
    if setting is True and not packable:
        why = f"{model_type!r} models" if not family.packed.backends else f"the {attention} backend"
        raise RecipeError(
            "data.packing: true packs encoder-decoders of the T5 family (relative position bias) on sdpa or "
            f"eager attention only, not {why}; set data.packing: auto (length-grouped padded batches here)",
            doc="docs/packing.md#encoder-decoder-packing-flan-t5",
        )
    return packable if setting == "auto" else bool(setting)


def set_attention_dropout(model: torch.nn.Module, p: float) -> int:
    """model.attention_dropout: the attention-probability dropout of every attention module of `model`;
    returns how many modules it set.

    T5's attention modules read it from their float `dropout` (set from config.dropout_rate, which also
    drives the hidden-state nn.Dropout modules, left as they are); Llama-style modules from their float
    `attention_dropout`. Both are read at each forward, so setting them is configuration, not a patch."""
    count = 0
    for module in model.modules():
        for name in ("dropout", "attention_dropout"):
            # T5Attention.dropout is a float; elsewhere `dropout` is usually an nn.Dropout, which stays.
            if isinstance(getattr(module, name, None), float) and _is_attention(module):
                setattr(module, name, float(p))
                count += 1
    return count


def _is_attention(module: torch.nn.Module) -> bool:
    # T5Attention (compute_bias, n_heads) and transformers' Llama-style attention (q_proj / k_proj).
    return hasattr(module, "compute_bias") or (hasattr(module, "q_proj") and hasattr(module, "k_proj"))
