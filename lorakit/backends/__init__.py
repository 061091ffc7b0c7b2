"""Sharding backends (distributed.strategy), behind lorakit's Backend and Engine types (backends/base.py).

`BACKENDS` maps each strategy to a function of (recipe, device kind) that builds its Backend; each
backend's module (and its library: DeepSpeed, torch.distributed.fsdp) is imported only when a run asks for
it. `RECIPE_CHECKS` maps it to its checks of a validated recipe (torch-free modules, run whenever a recipe
validates) and the distributed section only it reads. Everything strategy-specific is asked of the backend:
no code outside lorakit.backends compares distributed.strategy. A new backend is its modules here and one
entry in each table (with its recipe value in recipe/distributed_section.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lorakit.backends import deepspeed_config, fsdp_recipe
from lorakit.backends.base import Backend, Engine, IncompleteSaveError, StepResult


def _deepspeed(recipe, device_type: str | None) -> Backend:
    from lorakit.backends.deepspeed import DeepSpeedBackend

    return DeepSpeedBackend(recipe)


def _fsdp(recipe, device_type: str | None) -> Backend:
    from lorakit.backends.fsdp import FsdpBackend

    return FsdpBackend(recipe, device_type)


# distributed.strategy -> its Backend's builder.
BACKENDS: dict[str, Callable[[Any, str | None], Backend]] = {"deepspeed": _deepspeed, "fsdp": _fsdp}

# distributed.strategy -> (its checks of a validated recipe, the distributed section only it reads or None).
RECIPE_CHECKS: dict[str, tuple[Callable[[Any], None], str | None]] = {
    "deepspeed": (deepspeed_config.check_recipe, None),
    "fsdp": (fsdp_recipe.check_recipe, "fsdp"),
}


def check_recipe(recipe) -> None:
    """ValueError for what the recipe's backend cannot train: another strategy's section set (it would be
    ignored), then the backend's own checks. Run by the recipe's validation (install_recipe_checks)."""
    d = recipe.distributed
    for strategy, (_, section) in RECIPE_CHECKS.items():
        if section is not None and strategy != d.strategy:
            if getattr(d, section) != type(d).model_fields[section].default:
                raise ValueError(
                    f"distributed.{section} is read only with distributed.strategy: {strategy}; set the "
                    "strategy or remove it"
                )
    RECIPE_CHECKS[d.strategy][0](recipe)


def install_recipe_checks() -> None:
    """Make the recipe's validation run check_recipe (lorakit/__init__.py does, when lorakit is imported)."""
    from lorakit.recipe.distributed_section import install_backend_checks

    install_backend_checks(check_recipe, (check_recipe, *(check for check, _ in RECIPE_CHECKS.values())))


def device_kind() -> str:
    """Where the run's tensors live, as torch names the device type: `cpu` or `cuda` (what DeepSpeed's
    accelerator detection says, so DS_ACCELERATOR=cpu keeps a GPU machine's run on the CPU)."""
    from lorakit.backends.deepspeed import device_kind as kind

    return kind()


def backend_for(recipe, device_type: str | None = None) -> Backend:
    """The recipe's backend (distributed.strategy); `device_type` where its tensors live (cpu, cuda), found
    with device_kind() when first needed if not given (planning and checks never need it)."""
    return BACKENDS[recipe.distributed.strategy](recipe, device_type)


def run_label(summary: dict[str, Any]) -> str | None:
    """How a run was sharded, from its summary.json: the backend's `label` (ZeRO-3, FSDP2 full sharding);
    runs written before summaries had `backend` say only their strategy and zero_stage."""
    described = summary.get("backend") or {}
    if described.get("label"):
        return described["label"]
    if summary.get("strategy") == "fsdp":
        return "FSDP2"
    return f"ZeRO-{summary['zero_stage']}" if summary.get("zero_stage") is not None else None


__all__ = [
    "BACKENDS",
    "RECIPE_CHECKS",
    "Backend",
    "Engine",
    "IncompleteSaveError",
    "StepResult",
    "backend_for",
    "check_recipe",
    "device_kind",
    "install_recipe_checks",
    "run_label",
]
