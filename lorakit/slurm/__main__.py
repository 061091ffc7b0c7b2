"""python -m lorakit.slurm RECIPE [KEY=VALUE ...] --nodes N --gpus-per-node G [--partition P] [--time T]
[--account A] [--cpus-per-task C] [--mem M | --exclusive] [--gres] [--submit]: write a Slurm job for the recipe (`job.sbatch` in its output.dir), print its path,
and with --submit hand it to sbatch. Exit 0 when written (and submitted), 2 for bad input (nothing is
written), sbatch's exit code when sbatch refuses it. See docs/multinode.md#slurm."""

from __future__ import annotations

import argparse
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from lorakit.cli import quiet_libraries, run_cli, size_option
from lorakit.errors import LorakitError


def parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    p = argparse.ArgumentParser(prog="python -m lorakit.slurm", description=__doc__)
    p.add_argument("recipe", help="path to a recipe YAML file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=2e-4")
    p.add_argument("--nodes", type=int, required=True, help="nodes of the job")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (processes) per node")
    p.add_argument("--partition", help="#SBATCH --partition")
    p.add_argument("--time", help="#SBATCH --time, e.g. 12:00:00")
    p.add_argument("--account", help="#SBATCH --account")
    p.add_argument("--cpus-per-task", type=int, help="#SBATCH --cpus-per-task: CPUs for a node's G processes")
    p.add_argument("--mem", default=None,
                   help="#SBATCH --mem, memory per node in Slurm's units, e.g. 500G, or 0 for all of it "
                   "(default: the plan's CPU RAM per node and a quarter more; 0 with --exclusive)")  # fmt: skip
    p.add_argument("--exclusive", action="store_true", help="#SBATCH --exclusive: whole nodes")
    p.add_argument("--gres", action="store_true",
                   help="ask for GPUs as --gres=gpu:G (clusters without select/cons_tres) instead of --gpus-per-node")  # fmt: skip
    p.add_argument(
        "--gpu-memory", default=None, help="memory of one GPU for the plan at the script's top, e.g. 80GB"
    )
    p.add_argument("--stop-before", type=int, default=300,
                   help="seconds before the time limit at which the run is asked to checkpoint and stop (300)")  # fmt: skip
    p.add_argument("--preflight-timeout", type=int, default=30,
                   help="seconds each step of the preflight may take before it fails (30)")  # fmt: skip
    p.add_argument("--submit", action="store_true", help="submit the script with sbatch")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m lorakit.slurm` and `lorakit-slurm`."""
    raw = sys.argv[1:] if argv is None else argv
    args = parser().parse_intermixed_args(raw)
    return run_cli(_write, args, raw)


def _write(args: argparse.Namespace, raw: list[str]) -> int:
    for flag, value, least in (("--nodes", args.nodes, 1), ("--gpus-per-node", args.gpus_per_node, 1),
                               ("--stop-before", args.stop_before, 60), ("--preflight-timeout", args.preflight_timeout, 1)):  # fmt: skip
        if value < least:
            raise LorakitError(f"{flag}: expected a whole number >= {least}, got {value}")
    sbatch = shutil.which("sbatch") if args.submit else None
    if args.submit and sbatch is None:
        raise LorakitError("--submit: sbatch is not on PATH (run this on a Slurm login node, or drop --submit and "
                           "submit the script later with sbatch)")  # fmt: skip
    if args.mem is not None and not re.fullmatch(r"[0-9]+[KMGT]?", args.mem):
        raise LorakitError(
            f"--mem: expected Slurm's memory per node, e.g. 500G or 0 (all of it), got {args.mem!r}"
        )
    gpu_memory = size_option(args.gpu_memory, "--gpu-memory")
    quiet_libraries()
    from lorakit import rundir
    from lorakit.recipe import load_recipe
    from lorakit.slurm.script import SCRIPT, JobSpec, render

    # The launcher decides how many processes there are; the recipe's count says the same, so the recipe's
    # checks (hpz_partition_size, sequence_parallel, FSDP shard groups) see the job's shape.
    procs = f"distributed.num_processes={args.gpus_per_node}"
    given = [o for o in args.overrides if o.startswith("distributed.num_processes=")]
    if given and given[-1] != procs:
        raise LorakitError(f"{given[-1]} contradicts --gpus-per-node {args.gpus_per_node}: drop the override")
    recipe = load_recipe(args.recipe, [*args.overrides, procs])
    run_dir = Path(recipe.output.dir).expanduser().resolve()
    if run_dir.exists() and not run_dir.is_dir():
        raise LorakitError(f"output.dir {run_dir} exists and is not a directory")
    # The job's script, logs and Slurm's output live in the run directory: it must be one a run may write
    # into (new, empty or lorakit's own), and it is marked as lorakit's before anything is written there.
    rundir.check_trusted(run_dir)
    overrides = [o for o in args.overrides if not o.startswith(("distributed.num_processes=", "output.dir="))]
    plan_lines, per_node = _plan(recipe, args, gpu_memory)
    memory, memory_note = _memory(args, per_node)
    job = JobSpec(
        recipe=str(Path(args.recipe).resolve()),
        overrides=[*overrides, procs, f"output.dir={run_dir}"],
        run_dir=str(run_dir),
        workdir=str(Path.cwd()),
        python=sys.executable,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        name=f"lorakit-{run_dir.name}",
        options=tuple(
            (k, v)
            for k in ("partition", "time", "account", "cpus-per-task")
            if (v := getattr(args, k.replace("-", "_")))
        ),
        stop_before=args.stop_before,
        preflight_timeout=args.preflight_timeout,
        memory=memory,
        memory_note=memory_note,
        exclusive=args.exclusive,
        gres=args.gres,
        plan=plan_lines,
        command=shlex.join(["python", "-m", "lorakit.slurm", *raw]),
    )
    path = run_dir / SCRIPT
    text = render(job)  # a value the script cannot carry is refused here, before anything is written
    run_dir.mkdir(parents=True, exist_ok=True)  # the marker and the script only: the run writes the rest
    rundir.mark(run_dir)
    rundir.write_text(path, text)
    print(path)
    for line in _warnings(args, per_node):
        print(f"warning: {line}", file=sys.stderr)
    if sbatch is None:
        return 0
    done = subprocess.run([sbatch, str(path)], capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    if done.returncode != 0:
        print(
            f"error: sbatch refused {path} (exit code {done.returncode}): {done.stderr.strip()}",
            file=sys.stderr,
        )
    return done.returncode


def _plan(recipe, args: argparse.Namespace, gpu_memory: int | None) -> tuple[list[str], int | None]:
    """lorakit.plan for the job's shape, and its CPU RAM per node; a model the planner cannot read gives
    one line saying why (and no size)."""
    from lorakit.planner import plan

    try:
        p = plan(recipe, gpus=args.gpus_per_node, nodes=args.nodes, gpu_memory=gpu_memory)
    except Exception as e:  # noqa: BLE001 - the plan is a comment; the job does not depend on it
        return [f"plan: not available ({type(e).__name__}: {e}); python -m lorakit.plan RECIPE --gpus "
                f"{args.gpus_per_node} --nodes {args.nodes} --gpu-memory ... says more"], None  # fmt: skip
    head = ("plan (python -m lorakit.plan) for this shape, from the recipe and the model's config: what the "
            "nodes will run, not what this machine has installed:")  # fmt: skip
    return [head, *p.describe().splitlines()], p.per_node_cpu_bytes


# The memory asked for above the plan's CPU RAM per node: the plan's runtime figure is an estimate, and a
# cgroup kill at load costs the whole queue wait.
MEMORY_MARGIN = 1.25


def _memory(args: argparse.Namespace, per_node: int | None) -> tuple[str, str]:
    """#SBATCH --mem's value and the comment saying where it came from."""
    if args.mem is not None:
        return args.mem, ""
    if args.exclusive:
        return "0", "all of each node's memory (--exclusive; python -m lorakit.slurm ... --mem M to ask less)"
    if per_node is None:
        return "0", "all of each node's memory: no plan to size it from (python -m lorakit.slurm ... --mem M)"
    gib = math.ceil(per_node * MEMORY_MARGIN / 2**30)
    return f"{gib}G", (f"the plan's CPU RAM per node, {per_node / 2**30:.1f} GiB, and a quarter more "
                       "(python -m lorakit.slurm ... --mem M, or --exclusive for whole nodes)")  # fmt: skip


def _warnings(args: argparse.Namespace, per_node: int | None) -> list[str]:
    """What the script leaves to the cluster's defaults, which often do not suit a training job."""
    out = []
    if not args.time:
        out.append("no --time: the partition's default time limit applies (sinfo -o '%P %l' lists them), and "
                   f"the run is asked to checkpoint {args.stop_before} s before it")  # fmt: skip
    if args.cpus_per_task is None:
        out.append(f"no --cpus-per-task: Slurm's default (often 1 CPU) runs the node's {args.gpus_per_node} "
                   "processes and their data loading; give the CPUs of a node's share, e.g. --cpus-per-task 64")  # fmt: skip
    if args.mem is None and not args.exclusive and per_node is None:
        out.append("no plan to size --mem from: the script asks for all of each node's memory (--mem=0)")
    return out


if __name__ == "__main__":
    sys.exit(main())
