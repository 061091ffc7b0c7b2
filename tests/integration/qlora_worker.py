"""Trains each recipe given, in order, inside one torchrun group: several QLoRA runs for one launch.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.integration.qlora_worker [--keep-going] RECIPE.yaml ...

With --keep-going a run that raises (on every rank) is reported and the next one still trains, so one failure
does not hide the others; the launch then exits 1.

Launched by test_qlora.py and test_methods.py through `train_in_one_launch`. lorakit.train runs in-process
under a launcher, exactly as `python -m lorakit.run` does on each worker it starts.
"""

import sys
from pathlib import Path


def train_in_one_launch(recipes: dict[Path, dict], env: dict[str, str], keep_going: bool = False):
    """Write each recipe to its YAML path, tokenize it in this process (the workers then only read the cache),
    and train them all, in order, in one 2-process torchrun launch with `env`; returns the finished process,
    which must have succeeded (with `keep_going`: every run was tried; each test checks its own run, see
    finished)."""
    import os
    import subprocess

    import yaml

    import lorakit
    from lorakit.engine.launch import torchrun_command
    from tests.conftest import ROOT

    for path, raw in recipes.items():
        path.write_text(yaml.safe_dump(raw))
        lorakit.prepare(lorakit.load_recipe(str(path)))
    flag = ["--keep-going"] if keep_going else []
    proc = subprocess.run(
        torchrun_command(2, "tests.integration.qlora_worker", [*flag, *map(str, recipes)]),
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert keep_going or proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def finished(proc, run_dir: Path) -> None:
    """Assert that the run at `run_dir` of a keep-going launch `proc` finished (its summary.json written),
    showing the launch's output when it did not."""
    assert (run_dir / "summary.json").is_file(), f"{run_dir.name} did not finish:\n" + proc.stderr[-6000:]


def main(paths: list[str]) -> None:
    import lorakit
    from lorakit.engine.launch import process_group
    from tests.integration.worker_checks import failure

    # One process group for all the runs: lorakit.train joins a group that exists and leaves it standing.
    # (Tearing the group down and building it again on torchrun's store hangs the next job.) lorakit's own
    # group context, so it is torn down as a run's is: a group destroyed with only dist.destroy_process_group
    # left FSDP2's meshes alive in DTensor's caches, and a rank aborted after the last run had finished
    # ("terminate called without an active exception", seen once from test_fsdp's first launch).
    keep_going = paths[:1] == ["--keep-going"]
    failed = []
    with process_group("gloo"):
        for path in paths[keep_going:]:
            if not keep_going:
                lorakit.train(lorakit.load_recipe(path))
            elif failure(lambda p=path: lorakit.train(lorakit.load_recipe(p))):
                failed.append(path)
    if failed:
        sys.exit(f"failed: {' '.join(failed)}")


if __name__ == "__main__":
    main(sys.argv[1:])
