"""The recipe's distributed.fsdp section (distributed.strategy fsdp: PyTorch FSDP2). What FSDP2 refuses of the
rest of the recipe is the backend's check (lorakit.backends.fsdp_recipe)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lorakit.recipe.section import Section


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
