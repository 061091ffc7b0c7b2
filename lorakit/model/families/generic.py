"""The family of an architecture no registered family claims: its sizes read from the common config
attributes (transformers' standard names, then the usual alternatives), the behaviour lorakit gave such
models before families existed, and the contracts nothing has proven for it named in `unproven`, which
the model build warns with and the planner and doctor can print."""

from __future__ import annotations

from collections.abc import Sequence

from lorakit.model.families.base import (
    PACKED_ISOLATION,
    PLANNER_SHAPES,
    TILED_LOSS,
    TILED_MLP,
    Family,
    Shape,
    dense_decoder_mlp,
    max_length,
    packed,
    read,
)
from lorakit.model.families.decoder import CAUSAL_PACKING, decoder_shape

# Causal LMs without a family yet whose forward computes logits = lm_head(last hidden states) and nothing
# more (transformers 5.x, read from their modeling code): the tiled loss is exact for them. Gemma 2,
# Granite and Cohere scale or cap their logits and are left to the untiled path. Each moves into a family of
# its own as one is added.
HEAD_ONLY_LOGITS = frozenset({"mixtral", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "gemma", "olmo2"})


def encoder_decoder_shape(config, linear_names: Sequence[str]) -> Shape:
    """The Shape of an encoder-decoder config in T5's names, else BART's and transformers' common ones."""
    hidden = read(config, "d_model", "hidden_size")
    heads = read(config, "num_heads", "encoder_attention_heads", "num_attention_heads")
    layers = read(config, "num_layers", "encoder_layers", "num_hidden_layers")
    rate = float(read(config, "dropout_rate", "dropout", default=0.0) or 0.0)
    act = read(config, "dense_act_fn", "activation_function", "hidden_act", default="relu")
    return Shape(
        vocab=int(read(config, "vocab_size")),
        hidden=hidden,
        ffn=read(config, "d_ff", "encoder_ffn_dim", "intermediate_size", default=None) or 4 * hidden,
        gated_mlp=bool(getattr(config, "is_gated_act", False))
        or any(n.endswith(("gate_proj", "wi_0")) for n in linear_names),
        layers=layers,
        decoder_layers=read(config, "num_decoder_layers", "decoder_layers", default=None) or layers,
        heads=heads,
        kv_heads=heads,
        head_dim=read(config, "d_kv", "head_dim", default=None) or hidden // heads,
        max_length=max_length(config),
        dropout=rate,
        attention_dropout=float(read(config, "attention_dropout", default=rate) or 0.0),
        python_gelu=act in ("gelu_new", "gelu_pytorch_tanh_python"),
        # T5 v1.1-style models keep a separate head that transformers 5 ties on the meta model anyway.
        tied_head=False if getattr(config, "scale_decoder_outputs", True) is False else None,
    )


def generic_family(model_type: str | None, encoder_decoder: bool) -> Family:
    """The family standing in for `model_type`, which no registered family claims.

    Causal LMs pack on every backend and tile their dense MLPs, as lorakit did for any causal LM before
    families: whether the model's attention keeps packed examples apart and whether its MLPs are
    token-wise is not proven. Encoder-decoders never pack. The tiled loss applies only where the logits are
    known to be the head's output (HEAD_ONLY_LOGITS)."""
    head_only = model_type in HEAD_ONLY_LOGITS
    unproven = []
    if not encoder_decoder:
        unproven += [PACKED_ISOLATION, TILED_MLP] if head_only else [PACKED_ISOLATION, TILED_LOSS, TILED_MLP]
    unproven.append(PLANNER_SHAPES)
    return Family(
        name="generic",
        model_types=(model_type,) if model_type else (),
        encoder_decoder=encoder_decoder,
        shape=encoder_decoder_shape if encoder_decoder else decoder_shape,
        packed=packed(()) if encoder_decoder else CAUSAL_PACKING,
        tiled_loss=head_only and not encoder_decoder,
        tiled_mlp=None if encoder_decoder else dense_decoder_mlp,
        unproven=tuple(unproven),
    )
