"""benchmarks/lora_vs_full.py: a smoke run of the script, and a check of the committed result."""

import json

from benchmarks.harness.checks import check_result
from benchmarks.harness.cli import load_spec
from tests.conftest import ROOT
from tests.e2e.benchmark_runs import RESULTS, assert_usage_error, smoke
from tests.unit.test_compare import assert_png

SPEC = load_spec("lora_vs_full")
COMMITTED = RESULTS / "lora_vs_full.json"
METHODS = ("lora", "full")
PLOTS = ("eval.png", "loss.png", "speed_memory.png")


def check(result: dict, lrs: int) -> None:
    check_result(result, SPEC, lrs)
    checks = result["checks"]
    assert checks["same_train_tokens_on_every_run"] and checks["same_steps_on_every_run"]
    assert len(result["runs"]) == 2 * lrs and {r["side"] for r in result["runs"]} == set(METHODS)
    for run in result["runs"]:
        assert run["method"] == run["side"] and run["eval_loss"] > 0 and run["tokens_per_second"] > 0
        # CPU seconds inside the training windows: at most the wall clock of the steps (one thread).
        assert 0 < run["train_cpu_seconds"] <= run["train_seconds"] * 1.05
        assert run["tokens_per_cpu_second"] == run["train_tokens"] / run["train_cpu_seconds"]
        state, bpp = run["model_state_bytes"], 4  # float32
        # Measured, and what it must be: one gradient and two AdamW moments per trainable weight (plus
        # AdamW's step counters), every weight held once.
        assert state["weights"] == run["total_params"] * bpp
        assert state["trainable_weights"] == state["grads"] == run["trainable_params"] * bpp
        assert 2 * state["trainable_weights"] <= state["optimizer"] <= 2 * state["trainable_weights"] + 4096
        if run["side"] == "full":
            assert run["trainable_params"] == run["total_params"]
        else:
            assert run["trainable_params"] < run["total_params"] / 5
    s = result["summary"]
    assert s["full_over_lora_model_state_bytes"] > 2 and s["full_over_lora_trainable_params"] > 5
    for speed in ("lora_over_full_tokens_per_cpu_second", "lora_over_full_tokens_per_second"):
        assert len(s[speed]["paired_per_round"]) == lrs and s[speed]["median"] > 0
    assert "changed_during_run" in result["lorakit_source"]
    for m in METHODS:
        assert result["best"][m]["eval_loss"] == min(r["eval_loss"] for r in result["runs"] if r["side"] == m)
    # Pre-training happened, and fine-tuning starts from it: the first fine-tuning loss is its model's.
    assert result["pretrain"]["loss_last"] < result["pretrain"]["loss_first"]
    assert len({r["loss_first"] for r in result["runs"]}) == 1
    assert result["compare"]["plots"] == list(PLOTS)


def test_smoke_run_writes_a_result_and_a_compare_report(cache_dir, tmp_path):
    result, _ = smoke("lora_vs_full", tmp_path, cache_dir)
    check(result, lrs=1)
    assert result["setup"]["finetune"]["rows"] == 16
    report = (tmp_path / "result" / "report.md").read_text()
    assert "| lora | lora |" in report and "| full | full |" in report
    for name in PLOTS:
        assert_png(tmp_path / "result" / name)
    assert_png(tmp_path / "result.png")


def test_bad_learning_rates_are_a_usage_error(tmp_path):
    assert_usage_error("lora_vs_full", tmp_path, ["--lrs", "1e-3,-1"], "comma-separated positive numbers")


def test_committed_result_records_its_setup_and_the_compare_report():
    result = json.loads(COMMITTED.read_text())
    lrs = len(result["setup"]["finetune"]["lrs"])
    assert lrs >= 3 and result["setup"]["finetune"]["rows"] == 1000
    check(result, lrs=lrs)
    # Each method is judged at its best learning rate; a best at the edge of the grid would mean the grid
    # was too narrow to find it.
    grid = result["setup"]["finetune"]["lrs"]
    for m in METHODS:
        assert min(grid) < result["best"][m]["lr"] < max(grid), m
    report_dir = COMMITTED.with_suffix("")
    assert result["compare"]["report"] == str((report_dir / "report.md").relative_to(ROOT))
    assert "| lora | lora |" in (report_dir / "report.md").read_text()
    for name in PLOTS:
        assert_png(report_dir / name)
    assert_png(COMMITTED.with_suffix(".png"))
