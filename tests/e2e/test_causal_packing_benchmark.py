"""benchmarks/causal_packing.py: a smoke run of the script, and a check of the committed result."""

import json

import pytest

from benchmarks.harness.cli import load_spec
from tests.e2e.benchmark_checks import check_committed, check_result, check_sweep
from tests.e2e.benchmark_runs import RESULTS, assert_usage_error, smoke

SPEC = load_spec("causal_packing")
COMMITTED = RESULTS / "causal_packing.json"


def check(result: dict, repeats: int, rows: int) -> None:
    check_result(result, SPEC, repeats)
    assert result["setup"]["data"]["rows"] == rows
    # Every run of every side (and of the sweep) trained on the same tokens, each example once.
    checks = result["checks"]
    assert checks["useful_tokens_equal_on_all_runs"] is True and checks["each_example_once"] is True
    assert checks["examples_per_run"] == rows
    useful, sides = checks["useful_tokens"], list(result["medians"])
    assert isinstance(useful, int) and useful > 0
    assert {"padded_random", "padded_grouped", "packed"} <= set(sides)
    assert result["useful_tokens"]["per_side"] == {s: useful for s in sides}
    runs, sweep = result["runs"], result["budget_sweep"]
    assert len(runs) == repeats * len(sides)
    all_runs = runs + (sweep["runs"] if sweep else [])
    for run in all_runs:
        assert run["useful_tokens"] == useful and run["examples"] == rows
        assert run["epoch_seconds"] > 0 and run["useful_tokens"] <= run["token_slots"]
        assert run["loss_first"] is not None and run["loss_last"] is not None
    assert len({r["loss_tokens"] for r in all_runs}) == 1
    for run in runs:
        packed = run["side"].startswith("packed")
        budget = result["matched_max_tokens" if run["side"] == "packed_matched" else "chosen_max_tokens"]
        assert run["max_tokens"] == (budget if packed else None) == result["max_tokens"][run["side"]]
        assert run["attention"] == ("lorakit_varlen_sdpa" if packed else "sdpa")
        assert run["micro_batches"] == run["optimizer_steps"]  # no accumulation
    # Padded sides: micro-batches of 8 examples; packed: one row of several examples.
    steps = result["optimizer_steps"]
    assert steps["padded_random"] == steps["padded_grouped"] == rows // 8
    setup = result["setup"]
    assert setup["processes"] == 1 and setup["dtype"] == "float32" and setup["train"]["micro_batch_size"] == 8
    assert setup["zero_stage"]["packed"] == 0 and setup["gradient_checkpointing"] is True
    eff = result["padding_efficiency"]  # the sides differ in batching only
    assert eff["padded_random"] < eff["padded_grouped"] and eff["padded_random"] < eff["packed"]
    head = result["ratios"]["packed/padded_random"]
    assert result["headline"] == {"side": "packed", "versus": "padded_random"}
    assert result["headline_ratio"] == head["useful_tokens_per_second"]
    assert result["headline_paired_median"] == head["paired_median"]
    assert result["claim_met"] == (result["headline_ratio"] >= result["claim_ratio"])
    if sweep:
        assert result["chosen_max_tokens"] == sweep["best"]
        assert result["matched_max_tokens"] == sweep["matched_to_padded_batch"]["budget"]
        # A side at the batch-matched budget runs when it differs from the chosen one.
        assert ("packed_matched" in sides) == (result["matched_max_tokens"] != result["chosen_max_tokens"])
        check_sweep(sweep, "budgets", "per_budget", "useful_tokens_per_second")
    assert {"1min", "5min", "15min"} <= set(result["load_average_at_start"])


def test_smoke_run_writes_a_complete_result(cache_dir, tmp_path):
    result, _ = smoke("causal_packing", tmp_path, cache_dir)
    check(result, repeats=1, rows=48)
    assert result["chosen_max_tokens"] == 1024 and result["budget_sweep"]["budgets"] == [1024]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-samples", "20"], "multiple of the micro batch size"),
        (["--budgets", "512,x"], "comma-separated positive integers"),
    ],
)
def test_bad_arguments_are_usage_errors(tmp_path, args, message):
    assert_usage_error("causal_packing", tmp_path, args, message)


def test_committed_result_records_its_setup_and_measurement():
    result = json.loads(COMMITTED.read_text())
    repeats = len({r["repeat"] for r in result["runs"]})
    assert repeats >= 3
    check(result, repeats=repeats, rows=1000)
    check_committed(result)
    assert result["budget_sweep"] is not None, "the committed packed budget was chosen by a sweep"
    # Multipack fills its rows: at least 95% of the packed slots hold tokens.
    assert result["padding_efficiency"]["packed"] >= 0.95
    assert result["claim_ratio"] == SPEC["claims"][0]["ratio_at_least"] == 1.3
