"""The two-rank steps of token_weighting_worker.py, dense_families_worker.py and moe_worker.py, in one
2-process launch (every launch costs each process its imports and start-up):

    python -m torch.distributed.run --nproc_per_node=2 -m tests.integration.two_ranks_worker CACHE OUT_WEIGHTING OUT_DENSE OUT_MOE

Launched by test_token_weighting.py; each worker writes into its own OUT, as its own launch did, and runs
each of its steps as a check of its own (worker_checks.py): a step that raises is recorded, and the rest run.
"""

import sys


def main(cache: str, weighting: str, dense: str, moe: str) -> None:
    from lorakit.engine.launch import process_group
    from tests.integration import dense_families_worker, moe_worker, token_weighting_worker

    # One group for the three: each worker's own process_group() joins it and leaves it standing.
    with process_group():
        token_weighting_worker.main(cache, weighting, "two_ranks")
        dense_families_worker.main(cache, dense, "two_ranks")
        moe_worker.main(cache, moe, "two_ranks")


if __name__ == "__main__":
    main(*sys.argv[1:])
