"""The sharding backend's line of the environment section: for distributed.strategy fsdp, whether this torch
has FSDP2 and the device mesh the run will shard over."""

from __future__ import annotations

from lorakit.doctor.result import CheckResult, failed, passed, skipped

SECTION = "environment"
NAME = "fsdp"


def fsdp_backend(recipe) -> CheckResult:
    """Skipped unless the recipe asks for FSDP2; else torch's fully_shard and the planned mesh."""
    if recipe is None or recipe.distributed.strategy != "fsdp":
        return skipped(SECTION, NAME, "the recipe trains on DeepSpeed (distributed.strategy: deepspeed)")
    import torch

    try:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as e:
        return failed(
            SECTION,
            NAME,
            f"torch {torch.__version__} has no FSDP2: {e}",
            "distributed.strategy: fsdp cannot start",
            "install torch 2.6 or newer (lorakit is tested with 2.13), or use distributed.strategy: deepspeed",
        )
    d = recipe.distributed
    procs = d.num_processes
    if d.fsdp.sharding == "full":
        mesh = f"full sharding over {procs} process(es) per node (x nodes)"
    else:
        shard = d.fsdp.shard_size or procs
        mesh = f"hybrid: shard groups of {shard}, replicated {procs // shard}x per node (x nodes)"
    offload = ", parameters and optimizer state offloaded to CPU" if d.fsdp.cpu_offload else ""
    return passed(SECTION, NAME, f"torch {torch.__version__} fully_shard; {mesh}{offload}")
