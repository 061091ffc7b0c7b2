"""Llama (Llama 2, Llama 3, 3.1): decoder-only, SwiGLU MLP, grouped KV heads, untied head."""

from lorakit.model.families.decoder import causal_family, causal_tiny

FAMILY = causal_family("llama", causal_tiny("LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=False))
