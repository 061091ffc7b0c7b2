"""Mistral: Llama's block with sliding-window attention (the window reaches the packed kernels through the
attention call's `sliding_window`)."""

from lorakit.model.families.decoder import causal_family, causal_tiny

# tiny:mistral's attention window: deliberately small, so sequences longer than it exercise sliding-window
# attention (real Mistral uses 4096).
TINY_SLIDING_WINDOW = 64

FAMILY = causal_family(
    "mistral",
    causal_tiny(
        "MistralConfig", "MistralForCausalLM", tie_word_embeddings=False, sliding_window=TINY_SLIDING_WINDOW
    ),
)
