"""What the Llama-style decoder-only families (Llama, Mistral, Qwen2, and the generic path for causal LMs)
share: how their config names their sizes, and the tiny model every one of them builds at the same size."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lorakit.model.families.base import (
    ALL_BACKENDS,
    VARLEN,
    Family,
    PackedAttention,
    Shape,
    Tiny,
    dense_decoder_mlp,
    max_length,
    packed,
    read,
    text_config,
)

# Causal rows pack exactly on every backend: flash_attention_2 through restarting position_ids, sdpa through
# lorakit's per-example kernel (torch's varlen flash on CUDA), eager through block-diagonal masks.
CAUSAL_PACKING = packed(ALL_BACKENDS, causal=(VARLEN,))
# The tiny sliding-window models' attention window (tiny:mistral, the sliding layers of tiny:gemma2 and
# tiny:gemma3): deliberately small, so sequences longer than it exercise sliding-window attention (the real
# models use 4096 or 1024).
TINY_SLIDING_WINDOW = 64


def decoder_shape(config, linear_names: Sequence[str]) -> Shape:
    """The Shape of a decoder-only config in transformers' common names (hidden_size, num_hidden_layers,
    num_attention_heads, ...; GPT-style configs map theirs onto these), read from the language model's
    config (a multimodal checkpoint's text_config)."""
    config = text_config(config)
    hidden = read(config, "hidden_size", "d_model", "n_embd")
    heads = read(config, "num_attention_heads", "num_heads", "n_head")
    return Shape(
        vocab=int(read(config, "vocab_size")),
        hidden=hidden,
        ffn=read(config, "intermediate_size", "n_inner", default=None) or 4 * hidden,
        # Llama, Mistral, Qwen2 and their kin: SwiGLU (gate, up, down); GPT-style MLPs have no gate.
        gated_mlp=any(n.endswith(("gate_proj", "gate_up_proj")) for n in linear_names),
        layers=read(config, "num_hidden_layers", "num_layers", "n_layer"),
        decoder_layers=0,
        heads=heads,
        kv_heads=read(config, "num_key_value_heads", default=None) or heads,
        head_dim=read(config, "head_dim", default=None) or hidden // heads,
        max_length=max_length(config),
        dropout=0.0,
        attention_dropout=float(read(config, "attention_dropout", default=0.0) or 0.0),
        python_gelu=False,
    )


def tiny_fields(vocab_size: int, bos: int, **shape: Any) -> dict[str, Any]:
    """The tiny decoder-only config's fields, the same for every causal family, unless `shape` replaces
    some of them (hidden_size, num_hidden_layers, ...)."""
    fields = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=bos, eos_token_id=1, pad_token_id=0)  # fmt: skip
    return {**fields, **shape}


def init_tiny_head(model):
    """`model` with its output head redrawn at std hidden**-0.5; returns it.

    The default init (std 0.02) caps logits near +-1 with hidden size 64, so the loss of a LoRA smoke run
    could barely fall; hidden**-0.5 (as for the tiny T5's head) gives logits of order 1-10. In place, so a
    tied embedding (Qwen2's) gets the same values."""
    import torch

    with torch.no_grad():
        torch.nn.init.normal_(model.lm_head.weight, std=model.config.hidden_size**-0.5)
    return model


def causal_tiny(config_cls: str, model_cls: str, **fixed: Any) -> Tiny:
    """The Tiny builder of a decoder-only family: transformers' `config_cls` with tiny_fields and `fixed`
    (tied head, window), `model_cls` with its head redrawn (init_tiny_head)."""

    def config(vocab_size: int, bos: int, **shape: Any):
        import transformers

        return getattr(transformers, config_cls)(**tiny_fields(vocab_size, bos, **shape), **fixed)

    def model(cfg):
        import transformers

        return init_tiny_head(getattr(transformers, model_cls)(cfg))

    return Tiny(tokenizer="causal", config=config, model=model, reshapable=True)


def causal_family(
    name: str,
    tiny: Tiny,
    model_types: tuple[str, ...] | None = None,
    *,
    attention: PackedAttention = CAUSAL_PACKING,
    tiled_loss: bool = True,
) -> Family:
    """A dense Llama-style decoder-only family: decoder_shape, packing on every backend with the kernels of
    `attention` (by default varlen and the loop), the tiled loss (where its logits are lm_head's output,
    nothing more) and the tiled MLP on its dense MLPs, no ZeRO-3 leaves."""
    dense = {"shape": decoder_shape, "packed": attention, "tiled_mlp": dense_decoder_mlp}
    return Family(
        name, model_types or (name,), encoder_decoder=False, tiled_loss=tiled_loss, tiny=tiny, **dense
    )
