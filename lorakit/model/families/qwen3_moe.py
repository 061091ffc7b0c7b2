"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (q/k norms) with 128 small experts, top 8.

Layers listed in `mlp_only_layers` (none in the public checkpoints) keep a dense MLP, which all-linear adapts
as a dense one."""

from lorakit.model.families.moe import moe_family, tiny_moe

FAMILY = moe_family(
    "qwen3_moe",
    tiny_moe(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        head_dim=16,
    ),  # fmt: skip
    block="Qwen3MoeSparseMoeBlock",
    router="Qwen3MoeTopKRouter",
)
