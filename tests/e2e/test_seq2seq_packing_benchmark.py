"""benchmarks/seq2seq_packing.py: a smoke run of the script, and a check of the committed result."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "seq2seq_packing.py"
COMMITTED = ROOT / "benchmarks" / "results" / "seq2seq_packing.json"
SIDES = ("padded_random", "padded_grouped", "packed")
COMPARISONS = ("packed/padded_random", "packed/padded_grouped")
CLAIMS = {
    "packed_vs_padded_random_speed": ("packed/padded_random", 2.0),
    "packed_vs_padded_grouped_speed": ("packed/padded_grouped", 1.0),
    "packed_eval_loss_vs_padded_random": None,
}
TOP_KEYS = {
    "benchmark",
    "measured",
    "claims",
    "claims_met",
    "claims_at_matched_budget",
    "chosen_max_tokens",
    "matched_max_tokens",
    "max_tokens",
    "max_target_tokens",
    "command",
    "date",
    "load_average_at_start",
    "load_average_at_end",
    "timing",
    "setup",
    "sides",
    "batch_size_matching",
    "machine",
    "versions",
    "git_revision",
    "checks",
    "useful_tokens",
    "padding_efficiency",
    "source_efficiency",
    "target_efficiency",
    "eval_loss",
    "token_slots",
    "optimizer_steps",
    "examples_per_optimizer_step",
    "medians",
    "ratios",
    "budget_sweep",
    "runs",
    "lorakit_source",
    "benchmark_wall_seconds",
}
RUN_KEYS = {
    "side",
    "repeat",
    "max_tokens",
    "epoch_seconds",
    "eval_seconds",
    "step_seconds",
    "optimizer_steps",
    "micro_batches",
    "examples",
    "examples_per_optimizer_step",
    "useful_tokens",
    "token_slots",
    "padding_efficiency",
    "source_efficiency",
    "target_efficiency",
    "useful_tokens_per_second",
    "loss_first",
    "loss_last",
    "eval_loss",
    "attention",
    "torch_threads",
    "load_avg_1min_before",
}


def check_result(result: dict, repeats: int, rows: int) -> None:
    assert TOP_KEYS <= set(result)
    assert result["benchmark"] == "seq2seq_packing"
    assert result["setup"]["data"]["rows"] == rows
    # Every run of every side (and of the sweep) trained on the same tokens, each example once, and evaluated.
    checks = result["checks"]
    assert checks["useful_tokens_equal_on_all_runs"] is True and checks["each_example_once"] is True
    assert checks["every_run_evaluated"] is True
    assert checks["examples_per_run"] == rows
    useful = checks["useful_tokens"]
    assert isinstance(useful, int) and useful > 0
    sides = list(result["medians"])
    assert set(SIDES) <= set(sides)
    assert result["useful_tokens"]["per_side"] == {s: useful for s in sides}
    runs = result["runs"]
    assert len(runs) == repeats * len(sides)
    sweep = result["budget_sweep"]
    all_runs = runs + (sweep["runs"] if sweep else [])
    for run in all_runs:
        assert RUN_KEYS <= set(run), run
        assert run["useful_tokens"] == useful and run["examples"] == rows
        assert run["epoch_seconds"] > 0 and run["useful_tokens"] <= run["token_slots"]
        assert run["loss_first"] is not None and run["loss_last"] is not None
        assert isinstance(run["eval_loss"], float) and run["eval_loss"] > 0
        assert run["zero_stage"] == 0
    assert len({r["loss_tokens"] for r in all_runs}) == 1
    assert len({r["eval_rows"] for r in all_runs}) == 1  # the same validation rows on every run
    assert len({r["torch_threads"] for r in all_runs}) == 1
    for run in runs:
        packed = run["side"].startswith("packed")
        budget = (
            result["matched_max_tokens"] if run["side"] == "packed_matched" else result["chosen_max_tokens"]
        )
        assert run["max_tokens"] == (budget if packed else None)
        assert result["max_tokens"][run["side"]] == run["max_tokens"]
        assert run["attention"] == ("lorakit_varlen_sdpa" if packed else "sdpa")
        assert run["micro_batches"] == run["optimizer_steps"]  # no accumulation
        if packed:
            assert 0 < run["source_efficiency"] <= 1 and 0 < run["target_efficiency"] <= 1
    # Padded sides: micro-batches of 8 examples; packed: one row of several examples.
    steps = result["optimizer_steps"]
    assert steps["padded_random"] == steps["padded_grouped"] == rows // 8
    assert result["examples_per_optimizer_step"]["padded_random"] == 8
    setup = result["setup"]
    assert setup["processes"] == 1 and setup["dtype"] == "float32" and setup["train"]["micro_batch_size"] == 8
    assert set(setup["zero_stage"].values()) == {0} and setup["gradient_checkpointing"] is True
    assert setup["model"]["name_or_path"] == "tiny:t5"
    assert setup["data"]["max_source_length"] > 0 and setup["data"]["max_target_length"] > 0
    eff = result["padding_efficiency"]
    assert eff["padded_random"] < eff["padded_grouped"]
    for key in COMPARISONS:
        ratio = result["ratios"][key]
        assert {"useful_tokens_per_second", "paired_useful_tokens_per_second", "paired_median"} <= set(ratio)
        assert len(ratio["paired_useful_tokens_per_second"]) == repeats
    # Each flag reports the recorded measurement; whether a claim holds is not assumed.
    claims = {c["name"]: c for c in result["claims"]}
    assert set(claims) == set(CLAIMS) and result["claims_met"] == {
        n: c["claim_met"] for n, c in claims.items()
    }
    for name, spec in CLAIMS.items():
        claim = claims[name]
        if spec is None:
            med = result["medians"]
            assert claim["side_eval_loss"] == med["packed"]["eval_loss"] == result["eval_loss"]["packed"]
            assert claim["versus_eval_loss"] == med["padded_random"]["eval_loss"]
            assert claim["claim_met"] == (claim["side_eval_loss"] <= claim["versus_eval_loss"])
        else:
            key, threshold = spec
            assert claim["ratio_at_least"] == threshold
            assert claim["measured_ratio"] == result["ratios"][key]["useful_tokens_per_second"]
            assert claim["claim_met"] == (claim["measured_ratio"] >= threshold)
            cpu = result["ratios"][key]["useful_tokens_per_cpu_second"]
            assert claim["cpu_ratio"] == cpu and claim["cpu_claim_met"] == (cpu >= threshold)
    matched = result["claims_at_matched_budget"]
    assert (matched is not None) == ("packed_matched" in sides)
    for claim in matched or []:
        assert claim["side"] == "packed_matched"
        if "measured_ratio" in claim:
            key = f"packed_matched/{claim['versus']}"
            assert claim["measured_ratio"] == result["ratios"][key]["useful_tokens_per_second"]
            assert claim["claim_met"] == (claim["measured_ratio"] >= claim["ratio_at_least"])
        else:
            assert claim["side_eval_loss"] == result["eval_loss"]["packed_matched"]
            assert claim["claim_met"] == (claim["side_eval_loss"] <= claim["versus_eval_loss"])
    if sweep:
        assert result["chosen_max_tokens"] == sweep["best"]
        assert result["matched_max_tokens"] == sweep["matched_to_padded_batch"]["budget"]
        assert ("packed_matched" in sides) == (result["matched_max_tokens"] != result["chosen_max_tokens"])
        per = sweep["per_budget"]
        assert set(per) == {str(b) for b in sweep["budgets"]}
        assert max(per, key=lambda b: per[b]["useful_tokens_per_cpu_second"]) == str(sweep["best"])
        assert len(sweep["runs"]) == sweep["repeats"] * len(sweep["budgets"])
    machine, versions = result["machine"], result["versions"]
    assert machine["platform"] and machine["cpu_count"] and "cpu_model" in machine
    for name in ("python", "torch", "transformers", "peft", "deepspeed", "lorakit"):
        assert versions[name], name
    assert {"1min", "5min", "15min"} <= set(result["load_average_at_start"])


def test_smoke_run_writes_a_complete_result(cache_dir, tmp_path):
    out = tmp_path / "result.json"
    before = COMMITTED.read_bytes() if COMMITTED.exists() else None
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--max-samples",
            "48",
            "--max-eval-samples",
            "16",
            "--repeats",
            "1",
            "--budgets",
            "1024",  # a sweep of one budget: the sweep phase runs, in one run (< 90 s on 2 cores)
            "--cache-dir",
            str(cache_dir),
            "--output",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    check_result(result, repeats=1, rows=48)
    assert result["chosen_max_tokens"] == 1024 and result["budget_sweep"]["budgets"] == [1024]
    assert result["setup"]["data"]["eval_rows"] == 16
    assert out.with_suffix(".png").is_file() or "matplotlib is not installed" in proc.stdout
    assert (COMMITTED.read_bytes() if COMMITTED.exists() else None) == before


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-samples", "20"], "multiple of the micro batch size"),
        (["--budgets", "1024,x"], "comma-separated integers"),
    ],
)
def test_bad_arguments_are_usage_errors(tmp_path, args, message):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--output", str(tmp_path / "x.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and message in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_committed_result_records_its_setup_and_measurement():
    result = json.loads(COMMITTED.read_text())
    repeats = len({r["repeat"] for r in result["runs"]})
    rows = result["setup"]["data"]["rows"]
    # Interleaved rounds on at least half the bundled data, in about 10 minutes on a shared 2-core machine.
    assert repeats >= 2 and rows >= 512
    check_result(result, repeats=repeats, rows=rows)
    assert result["budget_sweep"] is not None, "the committed packed budget was chosen by a sweep"
    assert result["setup"]["data"]["eval_rows"] == 100
    # Other work may touch lorakit while a long benchmark runs; the training path must not have changed.
    changed = result["lorakit_source"]["changed_during_run"]
    assert result["lorakit_source"]["unchanged_during_run"] == (not changed)
    training_path = (
        "lorakit/engine/",
        "lorakit/data/",
        "lorakit/model/",
        "lorakit/recipe/",
        "lorakit/meter.py",
    )
    assert not [f for f in changed if f.startswith(training_path)], changed
