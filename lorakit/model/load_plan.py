"""How build_model loads the base model, as the run's backend plans it (lorakit.backends' Backend.load_plan).

The type lives here, below the backends, so that model/ reads a plan without knowing which backend made it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class LoadPlan:
    """One of three ways to load: `whole` (every process loads the whole model), `partitioned` (each rank
    materialises only its partition while loading: DeepSpeed ZeRO-3's zero.Init under `zero_config`) or
    `meta` (the structure only, on the meta device: the backend fills each rank's shards once the model is
    sharded, as FSDP2's sharded loading does)."""

    kind: Literal["whole", "partitioned", "meta"] = "whole"
    # kind partitioned: the DeepSpeed config the partitioned init runs under (transformers' HfDeepSpeedConfig).
    zero_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if (self.kind == "partitioned") != (self.zero_config is not None):
            raise ValueError(
                f"LoadPlan {self.kind!r}: a zero_config goes with kind partitioned, and only with it"
            )

    @classmethod
    def partitioned(cls, zero_config: dict[str, Any]) -> LoadPlan:
        """Each rank materialises only its partition while loading, under DeepSpeed config `zero_config`."""
        return cls("partitioned", zero_config)

    @classmethod
    def meta(cls) -> LoadPlan:
        """The structure only, on the meta device; the backend reads each rank's shards after sharding."""
        return cls("meta")


# Every process loads the whole model.
WHOLE = LoadPlan()
