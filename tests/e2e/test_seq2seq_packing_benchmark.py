"""benchmarks/seq2seq.py packing: a smoke run of the script, and a check of the committed results."""

import json
import math

import pytest

from benchmarks.harness.cli import load_spec
from tests.conftest import ROOT
from tests.e2e.benchmark_checks import check_committed, check_result
from tests.e2e.benchmark_runs import assert_usage_error, smoke

SPEC = load_spec("seq2seq_packing")
SIDES = ("padded_random", "padded_grouped", "packed", "packed_budget")


def check(result: dict, repeats: int, rows: int) -> None:
    check_result(result, SPEC, repeats)
    assert result["setup"]["data"]["rows"] == rows
    # Every run of every side (and of the sweep) trained on the same tokens, each example once, and evaluated.
    checks = result["checks"]
    assert checks["useful_tokens_equal_on_all_runs"] is True and checks["each_example_once"] is True
    assert checks["every_run_evaluated"] is True and checks["examples_per_run"] == rows
    useful = checks["useful_tokens"]
    assert isinstance(useful, int) and useful > 0
    assert list(result["medians"]) == list(SIDES)
    assert result["useful_tokens"]["per_side"] == {s: useful for s in SIDES}
    assert set(result["ratios"]) == {f"{s}/{v}" for s, v in SPEC["comparisons"]}
    runs, sweep = result["runs"], result["row_sweep"]
    assert len(runs) == repeats * len(SIDES)
    all_runs = runs + (sweep["runs"] if sweep else [])
    for run in all_runs:
        assert run["useful_tokens"] == useful and run["examples"] == rows and run["zero_stage"] == 0
        assert run["epoch_seconds"] > 0 and run["useful_tokens"] <= run["token_slots"]
        assert run["loss_first"] is not None and isinstance(run["eval_loss"], float) and run["eval_loss"] > 0
    assert len({r["loss_tokens"] for r in all_runs}) == 1
    assert len({r["eval_rows"] for r in all_runs}) == 1  # the same validation rows on every run
    per_step, k = result["examples_per_step"], result["chosen_examples_per_row"]
    for run in runs:
        packed = run["side"].startswith("packed")
        assert run["max_tokens"] == (result["chosen_max_tokens"] if run["side"] == "packed_budget" else None)
        for key in ("max_tokens", "accumulation", "micro_batch"):
            assert result[key][run["side"]] == run[key]
        assert run["seed"] == result["seeds"][run["repeat"]]  # rounds paired by seed
        assert run["attention"] == ("lorakit_varlen_sdpa" if packed else "sdpa")
        # Windows of `accumulation` micro-batches; the epoch's last window may be short.
        assert math.ceil(run["micro_batches"] / run["accumulation"]) == run["optimizer_steps"]
        if packed:
            assert 0 < run["source_efficiency"] <= 1 and 0 < run["target_efficiency"] <= 1
            assert run["accumulation"] == per_step // k
        else:
            assert run["accumulation"] * 8 == per_step and run["micro_batch"] == 8
        if run["side"] == "packed":
            # Rows of exactly k random examples, unpadded: one process waits on no other rank.
            assert run["micro_batch"] == k and run["micro_batches"] == rows // k
            assert run["source_efficiency"] == run["target_efficiency"] == 1.0
            assert run["token_slots"] == run["useful_tokens"]
    assert len(set(result["seeds"])) == repeats
    # Every side takes about `examples_per_step` examples per optimizer step: padded sides exactly (micro
    # batches of 8), random rows exactly the padded sides' steps; budget rows hold at most k examples on
    # average: never fewer (larger) optimizer steps than padded.
    steps = result["optimizer_steps"]
    assert steps["padded_random"] == steps["padded_grouped"] == steps["packed"] == math.ceil(rows / per_step)
    assert result["examples_per_optimizer_step"]["padded_random"] == rows / steps["padded_random"]
    assert result["examples_per_optimizer_step"]["packed"] == per_step
    assert steps["padded_random"] <= steps["packed_budget"] <= 1.25 * steps["padded_random"] + 1
    setup = result["setup"]
    assert setup["processes"] == 1 and setup["dtype"] == "float32" and setup["train"]["micro_batch_size"] == 8
    assert set(setup["zero_stage"].values()) == {0} and setup["gradient_checkpointing"] is True
    assert setup["model"]["name_or_path"] == "tiny:t5"
    assert result["padding_efficiency"]["padded_random"] < result["padding_efficiency"]["padded_grouped"]
    assert result["claims_met"] == {c["name"]: c["claim_met"] for c in result["claims"]}
    assert [c["name"] for c in result["claims"]] == [c["name"] for c in SPEC["claims"]]
    for claim in result["claims"]:
        if claim["metric"] == "eval_loss":
            assert (
                claim["side_eval_loss"]
                == result["eval_loss"]["packed"]
                == result["medians"]["packed"]["eval_loss"]
            )
        else:
            ratio = result["ratios"][f"packed/{claim['versus']}"]
            assert claim["measured_ratio"] == ratio["useful_tokens_per_second"]
            assert claim["cpu_ratio"] == ratio["useful_tokens_per_cpu_second"]
    # The budget side: the largest budget that still packs the epoch into n / k rows or more.
    assert result["budget_rows_per_epoch"] >= math.ceil(rows / k)
    budget_run = next(r for r in runs if r["side"] == "packed_budget")
    assert budget_run["micro_batches"] == result["budget_rows_per_epoch"]
    if sweep:
        assert k == sweep["best"]
        per = sweep["per_row_size"]
        for c in sweep["candidates"]:
            assert c["accumulation"] * c["examples_per_row"] == per_step
            assert c["micro_batch"] == c["examples_per_row"] and c["max_tokens"] is None
            assert per[str(c["examples_per_row"])]["micro_batches"] == rows // c["examples_per_row"]
        assert set(per) == {str(b) for b in sweep["row_sizes"]}
        assert max(per, key=lambda b: per[b]["useful_tokens_per_cpu_second"]) == str(sweep["best"])
        assert len(sweep["runs"]) == sweep["repeats"] * len(sweep["row_sizes"])
    assert {"1min", "5min", "15min"} <= set(result["load_average_at_start"])


def test_smoke_run_writes_a_complete_result(cache_dir, tmp_path):
    result, _ = smoke("seq2seq packing", tmp_path, cache_dir)
    check(result, repeats=1, rows=48)
    sweep = result["row_sweep"]
    assert [(c["examples_per_row"], c["accumulation"]) for c in sweep["candidates"]] == [(8, 2), (16, 1)]
    assert result["dataset"] == "news" and result["setup"]["data"]["source"] == "builtin:news_summaries"
    assert result["setup"]["data"]["eval_rows"] == 16


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-samples", "20"], "multiple of the micro batch size"),
        (["--examples-per-row", "8,x"], "comma-separated positive integers"),
        (["--examples-per-row", "8,12"], "must divide --examples-per-step"),
        (["--max-samples", "1000"], "must be a multiple of every --examples-per-row [16, 32]"),
        (["--dataset", "wiki"], "invalid choice"),
    ],
)
def test_bad_arguments_are_usage_errors(tmp_path, args, message):
    assert_usage_error("seq2seq packing", tmp_path, args, message)


@pytest.mark.parametrize("dataset", sorted(SPEC["datasets"]))
def test_committed_result_records_its_setup_and_measurement(dataset):
    result = json.loads((ROOT / SPEC["datasets"][dataset]["output"]).read_text())
    assert result["dataset"] == dataset
    repeats = len({r["repeat"] for r in result["runs"]})
    # Interleaved rounds, paired by seed, on all the bundled rows.
    assert repeats >= 2 and result["setup"]["data"]["rows"] == 992
    check(result, repeats=repeats, rows=992)
    check_committed(result)
    assert result["row_sweep"] is not None, "the committed packed row size was chosen by a sweep"
    assert result["setup"]["data"]["eval_rows"] == 100
