"""BART: encoder-decoder with learned absolute position embeddings, so a packed row would give its later
examples the wrong positions: it trains on length-grouped padded batches, never packed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lorakit.model.families.base import Family, Shape, Tiny, max_length, packed


def bart_shape(config, linear_names: Sequence[str] = ()) -> Shape:
    """BART's names (d_model, encoder_/decoder_ sizes); exact GELU (one activation), no gate."""
    heads = config.encoder_attention_heads
    return Shape(
        vocab=int(config.vocab_size),
        hidden=config.d_model,
        ffn=config.encoder_ffn_dim,
        gated_mlp=False,
        layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        heads=heads,
        kv_heads=heads,
        head_dim=config.d_model // heads,
        max_length=max_length(config),
        dropout=float(config.dropout or 0.0),
        attention_dropout=float(config.attention_dropout or 0.0),
        python_gelu=False,
    )


def _tiny_config(vocab_size: int, bos: int, **shape: Any):
    from transformers import BartConfig

    # lorakit's tiny tokenizer in T5's layout (pad 0, </s> 1): BART starts its decoder on pad here, as T5.
    sizes = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64)  # fmt: skip
    ids = dict(
        pad_token_id=0, eos_token_id=1, bos_token_id=1, decoder_start_token_id=0, forced_eos_token_id=1
    )
    return BartConfig(vocab_size=vocab_size, max_position_embeddings=512, **sizes, **ids)


def _tiny_model(config):
    from transformers import BartForConditionalGeneration

    return BartForConditionalGeneration(config)


FAMILY = Family(
    name="bart",
    model_types=("bart",),
    encoder_decoder=True,
    shape=bart_shape,
    packed=packed(()),
    tiled_loss=False,
    tiled_mlp=None,
    tiny=Tiny(tokenizer="t5", config=_tiny_config, model=_tiny_model),
)
