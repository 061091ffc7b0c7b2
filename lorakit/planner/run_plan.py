"""The plan of a run that trained: lorakit.plan for its launch shape, data lengths and device, which
lorakit.api hands the job (engine/job.run_job) so summary.json records it beside what was measured."""

from __future__ import annotations

import os
from typing import Any

from lorakit.planner.core import plan


def plan_of_run(recipe, config, data, world: int, device_kind: str) -> dict[str, Any]:
    """lorakit.plan for this run (its launch shape, data lengths and device), recorded in summary.json so
    every run checks the planner; a model the planner does not know gives {"error": ...}, never a crash."""
    import torch

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gpu_memory = torch.cuda.get_device_properties(0).total_memory if device_kind == "cuda" else None
    try:
        return plan(
            recipe,
            gpus=local,
            nodes=max(world // local, 1),
            config=config,
            device=device_kind,
            gpu_memory=gpu_memory,
            seq_len=data.lengths.max_source_length or data.lengths.max_length,
            target_len=data.lengths.max_target_length,
        ).to_dict()
    except Exception as e:  # noqa: BLE001 - the plan is a report; training already succeeded
        return {"error": f"{type(e).__name__}: {e}"}
