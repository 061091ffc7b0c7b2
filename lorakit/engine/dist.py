"""Small torch.distributed helpers that also work with a single process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def rank() -> int:
    """This process's global rank (0 when not distributed)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """Number of processes (1 when not distributed)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    """Whether this is rank 0, the process that writes the run directory."""
    return rank() == 0


def barrier() -> None:
    """Wait for every rank."""
    if dist.is_initialized():
        dist.barrier()


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Sum (or max) a few numbers across ranks, in float64 so token counts stay exact."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and world_size() > 1:
        # gloo reduces CPU tensors; nccl only reduces tensors on the GPU.
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        t = t.to(device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.cpu().tolist()


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order."""
    if not dist.is_initialized() or world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not dist.is_initialized() or world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
