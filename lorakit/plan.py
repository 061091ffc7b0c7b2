"""python -m lorakit.plan RECIPE --gpus N --gpu-memory 40GB [--nodes M] [--cpu-memory 1100GB] [--json]:
will the recipe fit, per GPU and in each node's CPU RAM, and what is the best setup that fits. Reads the
model's config only, never its weights. See docs/planning.md."""

from __future__ import annotations

import argparse
import json
import sys

from lorakit.callable_module import forward_calls
from lorakit.cli import run_cli, size_option


def parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    p = argparse.ArgumentParser(prog="python -m lorakit.plan", description=__doc__)
    p.add_argument("recipe", help="path to a recipe YAML file")
    p.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. train.micro_batch_size=4")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs per node (default: the recipe's distributed.num_processes)")  # fmt: skip
    p.add_argument("--gpu-memory", default=None,
                   help="memory of one GPU, e.g. 40GB, 80GiB (default: this machine's GPU, if it has one)")  # fmt: skip
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument(
        "--cpu-memory", default=None, help="CPU RAM of one node, e.g. 1100GB (default: no verdict)"
    )
    p.add_argument("--seq-len", type=int, default=None,
                   help="length to plan for where the recipe says auto: data.max_length, or "
                   "data.max_source_length for encoder-decoders (default: the model's maximum)")  # fmt: skip
    p.add_argument("--target-len", type=int, default=None,
                   help="encoder-decoders: length to plan for where data.max_target_length is auto")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    return p


def _local_gpu_memory() -> int | None:
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except (ImportError, RuntimeError):
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m lorakit.plan`: exit 0 when the recipe fits (or no verdict was asked
    for), 1 when it does not, 2 on bad input."""
    # Options and overrides in any order, as every lorakit command takes them.
    return run_cli(_plan, parser().parse_intermixed_args(argv))


def _plan(args: argparse.Namespace) -> int:
    """Plan the recipe's memory for the asked hardware and print the plan."""
    from lorakit.planner import PlanError, plan
    from lorakit.recipe import load_recipe

    given = size_option(args.gpu_memory, "--gpu-memory")
    cpu_memory = size_option(args.cpu_memory, "--cpu-memory")
    recipe = load_recipe(args.recipe, args.overrides)
    gpu_memory = given if given is not None else _local_gpu_memory()
    if gpu_memory is None:
        raise PlanError(
            "--gpu-memory: no GPU on this machine to read it from; give the GPU's memory, e.g. 40GB"
        )
    result = plan(
        recipe,
        gpus=args.gpus,
        gpu_memory=gpu_memory,
        nodes=args.nodes,
        cpu_memory=cpu_memory,
        seq_len=args.seq_len,
        target_len=args.target_len,
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.describe())
    return 0 if result.fits else 1


forward_calls(__name__, "lorakit.planner:plan")

if __name__ == "__main__":
    sys.exit(main())
