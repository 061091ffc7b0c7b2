"""python -m lorakit.slurm RECIPE [KEY=VALUE ...] --nodes N --gpus-per-node G [--partition P] [--time T]
[--account A] [--submit]: write a Slurm job for the recipe (`job.sbatch` in its output.dir), print its path,
and with --submit hand it to sbatch. Exit 0 when written (and submitted), 2 for bad input (nothing is
written), sbatch's exit code when sbatch refuses it. See docs/multinode.md#slurm."""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from lorakit.cli import quiet_libraries, run_cli
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
        plan=_plan_lines(recipe, args),
        command=shlex.join(["python", "-m", "lorakit.slurm", *raw]),
    )
    path = run_dir / SCRIPT
    run_dir.mkdir(parents=True, exist_ok=True)  # the marker and the script only: the run writes the rest
    rundir.mark(run_dir)
    rundir.write_text(path, render(job))
    print(path)
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


def _plan_lines(recipe, args: argparse.Namespace) -> list[str]:
    """lorakit.plan for the job's shape; a model the planner cannot read gives one line saying why."""
    from lorakit.planner import plan

    try:
        p = plan(recipe, gpus=args.gpus_per_node, nodes=args.nodes, gpu_memory=args.gpu_memory)
    except Exception as e:  # noqa: BLE001 - the plan is a comment; the job does not depend on it
        return [f"plan: not available ({type(e).__name__}: {e}); python -m lorakit.plan RECIPE --gpus "
                f"{args.gpus_per_node} --nodes {args.nodes} --gpu-memory ... says more"]  # fmt: skip
    return ["plan (python -m lorakit.plan) for this shape:", *p.describe().splitlines()]


if __name__ == "__main__":
    sys.exit(main())
