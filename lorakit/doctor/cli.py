"""python -m lorakit.doctor [RECIPE] [KEY=VALUE ...] [--quick] [--output DIR] [--devices N]: check this
machine for a recipe before a long run; prints a table, writes doctor.json and doctor.md to --output, exits
0 only when every check passed (1 when one failed, 2 for a bad recipe). See docs/doctor.md."""

from __future__ import annotations

import argparse
import os
import sys

from lorakit.cli import quiet_libraries, run_cli


def parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    p = argparse.ArgumentParser(prog="python -m lorakit.doctor", description=__doc__)
    p.add_argument("recipe", nargs="?", help="recipe YAML (without one: the environment checks only)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.dtype=float32")
    p.add_argument("--quick", action="store_true", help="what preflight.doctor runs: no all_reduce or ZeRO-3 "
                   "save, fewer timing iterations")  # fmt: skip
    p.add_argument(
        "--output", default="doctor", help="directory for doctor.json and doctor.md (default: doctor)"
    )
    p.add_argument("--devices", type=int, default=None, help="processes for the multi-device checks (default: "
                   "the GPUs torch sees; on CPU one, so they are skipped)")  # fmt: skip
    # The multi-node preflight (doctor/nodes.py), one process per node: what the Slurm job runs first.
    p.add_argument("--nodes", type=int, default=None, help="run the multi-node preflight on this many nodes")
    p.add_argument("--rendezvous", help="with --nodes: HOST:PORT that node 0 opens and every node reaches")
    p.add_argument(
        "--node-rank", type=int, default=None, help="with --nodes: this node (default: SLURM_NODEID)"
    )
    p.add_argument(
        "--hosts", default=None, help="with --nodes: the nodes' names, comma-separated, for messages"
    )
    p.add_argument(
        "--timeout", type=float, default=None, help="with --nodes: seconds each step may take (30)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m lorakit.doctor` and `lorakit-doctor`."""
    args = parser().parse_intermixed_args(argv)
    if args.devices is not None and args.devices < 1:
        print("error: --devices: expected a whole number >= 1", file=sys.stderr)
        return 2
    return run_cli(_doctor, args)


def _doctor(args: argparse.Namespace) -> int:
    quiet_libraries()
    from lorakit.doctor.core import run_doctor
    from lorakit.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides) if args.recipe else None
    if args.nodes is not None:
        from lorakit.doctor.nodes import run_from_cli

        return run_from_cli(recipe, args, os.environ)
    report = run_doctor(recipe, quick=args.quick, output=args.output, devices=args.devices, label=args.recipe)
    if os.environ.get("RANK", "0") == "0":  # under a launcher, rank 0 speaks for the group
        print(report.table())
        print(f"report:   {args.output}/doctor.md, {args.output}/doctor.json")
    return 0 if report.ok else 1
