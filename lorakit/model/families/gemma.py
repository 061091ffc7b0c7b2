"""Gemma 2 and Gemma 3: decoder-only, tied head, large heads (head_dim 256 whatever the width, scaled by
query_pre_attn_scalar), layers alternating sliding-window and full attention (`config.layer_types`: Gemma 2
one in two, Gemma 3 five sliding to one full), whose window reaches every packed path per layer.

Gemma 2 caps attention scores (attn_logit_softcapping: tanh(s / c) * c before the softmax) and its final
logits (final_logit_softcapping). torch's varlen flash kernel has no soft-capping, so Gemma 2's packed rows
never take it (its kernel table lists none; lorakit's per-example loop caps the scores itself); transformers
runs it on eager or flash_attention_2 (which caps), never SDPA. The capped logits are not the head's output:
no tiled loss. Gemma 3 caps neither (its checkpoints set both to null) and adds q/k norms.

Gemma 3's multimodal checkpoints (model type gemma3, Gemma3ForConditionalGeneration: Gemma-3-4B and up)
hold the language model's sizes in `text_config`; the planner and the packed masks read them there
(lorakit.model.families.base.text_config). Text fine-tuning adapts their language model only, never the
vision tower or the projector (`towers`, lorakit.model.families.multimodal); lorakit.testing's
build_tiny_gemma3_multimodal builds one with a small SigLIP tower, saved in the hub's key names. Gemma-3-1B
and 270M are text-only (gemma3_text)."""

from dataclasses import replace

from lorakit.model.families.base import ALL_BACKENDS, packed
from lorakit.model.families.decoder import CAUSAL_PACKING, TINY_SLIDING_WINDOW, causal_family, causal_tiny

# The tiny models' large-head traits at tiny size: head_dim 16 set explicitly (not hidden / heads) and the
# query scale from query_pre_attn_scalar, one sliding and one full layer.
_TINY = dict(
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=TINY_SLIDING_WINDOW,
    layer_types=["sliding_attention", "full_attention"],
    tie_word_embeddings=True,
)

# Gemma 2: packs on every backend (eager masks, flash_attention_2 from restarting positions, lorakit's loop
# for sequence-parallel rows), never through varlen_attn, which would drop the soft-capping.
GEMMA2 = causal_family(
    "gemma2",
    causal_tiny(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        **_TINY,
    ),
    attention=packed(ALL_BACKENDS),
    tiled_loss=False,
)

GEMMA3 = replace(
    causal_family(
        "gemma3",
        causal_tiny("Gemma3TextConfig", "Gemma3ForCausalLM", **_TINY),
        model_types=("gemma3_text", "gemma3"),
        attention=CAUSAL_PACKING,
    ),
    # Gemma3ForConditionalGeneration's modules besides the language model (model.vision_tower: SigLIP;
    # model.multi_modal_projector), left alone by text fine-tuning (lorakit.model.families.multimodal).
    towers=("vision_tower", "multi_modal_projector"),
)
