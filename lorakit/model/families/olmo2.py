"""OLMo 2: Llama's sizes with RMS norms after attention and MLP (not before) and q/k norms over the whole
projection width; untied head. All act per token, so packing is exact on every kernel."""

from lorakit.model.families.decoder import causal_family, causal_tiny

FAMILY = causal_family("olmo2", causal_tiny("Olmo2Config", "Olmo2ForCausalLM", tie_word_embeddings=False))
