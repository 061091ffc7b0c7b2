"""Leaving lorakit's process group stops gloo's threads while Python is alive.

gloo's worker threads live as long as their process group object, and release each finished collective's
tensors themselves, which takes the GIL. A group still alive when the interpreter finalizes lets such a
thread take the GIL after finalization began: the process aborts ("terminate called without an active
exception", exit -6) after the job succeeded (seen in CI on 2-process runs, about 1 in 12 under load here).
Three things kept groups alive: torch.distributed.nn.functional, imported after the group existed (by
DeepSpeed's Ulysses or transformers' DeepSpeed integration), binds the default group as its functions'
defaults; a DeepSpeed engine holds its groups in reference cycles that only a collection frees; and DTensor's
sharding caches keep FSDP2's device mesh, which keeps its groups.
"""

import subprocess
import sys

import pytest

from tests.conftest import ROOT

_JOB = """
import atexit, os, sys

def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sorted(n for n in names if "gloo" in n or "tcpstore" in n)

# Registered first, so it runs after anything lorakit registers: what is left when Python finalizes.
atexit.register(lambda: print("at exit:", gloo_threads(), flush=True))

import torch
from lorakit.engine.launch import process_group

def engine():
    import deepspeed
    import torch.distributed.nn.functional  # as DeepSpeed's Ulysses imports it: after the group exists

    model = torch.nn.Linear(4, 4)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.backward(engine(torch.ones(1, 4)).sum())
    engine.step()
    return engine

with process_group("gloo"):
    engine()  # dropped at once: what remains is the engine's own reference cycles
print("after the job:", gloo_threads(), flush=True)

def sharded():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.ones(2, 4)).sum().backward()  # DTensor's caches now hold the mesh, and the mesh its group

with process_group("gloo"):
    sharded()
print("after FSDP2:", gloo_threads(), flush=True)

def worker():
    with process_group("gloo"):
        kept = engine()  # alive through the teardown, as test workers keep theirs in main()

worker()
"""


@pytest.mark.slow  # launches an interpreter
def test_leaving_the_group_stops_gloos_threads_before_python_finalizes():
    proc = subprocess.run([sys.executable, "-c", _JOB], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("after", "at exit:"))]
    assert lines == ["after the job: []", "after FSDP2: []", "at exit: []"], proc.stdout[-2000:]
