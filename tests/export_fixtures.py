"""Adapters for the export tests: a tiny base model with a LoRA adapter whose B is not zero (so merged and
base differ), saved as peft saves it, without training."""

from __future__ import annotations

from pathlib import Path

import torch

from lorakit.testing import resolve_model_source

TARGETS = {"t5": ["q", "v"], "default": ["q_proj", "v_proj"]}


def random_adapter(
    kind: str, cache_dir: Path, out: Path, seed: int = 1, base: str | None = None, scale: float = 0.3, **lora
) -> Path:
    """A LoRA adapter for tiny:`kind` (or the model directory `base`) in `out`; its base_model_name_or_path
    is that directory."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    base = base or resolve_model_source(f"tiny:{kind}", cache_dir)
    seq2seq = AutoConfig.from_pretrained(base).is_encoder_decoder
    model = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(base)
    lora.setdefault("target_modules", TARGETS.get(kind, TARGETS["default"]))
    peft_model = get_peft_model(model, LoraConfig(**{"r": 4, "lora_alpha": 8, **lora}))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    peft_model.save_pretrained(str(out))
    return out


def with_sentencepiece(cache_dir: Path, out: Path, kind: str = "llama") -> Path:
    """The tiny `kind` model copied to `out` with a SentencePiece tokenizer.model beside its tokenizer.json
    (the same special-token ids), which llama.cpp's converter accepts; its locally trained BPE tokenizer has
    no pre-tokenizer hash llama.cpp knows. The checks compare token ids, so the two vocabularies need not agree
    beyond the special tokens."""
    import io
    import shutil

    import sentencepiece as spm

    shutil.copytree(resolve_model_source(f"tiny:{kind}", cache_dir), out)
    words = "the city council met on tuesday to discuss a new park storm closed schools across region prices"
    lines = [" ".join(words.split()[i:] + words.split()[:i]) for i in range(len(words.split()))] * 20
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=120, model_type="bpe",
        pad_id=0, eos_id=1, unk_id=2, bos_id=3, hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    (out / "tokenizer.model").write_bytes(model.getvalue())
    return out


llama_with_sentencepiece = with_sentencepiece
