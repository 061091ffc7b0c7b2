"""Adapters for the export tests: a tiny base model with a LoRA adapter whose B is not zero (so merged and
base differ), saved as peft saves it, without training."""

from __future__ import annotations

from pathlib import Path

import torch

from lorakit.testing import resolve_model_source

TARGETS = {"t5": ["q", "v"], "default": ["q_proj", "v_proj"]}


def random_adapter(kind: str, cache_dir: Path, out: Path, seed: int = 1, **lora) -> Path:
    """A LoRA adapter for tiny:`kind` in `out` (its base_model_name_or_path: the tiny model's directory)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    base = resolve_model_source(f"tiny:{kind}", cache_dir)
    seq2seq = AutoConfig.from_pretrained(base).is_encoder_decoder
    model = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(base)
    lora.setdefault("target_modules", TARGETS.get(kind, TARGETS["default"]))
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(str(out))
    return out
