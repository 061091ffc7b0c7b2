"""The sharding backend's line of the environment section: what the recipe's backend says of this machine
(lorakit.backends: Backend.environment), e.g. for FSDP2 whether this torch has it and the device mesh the run
will shard over."""

from __future__ import annotations

from lorakit.doctor.result import CheckResult, failed, passed, skipped

SECTION = "environment"
NAME = "fsdp"


def fsdp_backend(recipe) -> CheckResult:
    """The recipe's backend's readiness: skipped where it has nothing of its own to check (DeepSpeed: the
    `deepspeed ops` line does), else what it found."""
    if recipe is None:
        return skipped(SECTION, NAME, "no recipe: the default backend, DeepSpeed, has no line of its own")
    from lorakit.backends import backend_for

    readiness = backend_for(recipe).environment()
    if readiness.ready is None:
        return skipped(SECTION, NAME, readiness.detail)
    if not readiness.ready:
        strategy = recipe.distributed.strategy
        return failed(
            SECTION,
            NAME,
            readiness.detail,
            f"distributed.strategy: {strategy} cannot start",
            readiness.action,
        )
    return passed(SECTION, NAME, readiness.detail)
