"""One rank of a 2-process group that runs lorakit's real training job once per row of docs/faults.md, with
a failure injected on one rank into the work of that row's phase (tests/fault_injection.py), and records
what every rank saw. Launched by test_faults.py as plain processes (as srun or pdsh start them: no agent
that stops the other ranks when one fails).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python fault_harness_worker.py FAILING CACHE OUT
    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python fault_harness_worker.py stall OUT

The group is lorakit's own (launch.process_group: DeepSpeed over gloo); each row is one job as a worker of
`python -m lorakit.run` runs it (api._train_in_group: run_job recording exit.json), with its own run
directory, so the failure travels the job's real call sites, phase labels and agreements. An agreement
leaves the group working, so the rows share it; each row ends with an all_reduce that proves no rank was
left in a collective. The last row, an exception in a step's work (outside any agreement), ends the
processes as in a real run: the failing rank leaves, the other learns it in the step's collective.

Writes OUT/rank-r.json: per row [phase, kind, message, seconds from the failure until this rank stopped,
after], `after` on rank 0 being what the launcher would end with (its line and exit code, from exit.json)
and the run's checkpoints.

`stall`: a plain gloo group whose timeout is 3 s (a real job's waits between ranks could pass that on a
loaded machine); in step 1 (lorakit's phase label), rank 1 stalls for 6 s while rank 0 waits in the step's
all_reduce. Writes OUT/rank-0.json: [kind, message, seconds].

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python fault_harness_worker.py barrier CACHE OUT

`barrier`: one job in which rank 0 fails inside DeepSpeed's own save of step 2's checkpoint (writing the
model states, between DeepSpeed's barriers) while rank 1 waits in DeepSpeed's barrier, not in lorakit's
agreement. Writes OUT/rank-r.json: [kind, message, seconds from the failure until this rank stopped,
after], `after` saying whether the group is broken and, on rank 0, the launcher's line and code and the
complete checkpoints.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# Rows by failing rank: (phase, which call of its work fails); the last row of each is "step". Rank 1 does
# none of rank 0's own work: in the RANK0_WORK row all of it fails on rank 1, and the job completes.
RANK0_WORK = "rank 0's work"
RANK0_PHASES = (
    "tracker start", "eval write", "checkpoint publish", "adapter save", "summary", "resume", "metrics write",
)  # fmt: skip
ROWS = {
    0: [
        ("load", 1),
        ("prepare", 1),
        ("tracker start", 1),
        ("eval write", 1),
        ("checkpoint save", 2),
        ("checkpoint publish", 2),
        ("adapter save", 1),
        ("summary", 1),
        ("resume", 1),
        ("metrics write", 1),
        ("eval metrics", 1),
        ("step", 1),
    ],
    1: [("load", 1), ("prepare", 1), ("checkpoint save", 2), (RANK0_WORK, 1), ("step", 1)],
}


def recipe_for(cache: Path, run_dir: Path, generate: bool = False):
    """2 steps, a checkpoint after each, an evaluation (loss only, unless `generate`) after the last: every
    phase once."""
    from lorakit.recipe import recipe_from_dict
    from tests.conftest import tiny_recipe_dict

    raw = tiny_recipe_dict(
        cache,
        run_dir,
        train={"max_steps": 2, "micro_batch_size": 4},
        distributed={"num_processes": 2, "zero_stage": 0, "timeout_minutes": 10},
        eval={"generate": generate, "max_new_tokens": 4},
        checkpoint={"every": 1, "keep": 3},
    )
    return recipe_from_dict(raw)


def launcher_outcome(run_dir: Path) -> list:
    """What `python -m lorakit.run` ends with after this row: its line and exit code (from exit.json; both
    ranks stopped on an error of their own, so both reported it to torchrun's agent)."""
    from lorakit import api
    from lorakit.errors import WorkerFailedError

    reported = {str(r): {"exitcode": 1, "reported": True} for r in (0, 1)}
    try:
        api._raise_worker_exit(run_dir, reported)
    except WorkerFailedError as e:
        return [str(e), e.exit_code]
    return ["no exit.json", None]


def main(failing: int, cache: Path, out: Path) -> None:
    from lorakit import api, dist
    from lorakit.engine.checkpoint import complete_checkpoints
    from lorakit.engine.launch import process_group
    from tests.fault_injection import inject

    results = []

    def save() -> None:
        (out / f"rank-{dist.rank()}.json").write_text(json.dumps(results))

    with process_group("gloo", timeout_minutes=10):
        me = dist.rank()
        for phase, nth in ROWS[failing]:
            run_dir = out / phase.replace(" ", "-").replace("'", "")
            stamp = out / f"{run_dir.name}.failed-at"
            phases = RANK0_PHASES if phase == RANK0_WORK else (phase,)
            undo = [inject(p, nth, stamp=str(stamp)) for p in phases] if me == failing else []
            try:
                recipe = recipe_for(cache, run_dir, generate=phase == "eval metrics")
                api._train_in_group(recipe, lock_on_rank0=False)
                outcome = ["ok", ""]
            except Exception as e:
                outcome = [type(e).__name__, str(e)]
            finally:
                for u in undo:
                    u()
            # Seconds from the injected failure (on whichever rank) until this rank stopped.
            took = time.time() - float(stamp.read_text()) if stamp.exists() else None
            results.append([phase, *outcome, took, None])
            if phase == "step":
                break
            # Every rank is past the row, none left in a collective: the group still works.
            (total,) = dist.all_reduce([1.0])
            after = {"group": total}
            if me == 0:
                ckpts = run_dir / "checkpoints"
                after["launcher"] = launcher_outcome(run_dir)
                after["complete"] = [c.step for c in complete_checkpoints(run_dir)]
                after["entries"] = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
            results[-1][-1] = after
            save()
        if me == 0:
            results[-1][-1] = {"launcher": launcher_outcome(out / "step")}
        save()
        # As lorakit.run ends a failed rank of a group: at once (no teardown of the group or of Python).
        sys.stdout.flush()
        os._exit(1)


def stall(out: Path) -> None:
    import datetime

    import torch.distributed as torch_dist

    from lorakit import dist

    torch_dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    start = time.monotonic()
    try:
        with dist.phase("training", 1):
            if dist.rank() == 1:
                time.sleep(6)
            dist.all_reduce([1.0])
        outcome = ["ok", ""]
    except Exception as e:
        outcome = [type(e).__name__, str(e)]
    (out / f"rank-{dist.rank()}.json").write_text(json.dumps([*outcome, time.monotonic() - start]))
    os._exit(0)  # as lorakit.run does: gloo's teardown of a group with a vanished peer aborts


def barrier(cache: Path, out: Path) -> None:
    from lorakit import api, dist
    from lorakit.engine.checkpoint import complete_checkpoints
    from lorakit.engine.launch import process_group
    from tests.fault_injection import inject

    run_dir, stamp = out / "checkpoint-barrier", out / "step.failed-at"
    with process_group("gloo", timeout_minutes=10):
        if dist.rank() == 0:
            inject("checkpoint barrier", 2, stamp=str(stamp))
        try:
            api._train_in_group(recipe_for(cache, run_dir), lock_on_rank0=False)
            outcome = ["ok", ""]
        except Exception as e:
            outcome = [type(e).__name__, str(e)]
        took = time.time() - float(stamp.read_text()) if stamp.exists() else None
        after = {"broken": dist.group_broken()}
        if dist.rank() == 0:
            after["launcher"] = launcher_outcome(run_dir)
            after["complete"] = [c.step for c in complete_checkpoints(run_dir)]
        (out / f"rank-{dist.rank()}.json").write_text(json.dumps([*outcome, took, after]))
        sys.stdout.flush()
        os._exit(1)  # as lorakit.run ends a failed rank of a group


if __name__ == "__main__":
    if sys.argv[1] == "stall":
        stall(Path(sys.argv[2]))
    elif sys.argv[1] == "barrier":
        barrier(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main(int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
