"""The recipe's distributed.fsdp section (distributed.strategy fsdp: PyTorch FSDP2) and the checks that refuse
what FSDP2 cannot do, naming the alternative."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lorakit.recipe.section import Section

# DeepSpeed-only keys of the distributed section and, for each, what to use with FSDP2 instead.
_DEEPSPEED_ONLY = {
    "offload_optimizer": "distributed.fsdp.cpu_offload: true (parameters, gradients and optimizer state)",
    "offload_params": "distributed.fsdp.cpu_offload: true",
    "nvme_path": "distributed.fsdp.cpu_offload: true (FSDP2 offloads to CPU memory, not to a disk)",
    "hpz_partition_size": "distributed.fsdp.sharding: hybrid (shards within a node, replicates across nodes)",
    "quantized_weights": "strategy deepspeed (FSDP2 all-gathers parameters in their own dtype)",
    "quantized_gradients": "strategy deepspeed (FSDP2 reduce-scatters gradients in float32)",
}


class FsdpSection(Section):
    """PyTorch FSDP2 (distributed.strategy: fsdp): each decoder (and encoder) block and then the whole model
    is sharded with torch's fully_shard; parameters are gathered per block for its forward and backward.
    See docs/backends.md."""

    sharding: Literal["full", "hybrid"] = Field(
        "full",
        description="full: every parameter, gradient and optimizer state is sharded over all processes (as "
        "ZeRO-3). hybrid: sharded within groups of fsdp.shard_size processes and replicated across the "
        "groups, so the per-block all-gathers stay inside a node: for nodes without a fast interconnect.",
    )
    shard_size: int | None = Field(
        None,
        ge=1,
        description="sharding hybrid: processes per shard group (consecutive ranks, meant to be one node). "
        "null: the processes per node (the launcher's local world size). Must divide the number of "
        "processes.",
    )
    cpu_offload: bool = Field(
        False,
        description="Keep the sharded parameters, their gradients and the optimizer state in CPU memory "
        "between uses (torch's CPUOffloadPolicy); the optimizer step runs on the CPU.",
    )

    @model_validator(mode="after")
    def _check(self) -> FsdpSection:
        if self.shard_size is not None and self.sharding != "hybrid":
            raise ValueError(
                "distributed.fsdp.shard_size applies to sharding: hybrid; remove it or set hybrid"
            )
        return self


def check_fsdp(recipe) -> None:
    """ValueError for what distributed.strategy fsdp cannot be combined with (and for an fsdp section
    without it); `recipe`: the validated Recipe."""
    d = recipe.distributed
    if d.strategy != "fsdp":
        if d.fsdp != FsdpSection():
            raise ValueError(
                "distributed.fsdp is read only with distributed.strategy: fsdp; set the strategy or remove it"
            )
        return
    # By value, not by whether it was given: a resolved recipe.yaml spells every default out.
    defaults = type(d).model_fields
    for key, instead in _DEEPSPEED_ONLY.items():
        if getattr(d, key) != defaults[key].default:
            raise ValueError(
                f"distributed.{key} is a DeepSpeed ZeRO option that strategy fsdp does not have; use {instead}"
            )
    if d.zero_stage != 3:
        raise ValueError(
            f"distributed.zero_stage {d.zero_stage} is a DeepSpeed setting: strategy fsdp always shards "
            "parameters, gradients and optimizer state (as ZeRO-3); remove zero_stage (or set 3), or use "
            "strategy deepspeed for ZeRO stage 0-2"
        )
    shard = d.fsdp.shard_size
    if shard is not None and d.num_processes > 1 and d.num_processes % shard:
        raise ValueError(
            f"distributed.fsdp.shard_size {shard} must divide the processes per node (distributed."
            f"num_processes {d.num_processes}): a shard group is meant to be one node's processes"
        )
