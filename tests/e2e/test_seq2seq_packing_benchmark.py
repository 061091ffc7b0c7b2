"""benchmarks/seq2seq_packing.py: a smoke run of the script, and a check of the committed result."""

import json
import math
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "seq2seq_packing.py"
COMMITTED = ROOT / "benchmarks" / "results" / "seq2seq_packing.json"  # dialogues
COMMITTED_NEWS = ROOT / "benchmarks" / "results" / "seq2seq_packing_news.json"
SIDES = ("padded_random", "padded_grouped", "packed", "packed_budget")
COMPARISONS = (
    "packed/padded_random",
    "packed/padded_grouped",
    "packed/packed_budget",
    "packed_budget/padded_random",
)
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
    "dataset",
    "chosen_max_tokens",
    "chosen_examples_per_row",
    "budget_rows_per_epoch",
    "micro_batch",
    "max_tokens",
    "accumulation",
    "examples_per_step",
    "seeds",
    "mean_source_tokens",
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
    "row_sweep",
    "runs",
    "lorakit_source",
    "benchmark_wall_seconds",
}
RUN_KEYS = {
    "side",
    "repeat",
    "seed",
    "micro_batch",
    "max_tokens",
    "accumulation",
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
    sweep = result["row_sweep"]
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
    per_step = result["examples_per_step"]
    k = result["chosen_examples_per_row"]
    for run in runs:
        packed = run["side"].startswith("packed")
        assert run["max_tokens"] == (result["chosen_max_tokens"] if run["side"] == "packed_budget" else None)
        assert result["max_tokens"][run["side"]] == run["max_tokens"]
        assert result["accumulation"][run["side"]] == run["accumulation"]
        assert result["micro_batch"][run["side"]] == run["micro_batch"]
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
    # batches of 8), packed up to the packer's rounding.
    steps = result["optimizer_steps"]
    assert steps["padded_random"] == steps["padded_grouped"] == math.ceil(rows / per_step)
    assert result["examples_per_optimizer_step"]["padded_random"] == rows / steps["padded_random"]
    # Random rows: exactly the padded sides' steps. Budget rows hold at most k examples on average: never
    # fewer (larger) optimizer steps than padded.
    assert steps["packed"] == steps["padded_random"]
    assert result["examples_per_optimizer_step"]["packed"] == per_step
    assert steps["padded_random"] <= steps["packed_budget"] <= 1.25 * steps["padded_random"] + 1
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
            assert len(claim["paired_differences"]) == repeats
        else:
            key, threshold = spec
            assert claim["ratio_at_least"] == threshold
            assert claim["measured_ratio"] == result["ratios"][key]["useful_tokens_per_second"]
            assert claim["claim_met"] == (claim["measured_ratio"] >= threshold)
            cpu = result["ratios"][key]["useful_tokens_per_cpu_second"]
            assert claim["cpu_ratio"] == cpu and claim["cpu_claim_met"] == (cpu >= threshold)
    # The budget side: the largest budget that still packs the epoch into n / k rows or more.
    assert result["budget_rows_per_epoch"] >= math.ceil(rows / k)
    assert (
        next(r for r in runs if r["side"] == "packed_budget")["micro_batches"]
        == result["budget_rows_per_epoch"]
    )
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
            "--examples-per-step",
            "16",
            "--examples-per-row",
            "8,16",  # a sweep of two row sizes, then the four sides: six runs
            "--dataset",
            "news",
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
    sweep = result["row_sweep"]
    assert [c["examples_per_row"] for c in sweep["candidates"]] == [8, 16]
    assert [c["accumulation"] for c in sweep["candidates"]] == [2, 1]
    assert result["dataset"] == "news" and result["setup"]["data"]["source"] == "builtin:news_summaries"
    assert result["setup"]["data"]["eval_rows"] == 16
    assert out.with_suffix(".png").is_file() or "matplotlib is not installed" in proc.stdout
    assert (COMMITTED.read_bytes() if COMMITTED.exists() else None) == before


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-samples", "20"], "multiple of the micro batch size"),
        (["--examples-per-row", "8,x"], "comma-separated integers"),
        (["--examples-per-row", "8,12"], "must divide --examples-per-step"),
        (["--max-samples", "1000"], "must be a multiple of every --examples-per-row [16, 32]"),
        (["--dataset", "wiki"], "invalid choice"),
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


@pytest.mark.parametrize(
    "path, dataset", [(p, d) for p, d in ((COMMITTED, "dialogues"), (COMMITTED_NEWS, "news")) if p.exists()]
)
def test_committed_result_records_its_setup_and_measurement(path, dataset):
    result = json.loads(path.read_text())
    assert result["dataset"] == dataset
    repeats = len({r["repeat"] for r in result["runs"]})
    rows = result["setup"]["data"]["rows"]
    # Interleaved rounds, paired by seed, on all the bundled rows.
    assert repeats >= 2 and rows == 992
    check_result(result, repeats=repeats, rows=rows)
    assert result["row_sweep"] is not None, "the committed packed row size was chosen by a sweep"
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
