"""A small trained run shared by the generate and evaluate tests (trained once per session)."""

import pytest

from tests.e2e.test_quickstart import run_recipe

# recipes/quickstart_mnli.yaml shrunk to seconds: 1 process (still ZeRO-3, bf16, packed rows), 8 steps.
MNLI_OVERRIDES = (
    "distributed.num_processes=1",
    "train.epochs=1",
    "data.max_samples=128",
    "data.max_eval_samples=24",
)


@pytest.fixture(scope="session")
def mnli_run(tmp_path_factory):
    """The run directory of a small MNLI classifier run (LoRA on tiny:t5, two-column prompt template)."""
    _, _, run_dir = run_recipe(tmp_path_factory.mktemp("mnli"), "quickstart_mnli.yaml", *MNLI_OVERRIDES)
    return run_dir


@pytest.fixture(scope="session")
def mnli_merged(mnli_run, tmp_path_factory):
    """mnli_run's adapter merged into its base by lorakit.merge, outside the run directory."""
    import lorakit

    out = tmp_path_factory.mktemp("mnli-export") / "merged"
    # peft's in-memory merge: the tests compare greedy outputs token for token with the bf16 adapter model,
    # and the streaming merge rounds W + delta once from fp32, which can flip a near-tie (1 of 16 rows seen);
    # the streaming merge has its own tests (tests/unit/test_stream_merge.py).
    lorakit.merge(mnli_run, out, strategy="memory")
    return out
