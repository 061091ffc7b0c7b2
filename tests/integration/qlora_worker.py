"""Trains each recipe given, in order, inside one torchrun group: several QLoRA runs for one launch.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.integration.qlora_worker RECIPE.yaml ...

Launched by test_qlora.py. lorakit.train runs in-process under a launcher, exactly as `python -m lorakit.run`
does on each worker it starts.
"""

import sys


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
