"""T5 (FLAN-T5, T5 v1.1, mT5): encoder-decoder with relative position bias.

Packing is exact on sdpa and eager: the relative bias depends on distances inside an example only, which a
packed row leaves unchanged, and lorakit.model.varlen knows T5's attention modules (it hands each example
its own bias). Encoder and decoder self-attention carry the bias (compiled FlexAttention on CUDA); the
cross-attention has none (torch's varlen flash kernel)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lorakit.model.families.base import FLEX, TINY_MAX_LENGTH, VARLEN, Family, Shape, Tiny, max_length, packed


def t5_shape(config, linear_names: Sequence[str] = ()) -> Shape:
    """T5's names (d_model, d_ff, d_kv, num_heads); max length from n_positions (512 for FLAN-T5)."""
    rate = float(getattr(config, "dropout_rate", 0.0))
    return Shape(
        vocab=int(config.vocab_size),
        hidden=config.d_model,
        ffn=config.d_ff,
        gated_mlp=bool(getattr(config, "is_gated_act", False)),
        layers=config.num_layers,
        decoder_layers=getattr(config, "num_decoder_layers", None) or config.num_layers,
        heads=config.num_heads,
        kv_heads=config.num_heads,
        head_dim=config.d_kv,
        max_length=max_length(config),
        dropout=rate,
        attention_dropout=rate,
        python_gelu=getattr(config, "dense_act_fn", "relu") in ("gelu_new", "gelu_pytorch_tanh_python"),
        # FLAN-T5 / T5 v1.1 keep a separate head; transformers 5 ties it on the meta model anyway, and
        # lorakit's loading (model/untie.py) gives it back its own weights.
        tied_head=False if getattr(config, "scale_decoder_outputs", True) is False else None,
    )


def _tiny_config(vocab_size: int, bos: int, **shape: Any):
    from transformers import T5Config

    # FLAN-T5 / T5 v1.1: separate lm_head, no output scaling. transformers 5.x keeps the flag only as
    # `scale_decoder_outputs=False` and stores tie_word_embeddings=True; the untied lm_head is restored from
    # the checkpoint (see _tiny_model).
    return T5Config(vocab_size=vocab_size, d_model=64, d_ff=128, d_kv=16, num_layers=2, num_decoder_layers=2,
                    num_heads=4, relative_attention_num_buckets=32, relative_attention_max_distance=128,
                    feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
                    pad_token_id=0, eos_token_id=1, n_positions=TINY_MAX_LENGTH)  # fmt: skip


def _tiny_model(config):
    import torch
    from transformers import T5ForConditionalGeneration

    model = T5ForConditionalGeneration(config)
    # transformers 5.x always ties lm_head to the shared embedding for T5 (upstream PR #42815), but FLAN-T5
    # checkpoints carry their own lm_head, and from_pretrained keeps the two apart when both are saved with
    # different values. Mirror that layout so the tiny model exercises the same path.
    # std d_model**-0.5 (not T5's 1.0) keeps initial logits O(1), so a smoke run trains smoothly.
    lm_head = torch.empty_like(model.shared.weight)
    torch.nn.init.normal_(lm_head, std=config.d_model**-0.5)
    model.lm_head.weight = torch.nn.Parameter(lm_head)
    return model


FAMILY = Family(
    name="t5",
    model_types=("t5", "mt5"),
    encoder_decoder=True,
    shape=t5_shape,
    packed=packed({"sdpa", "eager"}, encoder=(FLEX,), decoder=(FLEX,), cross=(VARLEN,)),
    # The tiled loss and MLP are for causal LMs' long rows.
    tiled_loss=False,
    tiled_mlp=None,
    tiny=Tiny(tokenizer="t5", config=_tiny_config, model=_tiny_model),
    # T5 and mT5 checkpoints set decoder_start_token_id (0, their pad); T5 starts on pad where one does not.
    decoder_start=("decoder_start_token_id", "pad_token_id"),
)
