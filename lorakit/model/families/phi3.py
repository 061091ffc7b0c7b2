"""Phi-3 and Phi-4 (model type phi3, Phi-4 and Phi-4-mini included): fused projections, one qkv_proj for
queries, keys and values and one gate_up_proj for the SwiGLU's gate and up halves, so all-linear LoRA puts
one adapter on each fused matrix and a merge adds its delta to the fused weight as to any other (per tensor:
the streaming merge applies). Phi-3-mini-4k uses a sliding window on every layer (config.sliding_window),
which reaches the packed kernels and masks."""

from lorakit.model.families.decoder import TINY_SLIDING_WINDOW, causal_family, causal_tiny

FAMILY = causal_family(
    "phi3",
    causal_tiny(
        "Phi3Config", "Phi3ForCausalLM", tie_word_embeddings=False, sliding_window=TINY_SLIDING_WINDOW
    ),
)
