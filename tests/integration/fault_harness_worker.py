"""One rank of a 2-process gloo group (no DeepSpeed, no model) that injects failures into the shapes of
lorakit's phases and records what every rank saw; launched by test_faults.py as plain processes (as srun
or pdsh start them: no agent that stops the other ranks when one fails).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python fault_harness_worker.py MODE OUT

MODE agree: every (phase, failing rank) row of FAULT_ROWS in turn, each in the shape lorakit runs it (rank-0
work through dist.on_main, every rank's own work through dist.on_every_rank); writes OUT/rank-r.json.
MODE raise-R: rank R raises in the first step's forward and exits; the other waits in the step's all-reduce.
MODE kill-R: rank R SIGKILLs itself in the first step's forward; the other waits in the step's all-reduce.
MODE stall: rank 1 stalls for 6 s, past the group's timeout (3 s); rank 0 waits in the step's all-reduce.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

# (phase, failing rank, how lorakit runs the phase): the rows of docs/faults.md that are agreements.
FAULT_ROWS = [
    ("load", 0, "every"),
    ("load", 1, "every"),
    ("prepare", 0, "main"),
    ("prepare", 1, "every"),
    ("tracker start", 0, "main"),
    ("eval write", 0, "main"),
    ("checkpoint save", 0, "every"),
    ("checkpoint save", 1, "every"),
    ("checkpoint save", 0, "main"),
    ("adapter save", 0, "main"),
]


class Injected(RuntimeError):
    """The injected failure."""


def main(mode: str, out: Path) -> None:
    import torch.distributed as torch_dist

    from lorakit.engine import dist

    torch_dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    me = dist.rank()
    results = []
    if mode == "agree":
        for step, (name, failing, shape) in enumerate(FAULT_ROWS, start=1):

            def work(name=name, failing=failing):
                if dist.rank() == failing:
                    raise Injected(f"injected in {name}")
                return "done"

            start = time.monotonic()
            try:
                with dist.phase("training", step):
                    if shape == "main":
                        dist.on_main(name, work, at=step)
                    else:
                        dist.on_every_rank(name, work, at=step)
                outcome = ["ok", ""]
            except Exception as e:
                outcome = [type(e).__name__, str(e)]
            results.append([name, failing, *outcome, time.monotonic() - start])
        # The group still works after every row: all ranks agreed and none is left in a collective.
        (total,) = dist.all_reduce([1.0])
        results.append(["after", -1, "ok", str(total), 0.0])
    else:
        action, _, failing = mode.partition("-")
        start = time.monotonic()
        try:
            with dist.phase("training", 1):
                if me == int(failing or 1):
                    if action == "raise":
                        raise Injected("injected in the first step")
                    if action == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(6)
                dist.all_reduce([1.0])
            outcome = ["ok", ""]
        except Injected:
            sys.exit(1)
        except Exception as e:
            outcome = [type(e).__name__, str(e)]
        results.append(["first step", 1, *outcome, time.monotonic() - start])
    (out / f"rank-{me}.json").write_text(json.dumps(results))
    if dist.group_broken():
        os._exit(0)  # as lorakit.run does: gloo's teardown of a group with a vanished peer aborts
    # As launch.process_group ends a job: every rank still there, then the group is torn down.
    torch_dist.barrier()
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
