"""all_reduce bandwidth across the devices of this node (or the nodes of a launched group).

`python -m lorakit.doctor.allreduce OUT.json` runs on every rank under torchrun (the doctor starts it on
the local devices); inside a group a launcher made, `measure` runs in the doctor's own processes. The bus
bandwidth is NCCL-tests' busbw: 2 (n - 1) / n x bytes / seconds, what each link carries.
"""

from __future__ import annotations

import json
import sys
import time

import torch

# 256 MiB on GPUs (past the latency-bound sizes), 16 MiB on CPU (gloo is slow).
GPU_BYTES, CPU_BYTES = 256 << 20, 16 << 20


def measure(iters: int = 5) -> dict:
    """Time all_reduce of one large fp32 tensor in the current group; every rank returns the same numbers."""
    import torch.distributed as dist

    world = dist.get_world_size()
    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    nbytes = GPU_BYTES if cuda else CPU_BYTES
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(x)  # warm-up: connections and buffers
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / iters
    # The slowest rank sets the collective's time.
    t = torch.tensor([seconds], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    seconds = float(t)
    busbw = 2 * (world - 1) / world * nbytes / seconds
    return {"world": world, "bytes": nbytes, "seconds": seconds, "busbw_bytes_per_s": busbw,
            "backend": dist.get_backend()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Worker entry: join the launcher's group, measure, rank 0 writes the result to argv[0]."""
    import os

    import torch.distributed as dist

    out = (argv if argv is not None else sys.argv[1:])[0]
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    try:
        result = measure()
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
