"""Qwen2 (Qwen2, Qwen2.5): Llama's block with biased q/k/v projections; small checkpoints tie the head."""

from lorakit.model.families.decoder import causal_family, causal_tiny

# Small Qwen2 checkpoints (0.5B, 1.5B) tie the output head to the input embedding.
FAMILY = causal_family("qwen2", causal_tiny("Qwen2Config", "Qwen2ForCausalLM", tie_word_embeddings=True))
