"""Mistral: Llama's block with sliding-window attention (the window reaches the packed kernels through the
attention call's `sliding_window`)."""

from lorakit.model.families.decoder import TINY_SLIDING_WINDOW, causal_family, causal_tiny

__all__ = ["FAMILY", "TINY_SLIDING_WINDOW"]

FAMILY = causal_family(
    "mistral",
    causal_tiny(
        "MistralConfig", "MistralForCausalLM", tie_word_embeddings=False, sliding_window=TINY_SLIDING_WINDOW
    ),
)
