"""Trains each recipe given, in order, inside one torchrun group: several QLoRA runs for one launch.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.integration.qlora_worker RECIPE.yaml ...

Launched by test_qlora.py and test_methods.py through `train_in_one_launch`. lorakit.train runs in-process
under a launcher, exactly as `python -m lorakit.run` does on each worker it starts.
"""

import sys
from pathlib import Path


def train_in_one_launch(recipes: dict[Path, dict], env: dict[str, str]):
    """Write each recipe to its YAML path, tokenize it in this process (the workers then only read the cache),
    and train them all, in order, in one 2-process torchrun launch with `env`; returns the finished process,
    which must have succeeded."""
    import os
    import subprocess

    import yaml

    import lorakit
    from lorakit.engine.launch import torchrun_command
    from tests.conftest import ROOT

    for path, raw in recipes.items():
        path.write_text(yaml.safe_dump(raw))
        lorakit.prepare(lorakit.load_recipe(str(path)))
    proc = subprocess.run(
        torchrun_command(2, "tests.integration.qlora_worker", [str(p) for p in recipes]),
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def main(paths: list[str]) -> None:
    import deepspeed
    import torch.distributed as dist

    import lorakit

    # One process group for all the runs: lorakit.train joins a group that exists and leaves it standing.
    # (Tearing the group down and building it again on torchrun's store hangs the next job.)
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        for path in paths:
            lorakit.train(lorakit.load_recipe(path))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
