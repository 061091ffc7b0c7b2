"""Process groups: join the one torchrun (or the deepspeed launcher) made, make a 1-process one, or
start torchrun when the recipe asks for more processes than there are."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def launched_distributed() -> bool:
    """Whether this process was started by torchrun, the deepspeed launcher or another env:// launcher."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_backend(requested: str) -> str:
    """nccl on GPUs, gloo on CPU, unless the recipe forces one."""
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


@contextlib.contextmanager
def process_group(backend: str = "auto", timeout_minutes: float | None = None) -> Iterator[None]:
    """Be inside a torch.distributed group that DeepSpeed also knows, for the duration of a job.

    `timeout_minutes` (distributed.timeout_minutes): how long a collective may wait for a rank before it
    fails with an error, on gloo as on NCCL, instead of hanging.

    Under a launcher the group comes from its environment; otherwise a private one-process group is made
    on a free loopback port (and torn down after), so `lorakit.train` works from a notebook.
    """
    import deepspeed
    import torch.distributed as dist

    backend = resolve_backend(backend)
    created = not dist.is_initialized()
    if created:
        _release_groups_before_python_exits()
    # DeepSpeed reads the launcher's variables (deepspeed.zero.Init indexes os.environ["LOCAL_RANK"]), so a
    # private group must provide them too; they are restored afterwards.
    saved = {k: os.environ.get(k) for k in _LAUNCH_VARS}
    if created and not launched_distributed():
        os.environ.update(
            {
                "RANK": "0",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()),
            }
        )
    succeeded = False
    try:
        if created:
            _init_deepspeed_distributed(backend, timeout_minutes)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        yield
        succeeded = True
    finally:
        if created and dist.is_initialized():
            # DeepSpeed's teardown also drops the groups it cached, so a later job in this process
            # (a second lorakit.train in a notebook) does not reach for a destroyed group.
            import deepspeed.comm

            deepspeed.comm.destroy_process_group()
            if succeeded:  # a failing job's error is printed first (lorakit.run then exits at once)
                _free_destroyed_groups()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _release_groups_before_python_exits() -> None:
    """Let every process group be freed, and its gloo threads stopped, while Python is still alive.

    gloo's worker threads live as long as their group object and release each finished collective's tensors
    themselves, taking the GIL; one that does so after the interpreter began finalizing aborts the process
    ("terminate called without an active exception") after a successful job. What kept groups alive that
    long: torch.distributed.nn.functional, which binds the default group as its functions' defaults when
    first imported after the group exists (DeepSpeed's Ulysses and transformers' DeepSpeed integration import
    it lazily), so it is imported before; engines holding their groups in reference cycles; and FSDP2's
    device meshes, which DTensor's caches keep (see _free_destroyed_groups, run at teardown and at exit).
    """
    import atexit

    import torch.distributed.nn.functional  # noqa: F401

    atexit.unregister(_before_python_exits)  # once however many groups this process makes
    atexit.register(_before_python_exits)


def _before_python_exits() -> None:
    """Free destroyed groups; where a group is still alive (something outside lorakit keeps it), give gloo's
    threads a moment with the GIL released to finish releasing their last collective, before finalization."""
    import time

    _free_destroyed_groups()
    try:
        tasks = Path("/proc/self/task")
        alive = any((t / "comm").read_text().strip() == "pt_gloo_runloop" for t in tasks.iterdir())
    except OSError:  # not Linux: no thread names to read
        alive = True
    if alive:
        time.sleep(0.1)


def _free_destroyed_groups() -> None:
    """Once torch.distributed has no group left, free what still holds a destroyed one: reference cycles
    (an engine and its model's hooks), and the group registries of device meshes that DTensor's sharding
    caches keep alive (a destroyed mesh cannot be used again, so nothing is lost)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    gc.collect()
    meshes = sys.modules.get("torch.distributed.device_mesh")
    if meshes is not None:
        for obj in gc.get_objects():
            # By the type's MRO, not isinstance: some objects' __instancecheck__ warns (torch's reduce_op).
            if meshes.DeviceMesh in type(obj).__mro__:
                registry = getattr(obj, "_pg_registry", None)
                if isinstance(registry, dict):
                    registry.clear()


def _init_deepspeed_distributed(backend: str, timeout_minutes: float | None = None) -> None:
    import datetime

    import deepspeed

    kwargs = {} if timeout_minutes is None else {"timeout": datetime.timedelta(minutes=timeout_minutes)}

    # DeepSpeed 0.19 print()s "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" from
    # every CPU process as it sets up its shared-memory collectives (deepspeed/comm/torch.py build_shm_op);
    # a failed build raises, so the line carries nothing. Anything else printed there is passed on.
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            deepspeed.init_distributed(dist_backend=backend, **kwargs)
    finally:
        kept = [line for line in captured.getvalue().splitlines(True) if "built successfully" not in line]
        sys.stdout.write("".join(kept))


# glibc serves an allocation above this many bytes with its own mmap, returned to the system when freed.
# Left unset, glibc raises the threshold (up to 32 MiB) each time such a block is freed, after which
# ZeRO-3's gathered layers and activations come from the heap and fragment it: measured on 2 CPU ranks at
# FLAN-T5-XL width, 2+2 layers (the retired benchmarks/rehearsal.py), each rank's private memory grew 1.0 GiB from step
# 2 to step 20 (peak 2.9 GiB) with glibc's default, 0.18 GiB (peak 1.9 GiB) with the threshold fixed at
# glibc's initial 128 KiB.
MALLOC_MMAP_THRESHOLD = 128 * 1024
# Entries kept in oneDNN's primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and in ideep's cache of matmul
# computations in front of it (LRU_CACHE_CAPACITY), through which torch runs bf16 matmuls on a CPU. Each new
# shape adds an entry to both (~0.25 MB together at FLAN-T5-XL width) up to 1024 each by default, so a run
# whose rows vary in length grew ~10 MB a step per rank until ~0.5 GiB (found with heaptrack on
# the retired benchmarks/rehearsal.py's run: 87% of what the step 3-7 window allocated and never freed came from
# them). A step of a transformer uses a few dozen distinct matmul shapes, so 64 keeps every reuse within a
# step and across steps of fixed-shape (packed) rows, and bounds the caches at ~30 MB.
ONEDNN_CACHE_CAPACITY = 64


def launch_env() -> dict[str, str]:
    """The environment for torchrun: this one, with OMP_NUM_THREADS=1 when it is unset (torchrun sets exactly
    that for each worker then, and prints a four-line banner saying so; setting it here keeps the behaviour
    and drops the banner), glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_) and oneDNN's caches capped
    (ONEDNN_CACHE_CAPACITY), so the workers' memory stays flat from step to step. Values the user set are
    kept."""
    env = os.environ.copy()
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MALLOC_MMAP_THRESHOLD))
    env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
    env.setdefault("LRU_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
    return env


_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_command(
    num_processes: int, module: str, args: list[str], failures: Path | None = None
) -> list[str]:
    """The command that runs `python -m module args` on `num_processes` local processes; with `failures`,
    through lorakit.engine.agent, which writes there how each failed rank ended (root_cause_line). The
    launcher runs on PYTHON_EXEC when set, the interpreter torchrun itself starts its ranks with, else on
    this one."""
    runner = (
        ["-m", "torch.distributed.run"] if failures is None else ["-m", "lorakit.engine.agent", str(failures)]
    )
    return [
        os.environ.get("PYTHON_EXEC", sys.executable),
        *runner,
        f"--nproc_per_node={num_processes}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        module,
        *args,
    ]


def report_to_agent(error: BaseException) -> None:
    """Under torchrun, leave `error` in this worker's error file (TORCHELASTIC_ERROR_FILE): the agent then
    knows the rank stopped on an error of its own, unlike one that died without one (a signal, os._exit),
    and plain torchrun prints it as the root cause. Written as torch's ErrorHandler.record_exception
    writes it, but redacted (disclosure.format_exception): torchrun prints the file's message and traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import time

    from lorakit.disclosure import format_exception, redact

    message = redact(f"{type(error).__name__}: {error}")
    stack = {"py_callstack": format_exception(error), "timestamp": str(int(time.time()))}
    # Renamed into place: torchrun's agent reads the file as soon as another rank fails, possibly while this
    # rank is still writing it, and an empty or partial file is a JSONDecodeError (and a traceback) there.
    tmp = Path(f"{path}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps({"message": {"message": message, "extraInfo": stack}}))
        os.replace(tmp, path)


def root_cause_line(recorded: dict[str, Any] | None, failures: dict[str, dict[str, Any]]) -> str | None:
    """The line naming a rank that died without an error of its own (`failures`: lorakit.engine.agent's
    report; unreported ranks), when what the workers recorded (`recorded`: exit.json, or None) is no root
    cause but a survivor's collective that the dead rank left unfinished; None when the record is the
    root cause or no rank died so. The survivor's record says where it was stuck: the dead rank's phase."""
    if recorded is not None and not recorded.get("peer_lost"):
        return None
    survivor = None if recorded is None else recorded.get("rank")
    dead = [(int(r), f) for r, f in failures.items() if not f.get("reported") and int(r) != survivor]
    if not dead:
        return None
    # The first to end; at the same second, a signal before an exit code (an abort that followed it).
    rank, how = min(dead, key=lambda d: (d[1].get("timestamp", 0), d[1]["exitcode"] >= 0, d[0]))
    code = how["exitcode"]
    if code < 0:
        line = f"rank {rank} was killed by {how.get('signal') or 'a signal'} (signal {-code})"
    else:
        line = f"rank {rank} exited with code {code} (no error of its own)"
    if recorded is not None and recorded.get("where"):
        line += f" during {recorded['where']}"
    if survivor is not None:
        line += f"; rank {survivor} stopped with it"
    return line
