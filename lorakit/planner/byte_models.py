"""The planner's byte models of the model states, as a backend picks one and parameterises it
(lorakit.backends.facts.ByteModels; Backend.planned_states): ZeRO's (states.py) and FSDP2's (fsdp.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lorakit.planner.arch import Arch
from lorakit.planner.fsdp import fsdp_states
from lorakit.planner.states import Item, Setup, counts, model_states


@dataclass(frozen=True)
class PlannedBytes:
    """The byte models for one setup of `recipe` on `world` processes, in `dtype_bytes` per weight."""

    arch: Arch
    recipe: Any
    setup: Setup
    world: int
    dtype_bytes: int

    def zero(self, ds_config: dict[str, Any], *, partitioned_init: bool) -> list[Item]:
        """DeepSpeed ZeRO's states under `ds_config` (ZeRO-3 keeps parameters below its persistence threshold
        whole on every rank)."""
        zero = ds_config["zero_optimization"]
        threshold = (
            int(zero.get("stage3_param_persistence_threshold", 1e5)) if self.setup.zero_stage == 3 else None
        )
        c = counts(self.arch, self.recipe.method, self.dtype_bytes, threshold)
        return model_states(c, self.setup, world=self.world, dtype_bytes=self.dtype_bytes, ds_config=ds_config,
                            partitioned_init=partitioned_init)  # fmt: skip

    def fsdp(self, *, shard_group: int, sharded_load: bool) -> list[Item]:
        """FSDP2's states sharded over `shard_group` ranks."""
        c = counts(self.arch, self.recipe.method, self.dtype_bytes, None)
        return fsdp_states(self.arch, self.recipe, c, self.setup, world=shard_group, dtype_bytes=self.dtype_bytes,
                           sharded_load=sharded_load)  # fmt: skip
