"""What a backend tells the rest of lorakit besides training: where it keeps the model states, in the
planner's words (`Layout`, and `ByteModels`, the planner's byte models a backend picks from), and whether
this machine can run it (`Readiness`, the doctor's line). Plain data: nothing here imports torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Layout:
    """Where a backend keeps the model states: the ZeRO stage whose partitioning it follows (FSDP2 shards as
    ZeRO-3 does) and where the optimizer state and the parameters live between uses (none: on the
    accelerator; cpu; nvme)."""

    zero_stage: int
    offload_optimizer: str
    offload_params: str


class ByteModels(Protocol):
    """The planner's models of the model states' bytes per rank, one per way of sharding (lorakit.planner
    implements them); a backend picks its own and gives it its parameters (Backend.planned_states)."""

    def zero(self, ds_config: dict[str, Any], *, partitioned_init: bool) -> Any:
        """DeepSpeed ZeRO's states under `ds_config`; `partitioned_init`: the model loads partitioned."""
        ...

    def fsdp(self, *, shard_group: int, sharded_load: bool) -> Any:
        """FSDP2's states sharded over `shard_group` ranks; `sharded_load`: each rank reads its own rows."""
        ...


@dataclass(frozen=True)
class Readiness:
    """Whether this machine can run the backend, as the doctor's line says it: `ready` None when the backend
    has nothing of its own to check (`detail` says why), else what was found and, when not ready, `action`."""

    ready: bool | None
    detail: str
    action: str = ""
