"""python -m lorakit.compare on real runs: LoRA and full fine-tuning of the tiny T5, trained here."""

import pytest

import lorakit
from tests.conftest import run_cli, tiny_recipe
from tests.unit.test_compare import assert_png


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    """A LoRA run (eval with ROUGE) and a full fine-tuning run (eval loss only) of 3 steps each."""
    base = tmp_path_factory.mktemp("compare")
    for method in ("lora", "full"):
        recipe = tiny_recipe(
            cache_dir,
            base / method,
            method={"kind": method},
            train={"max_steps": 3, "lr": 3e-3 if method == "lora" else 1e-3},
            eval={"generate": method == "lora"},
            output={"save_adapter": False},
        )
        lorakit.train(recipe)
    return base


def test_compare_cli_puts_lora_and_full_side_by_side(runs, tmp_path):
    out = tmp_path / "report"
    proc = run_cli(
        "lorakit.compare", runs / "lora", runs / "full", "--output", out, "--gpu-hour-price", "2.5"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["run", "method", "model"]
    lora, full = (next(x for x in lines if x.startswith(name + " ")) for name in ("lora", "full"))
    assert lora.split()[1:3] == ["lora", "tiny:t5"] and full.split()[1:3] == ["full", "tiny:t5"]
    assert "(100.0%)" in full and "(100.0%)" not in lora
    assert "cost at $2.5/GPU-h" in lines[0] and lora.endswith(" *") and full.endswith(" *")  # CPU runs
    report = (out / "report.md").read_text()
    assert f"report: {out / 'report.md'}" in proc.stdout
    assert "| lora | lora | tiny:t5 | 1 |" in report and "| full | full | tiny:t5 | 1 |" in report
    assert "eval rouge1" in report and "CPU run" in report
    for name in ("loss.png", "eval.png", "speed_memory.png"):
        assert_png(out / name)
        assert f"plot:   {out / name}" in proc.stdout


def test_compare_cli_refuses_a_directory_that_is_not_a_run(runs, tmp_path):
    out = tmp_path / "report"
    proc = run_cli("lorakit.compare", runs / "lora", tmp_path, "--output", out)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {tmp_path}: not a lorakit run directory: no summary.json"
    assert not out.exists()
    usage = run_cli("lorakit.compare", "--help")
    assert usage.returncode == 0 and "./compare-report" in usage.stdout


def test_lorakit_compare_stays_callable_after_the_module_is_imported(runs, tmp_path, monkeypatch):
    import lorakit.compare  # rebinds the package attribute to the CLI module
    from lorakit.report import plots

    monkeypatch.setattr(plots, "matplotlib_missing", lambda: "not needed here")  # drawn in the test above

    result = lorakit.compare([runs / "lora", runs / "full"], output=tmp_path / "r")
    assert [r.method for r in result.rows] == ["lora", "full"]
    lora, full = result.rows
    assert full.trainable_params == full.total_params and lora.trainable_params < lora.total_params
    assert lora.eval["rouge1"] >= 0 and set(full.eval) == {"loss"}
    assert lora.steps == full.steps == 3 and len(lora.train_records) == 3
