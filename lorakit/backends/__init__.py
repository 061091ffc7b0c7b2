"""Sharding backends (distributed.strategy), behind lorakit's Backend and Engine types (backends/base.py).

`BACKENDS` maps each strategy to a function of (recipe, device kind) that builds its Backend; each
backend's module (and its library: DeepSpeed, torch.distributed.fsdp) is imported only when a run asks for
it. A new backend is one module and one entry here (with its recipe value in recipe/schema.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lorakit.backends.base import Backend, Engine, IncompleteSaveError, StepResult


def _deepspeed(recipe, device_type: str) -> Backend:
    from lorakit.backends.deepspeed import DeepSpeedBackend

    return DeepSpeedBackend(recipe)


def _fsdp(recipe, device_type: str) -> Backend:
    from lorakit.backends.fsdp import FsdpBackend

    return FsdpBackend(recipe, device_type)


# distributed.strategy -> its Backend's builder.
BACKENDS: dict[str, Callable[[Any, str], Backend]] = {"deepspeed": _deepspeed, "fsdp": _fsdp}


def device_kind() -> str:
    """Where the run's tensors live, as torch names the device type: `cpu` or `cuda` (what DeepSpeed's
    accelerator detection says, so DS_ACCELERATOR=cpu keeps a GPU machine's run on the CPU)."""
    from lorakit.backends.deepspeed import accelerator_name

    return "cpu" if accelerator_name() == "cpu" else "cuda"


def backend_for(recipe) -> Backend:
    """The recipe's backend (distributed.strategy)."""
    return BACKENDS[recipe.distributed.strategy](recipe, device_kind())


__all__ = ["BACKENDS", "Backend", "Engine", "IncompleteSaveError", "StepResult", "backend_for", "device_kind"]
