"""Choosing the fastest attention backend the hardware, the installed packages and the model allow."""

from __future__ import annotations

import importlib.util

import torch

from lorakit.errors import RecipeError


def flash_attn_available() -> bool:
    """flash-attn is installed and a CUDA GPU is present."""
    return importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


def choose_attention(requested: str, model_cls) -> str:
    """The attn_implementation to load `model_cls` with.

    auto: flash_attention_2 when flash-attn is importable, a GPU is present and the model supports it;
    else sdpa when the model supports it; else eager. A forced backend the model or machine cannot run
    is an error naming model.attention.
    """
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


def packing_enabled(setting: bool | str, attention: str, is_encoder_decoder: bool) -> bool:
    """data.packing resolved. `auto` packs causal LMs on every backend (varlen flash, per-example SDPA,
    masks). Encoder-decoders pack only when asked (`true`, on sdpa or eager): packed T5 is exact and its
    position bias is computed per example, but the committed benchmark (benchmarks/README.md,
    seq2seq_packing) did not measure the speed-up over random and length-grouped padded batches, at an
    eval loss as good, that would make it the default."""
    if setting != "auto":
        return bool(setting)
    return not is_encoder_decoder
