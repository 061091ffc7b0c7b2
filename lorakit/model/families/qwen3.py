"""Qwen3 (dense): Llama's block with per-head RMS norms on queries and keys (q_norm, k_norm) and no q/k/v
bias; sliding-window layers only where `use_sliding_window` sets `layer_types` (the window reaches the packed
kernels per layer). Qwen2.5 is model type qwen2 (lorakit.model.families.qwen2). Small checkpoints (0.6B to
4B) tie the head; 8B and up do not. q/k norms act per token and head: packing leaves them exact."""

from lorakit.model.families.decoder import causal_family, causal_tiny

# head_dim: Qwen3's config defaults it to 128 whatever the hidden size; the tiny model keeps 64 / 4 heads.
FAMILY = causal_family(
    "qwen3", causal_tiny("Qwen3Config", "Qwen3ForCausalLM", tie_word_embeddings=True, head_dim=16)
)
