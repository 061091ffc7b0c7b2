"""T5Gemma: an encoder-decoder built from Gemma 2 (google/t5gemma-*): rotary positions, grouped KV heads, a
gated GELU MLP, alternating sliding-window and full attention layers in both stacks, soft-capped attention
scores and logits. Its config holds one sub-config per stack (`encoder`, `decoder`).

Packing is exact on eager attention through explicit masks (lorakit.model.stacked_masks): per example and
per layer type (the window inside each example) in the encoder and the decoder, cross-attention to the
example's own encoder tokens, and rotary positions restarting at 0 in every example of both rows. sdpa drops
the attention soft-capping T5Gemma was trained with, so lorakit packs on eager only; on sdpa and flash
attention it trains on length-grouped padded batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lorakit.model.families.base import TINY_MAX_LENGTH, Family, Shape, Tiny, packed, read


def t5gemma_shape(config, linear_names: Sequence[str] = ()) -> Shape:
    """The sizes of the encoder's sub-config (the decoder's layers from its own); gated GELU (tanh, a fused
    op); the head tied to the embedding as the config says."""
    enc, dec = config.encoder, config.decoder
    heads = read(enc, "num_attention_heads")
    return Shape(
        vocab=int(read(config, "vocab_size")),
        hidden=read(enc, "hidden_size"),
        ffn=read(enc, "intermediate_size"),
        gated_mlp=True,
        layers=read(enc, "num_hidden_layers"),
        decoder_layers=read(dec, "num_hidden_layers"),
        heads=heads,
        kv_heads=read(enc, "num_key_value_heads", default=None) or heads,
        head_dim=read(enc, "head_dim", default=None) or read(enc, "hidden_size") // heads,
        max_length=read(enc, "max_position_embeddings", default=None),
        dropout=float(getattr(config, "dropout_rate", 0.0) or 0.0),
        attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
        python_gelu=False,
        tied_head=bool(getattr(config, "tie_word_embeddings", True)),
    )


# tiny:t5gemma's window: small, so rows of the tests' lengths cross it in the sliding layers.
TINY_SLIDING_WINDOW = 8


def _tiny_config(vocab_size: int, bos: int, **shape: Any):
    from transformers import T5GemmaConfig

    # Configured as google/t5gemma-* ship: pad 0, eos 1, and the decoder starting on its bos (lorakit's <s>
    # here, 2 in Gemma's vocabulary), which differs from pad; no decoder_start_token_id anywhere.
    stack = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                 sliding_window=TINY_SLIDING_WINDOW, max_position_embeddings=TINY_MAX_LENGTH,
                 pad_token_id=0, eos_token_id=1, bos_token_id=bos)  # fmt: skip
    return T5GemmaConfig(encoder=dict(stack), decoder=dict(stack), vocab_size=vocab_size)


def _tiny_model(config):
    from transformers import T5GemmaForConditionalGeneration

    return T5GemmaForConditionalGeneration(config)


# Packed on eager only (module docstring); the tiled loss and MLP are for causal LMs' long rows.
FAMILY = Family(
    "t5gemma",
    ("t5gemma",),
    True,
    t5gemma_shape,
    packed({"eager"}),
    tiled_loss=False,
    tiled_mlp=None,
    tiny=Tiny(tokenizer="t5", config=_tiny_config, model=_tiny_model),
    # transformers' T5Gemma shifts labels right onto the decoder's bos (its config has no
    # decoder_start_token_id).
    decoder_start=("decoder.bos_token_id",),
)
