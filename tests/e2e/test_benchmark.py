"""benchmarks/seq2seq.py padding: a smoke run of the script, and a check of the committed result."""

import json

from benchmarks.harness.cli import load_spec
from tests.e2e.benchmark_checks import check_committed, check_result
from tests.e2e.benchmark_runs import RESULTS, assert_usage_error, smoke

SPEC = load_spec("seq2seq_padding")
SIDES = ("baseline", "baseline_zero3", "expert", "lorakit_zero0", "lorakit_zero3")
HF_SIDES = ("baseline", "baseline_zero3", "expert")


def check(result: dict, repeats: int, sides=SIDES) -> None:
    check_result(result, SPEC, repeats)
    assert result["useful_tokens"]["equal_on_all_sides"] is True
    per_side = result["useful_tokens"]["per_side"]
    assert set(per_side) == set(sides) and len(set(per_side.values())) == 1
    tokens = next(iter(per_side.values()))
    assert tokens > 0 and len(result["runs"]) == repeats * len(sides)
    for run in result["runs"]:
        assert run["useful_tokens"] == tokens
        assert run["epoch_seconds"] > 0 and run["useful_tokens"] <= run["token_slots"]
    setup = result["setup"]
    assert setup["dtype"] in ("float32", "bfloat16") and setup["train"]["micro_batch_size"] == 8
    assert setup["data"]["max_source_length"] > 0 and setup["data"]["max_target_length"] > 0
    assert setup["processes"] == 1
    # Each lorakit side is compared with the Hugging Face pipelines that use DeepSpeed the same way: every
    # comparison whose two sides ran, and every claim whose two sides ran.
    ran = [c for c in SPEC["comparisons"] if set(c) <= set(sides)]
    assert set(result["ratios"]) == {f"{side}_vs_{base}" for side, base in ran}
    judged = [c["name"] for c in SPEC["claims"] if {c["side"], c["versus"]} <= set(sides)]
    assert [c["name"] for c in result["claims"]] == judged
    assert result["claims_met"] == (bool(judged) and all(c["claim_met"] for c in result["claims"]))
    if not judged:
        assert result["headline_pair"] is None and result["headline_ratio"] is None
    else:
        head = result["claims"][0]
        assert (
            result["headline_ratio"] == result["ratios"][result["headline_pair"]]["useful_tokens_per_second"]
        )
        assert result["headline_pair"] == f"{head['side']}_vs_{head['versus']}"
    caps = (setup["data"]["max_source_length"], setup["data"]["max_target_length"])
    for run in result["runs"]:
        if run["side"] in HF_SIDES:
            # The guide samples at random, the expert groups by length; both truncate to lorakit's caps (the
            # expert's longest rows reach them: auto caps are the longest source and the p95 target).
            expected = "group_by_length" if run["side"] == "expert" else "random"
            assert run["train_sampling_strategy"] == expected, run["side"]
            assert (run["max_source_length"], run["max_target_length"]) == caps, run["side"]


# The smoke run covers each worker path once: the guide's padding (with ZeRO-3), the expert's, and lorakit's
# packed rows (with ZeRO-3); the other two sides differ only in the ZeRO stage.
SMOKE_SIDES = ("baseline_zero3", "expert", "lorakit_zero3")


def test_smoke_run_writes_a_complete_result(cache_dir, tmp_path):
    result, _ = smoke("seq2seq padding", tmp_path, cache_dir, "--sides", ",".join(SMOKE_SIDES))
    check(result, repeats=1, sides=SMOKE_SIDES)
    assert result["setup"]["data"]["rows"] == 24
    eff = result["padding_efficiency"]
    # max_length padding wastes more slots than dynamic padding, and packed rows waste none.
    assert eff["baseline_zero3"] < eff["expert"] < eff["lorakit_zero3"] == 1.0
    slots = result["token_slots"]
    assert slots["baseline_zero3"] > slots["expert"] > slots["lorakit_zero3"]


def test_bad_max_samples_or_sides_are_usage_errors(tmp_path):
    assert_usage_error(
        "seq2seq padding", tmp_path, ["--max-samples", "20"], "multiple of the micro batch size"
    )
    assert_usage_error("seq2seq padding", tmp_path, ["--sides", "expert,lorakit"], "unknown side(s) lorakit")


def test_committed_result_records_its_setup_and_meets_the_claims():
    result = json.loads((RESULTS / "seq2seq_padding.json").read_text())
    repeats = len({r["repeat"] for r in result["runs"]})
    assert repeats >= 2
    check(result, repeats=repeats)
    check_committed(result)
    assert result["setup"]["data"]["rows"] == 1000
    assert result["headline_pair"] == "lorakit_zero0_vs_baseline"
    # Issue 32's bar: packed T5 >= 3.8x the guide's pipeline and >= 1.2x the expert's, side by side.
    claims = {c["name"]: c for c in result["claims"]}
    assert claims["lorakit_vs_guide_speed"]["ratio_at_least"] == 3.8
    assert claims["lorakit_vs_expert_speed"]["ratio_at_least"] == 1.2
    assert result["claims_met"], "the committed benchmark misses a claim; see benchmarks/README.md"
    # With ZeRO-3 on both sides lorakit must still be faster; how much is reported, not claimed (README).
    assert result["ratios"]["lorakit_zero3_vs_baseline_zero3"]["useful_tokens_per_second"] > 1.0
    # Packed rows hold no padding; the expert pads little, the guide most.
    eff = result["padding_efficiency"]
    assert eff["lorakit_zero0"] == eff["lorakit_zero3"] == 1.0 and eff["expert"] > 0.9 > 0.5 > eff["baseline"]


def test_readme_quotes_the_committed_ratios():
    """README.md's speed-up sentence is the committed result's, to two decimals (no number left behind by an
    earlier run)."""
    ratios = json.loads((RESULTS / "seq2seq_padding.json").read_text())["ratios"]
    zero0 = ratios["lorakit_zero0_vs_baseline"]["useful_tokens_per_second"]
    zero3 = ratios["lorakit_zero3_vs_baseline_zero3"]["useful_tokens_per_second"]
    expert = ratios["lorakit_zero0_vs_expert"]["useful_tokens_per_second"]
    readme = " ".join((RESULTS.parents[1] / "README.md").read_text().split())
    assert (
        f"{zero0:.2f}x the useful tokens/s of the padded Seq2SeqTrainer pipeline without ZeRO on either side, "
        f"{zero3:.2f}x with ZeRO-3 on both, and {expert:.2f}x an expert's"
    ) in readme


def test_committed_code_result_is_packed_t5_against_the_expert_side_by_side():
    """Issue 61: on long-tailed code -> docstring rows, packed T5 against the expert's length-grouped
    Seq2SeqTrainer, each side run more than once in one invocation, at least 1.08x."""
    result = json.loads((RESULTS / "seq2seq_padding_code.json").read_text())
    repeats = len({r["repeat"] for r in result["runs"]})
    assert repeats >= 2
    check(result, repeats=repeats, sides=("expert", "lorakit_zero0"))
    check_committed(result)
    assert result["setup"]["data"]["dataset"] == "code"
    assert result["setup"]["data"]["truncated_sources"] > 0  # the long tail reaches the cap
    assert result["ratios"]["lorakit_zero0_vs_expert"]["useful_tokens_per_second"] >= 1.08
