"""Failures injected into the work of one of lorakit's phases (docs/faults.md): the real function that does
that phase's work is wrapped, so the failure travels lorakit's real call sites, phase labels and
agreements. Used by tests/integration/faults/sitecustomize.py (LORAKIT_RAISE, in every process of a launch)
and by tests/integration/fault_harness_worker.py (one phase after another in one process group).
"""

from __future__ import annotations

import importlib
import os
import signal
import time
from collections.abc import Callable

# phase -> (module, attribute path) of the function that does that phase's work.
TARGETS = {
    "load": ("lorakit.engine.job", "load_config"),
    "prepare": ("lorakit.engine.job", "prepare_data"),
    "tracker start": ("lorakit.engine.job", "open_run_dir"),
    "step": ("lorakit.engine.loop", "train_window"),
    "tracker log": ("lorakit.observe.tensorboard_sink", "TensorBoardSink.write"),
    "eval write": ("lorakit.engine.job", "Job._write_eval"),
    "checkpoint save": ("lorakit.engine.checkpoint", "write_rank_rng"),
    "checkpoint publish": ("lorakit.engine.checkpoint", "_publish"),
    # Writing the adapter (or model) directory, rank 0's work after the weights were gathered.
    "adapter save": ("lorakit.storage", "new_directory"),
    "summary": ("lorakit.engine.job", "Job._write_summary"),
    # Rank 0's work outside the agreements above (issue 44, review L4): choosing the checkpoint to resume
    # from, writing a metric record to metrics.jsonl, scoring an evaluation's generations.
    "resume": ("lorakit.engine.checkpoint", "_choose"),
    "metrics write": ("lorakit.observe.metrics", "JsonlSink.write"),
    "eval metrics": ("lorakit.evaluation.scoring", "compute_metrics"),
    # Inside DeepSpeed's own checkpoint save (rank 0 writes the model states between its barriers): the
    # other ranks wait in DeepSpeed's barrier, not in lorakit's agreement (review L4's fourth case).
    "checkpoint barrier": ("deepspeed.runtime.engine", "DeepSpeedEngine._save_checkpoint"),
}


def inject(
    phase: str,
    nth: int = 1,
    how: str = "raise",
    stamp: str | None = None,
    action: Callable[[], None] | None = None,
) -> Callable[[], None]:
    """Make the `nth` call of `phase`'s work in this process fail (every call from the nth on for `tracker
    log`): `how` is `raise` (RuntimeError("injected in PHASE")), `SIGKILL` (the process kills itself) or
    `exit:N` (os._exit(N): the process ends without Python's error handling). With `stamp`, the time of
    the failure is appended to that file first. With `action`, the nth call runs `action()` (an outside
    event at that moment: another process taking the run lock) and then does its work instead of failing.
    Returns a function that undoes the injection."""
    module, path = TARGETS[phase]
    owner = importlib.import_module(module)
    *parents, attr = path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    original = getattr(owner, attr)
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == nth or (phase == "tracker log" and calls["n"] > nth):
            if action is not None:
                action()
                return original(*args, **kwargs)
            if stamp:
                with open(stamp, "a") as f:
                    f.write(f"{time.time()}\n")
            if how == "SIGKILL":
                os.kill(os.getpid(), signal.SIGKILL)
            if how.startswith("exit:"):
                os._exit(int(how.partition(":")[2]))
            raise RuntimeError(f"injected in {phase}")
        return original(*args, **kwargs)

    setattr(owner, attr, failing)
    return lambda: setattr(owner, attr, original)
