"""OLMoE (OLMoE-1B-7B): OLMo's attention (q/k norms) with 64 experts, top 8, in every layer."""

from lorakit.model.families.moe import moe_family, tiny_moe

FAMILY = moe_family(
    "olmoe",
    tiny_moe("OlmoeConfig", "OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2),
    block="OlmoeSparseMoeBlock",
    router="OlmoeTopKRouter",
)
