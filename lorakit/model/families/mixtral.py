"""Mixtral (8x7B, 8x22B): Mistral's attention with a sparse MoE block (8 experts, top 2) in every layer."""

from lorakit.model.families.moe import moe_family, tiny_moe

FAMILY = moe_family(
    "mixtral",
    tiny_moe("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2),
    block="MixtralSparseMoeBlock",
    router="MixtralTopKRouter",
)
