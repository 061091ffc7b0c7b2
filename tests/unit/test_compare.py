"""lorakit.report (lorakit.compare) on run directories written here: every method, missing fields, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import lorakit
from lorakit.report import CompareError, compare, plots, read_run
from lorakit.report.plots import loss_axis, loss_points
from lorakit.report.runs import unique_labels

GIB = 2**30


def write_run(path: Path, summary: dict | None, records: list[dict] | None = None) -> Path:
    """A run directory holding this summary.json (none if None) and metrics.jsonl (none if None)."""
    path.mkdir(parents=True)
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    if records is not None:
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def train_records(losses: list[float], target_tokens: int = 100, every: int = 1) -> list[dict]:
    return [
        {"kind": "train", "step": s, "epoch": 0, "loss": loss, "target_tokens": target_tokens}
        for s, loss in enumerate(losses, start=1)
        if s % every == 0 or s == len(losses)
    ]


def summary(method: str, **overrides) -> dict:
    s = {
        "method": method,
        "model": "google/flan-t5-xxl",
        "world_size": 8,
        "zero_stage": 3,
        "trainable_params": 18_874_368 if method != "full" else 11_135_332_352,
        "total_params": 11_154_206_720 if method != "full" else 11_135_332_352,
        "steps": 4,
        "train_tokens": 40_000,
        "tokens_per_second": 2000.0,
        "train_seconds": 1800.0,
        "peak_memory_bytes": {"gpu": 30 * GIB, "cpu_rss": 12 * GIB},
        "loss": {"first": 2.0, "last": 1.2},
        "eval": {"loss": 1.25, "rouge1": 41.5},
    }
    s.update(overrides)
    return s


def assert_png(path: Path) -> None:
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    with Image.open(path) as im:
        im.verify()  # a truncated or corrupt PNG raises here
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 200 and im.size[1] > 200


@pytest.fixture
def three_methods(tmp_path):
    evals = [{"kind": "eval", "step": 4, "epoch": 0, "loss": 1.25, "rouge1": 41.5}]
    # method: (summary overrides, training losses, eval records)
    runs = {
        "lora": ({}, [2.0, 1.6, 1.4, 1.2], evals),
        "qlora": (
            {
                "peak_memory_bytes": {"gpu": 12 * GIB, "cpu_rss": 10 * GIB},
                "tokens_per_second": 1500.0,
                "quantization": {"type": "bitsandbytes-nf4", "bits": 4},
            },
            [2.0, 1.7, 1.5, 1.3],
            [],
        ),
        "full": (
            {
                "peak_memory_bytes": {"gpu": 36 * GIB, "cpu_rss": 20 * GIB},
                "train_seconds": 3600.0,
                "eval": {"loss": 1.1, "rouge1": 43.0, "rouge2": 20.0},
            },
            [2.0, 1.5, 1.2, 1.0],
            [],
        ),
    }
    return [
        write_run(tmp_path / method, summary(method, **overrides), train_records(losses) + records)
        for method, (overrides, losses, records) in runs.items()
    ]


def test_compares_lora_qlora_and_full_runs_into_a_report_and_valid_pngs(three_methods, tmp_path):
    out = tmp_path / "report"
    result = compare(three_methods, output=out, gpu_hour_price=4.1)
    assert [r.method for r in result.rows] == ["lora", "qlora", "full"]
    assert [r.label for r in result.rows] == ["lora", "qlora", "full"]
    assert result.report == out.resolve() / "report.md" and result.output_dir == out.resolve()
    assert set(result.plots) == {"loss.png", "eval.png", "speed_memory.png"}
    for path in result.plots.values():
        assert path.parent == out.resolve()
        assert_png(path)
    full = result.rows[2]
    # Cost = train hours x processes x price: 1 h x 8 GPUs x $4.1.
    assert full.gpu_hours() == pytest.approx(8.0) and full.cost(4.1) == pytest.approx(32.8)
    assert result.rows[0].cost(4.1) == pytest.approx(16.4)
    report = result.report.read_text()
    assert (
        "| full | full | google/flan-t5-xxl | 8 | 11.1B (100.0%) | 36 GiB | 20 GiB | 2,000 | 60 min |"
        in report
    )
    assert "| lora | lora | google/flan-t5-xxl | 8 | 18.9M (0.2%) | 30 GiB |" in report
    assert "$32.80" in report and "$16.40" in report and "cost at $4.1/GPU-h" in report
    # rouge2 only in the full run: the others show n/a in that column.
    header = next(line for line in report.splitlines() if line.startswith("| run | method"))
    assert "eval loss" in header and "eval rouge1" in header and "eval rouge2" in header
    qlora_line = next(line for line in report.splitlines() if line.startswith("| qlora | qlora (nf4) |"))
    assert qlora_line.split(" | ")[header.split(" | ").index("eval rouge2")] == "n/a"
    # Relative to the first run (lora): the same tokens/s, 1.2x the GPU memory, 2x the time, eval loss -0.15.
    rel = next(line for line in report.splitlines() if line.startswith("| full | 1.00x"))
    assert "| 1.20x |" in rel and "| 2.00x |" in rel and "-0.1500" in rel
    for name in result.plots:
        assert f"]({name})" in report
    # The terminal table holds the same rows.
    text = result.table()
    assert text.splitlines()[0].startswith("run") and "$32.80" in text and "qlora" in text


def test_missing_fields_show_na_and_cpu_costs_are_explained(tmp_path):
    old = write_run(tmp_path / "old", {"method": "lora", "steps": 3}, None)
    cpu = write_run(
        tmp_path / "cpu",
        summary("full", world_size=2, peak_memory_bytes={"gpu": None, "cpu_rss": 900 * 2**20}, eval=None),
        train_records([3.0, 2.0, 1.5, 1.4, 1.3], every=2)
        + [{"kind": "eval", "step": 5, "epoch": 0, "loss": 1.6}, "not a dict", {"kind": "train"}],
    )
    (cpu / "metrics.jsonl").write_text((cpu / "metrics.jsonl").read_text() + "{half a line\n")
    result = compare([old, cpu], output=tmp_path / "out")
    old_row, cpu_row = result.rows
    assert old_row.tokens_per_second is None and old_row.cost(4.1) is None and old_row.device is None
    # The eval block missing from the summary is taken from the last eval record.
    assert cpu_row.device == "cpu" and cpu_row.eval == {"loss": 1.6}
    report = result.report.read_text()
    old_line = next(line for line in report.splitlines() if line.startswith("| old | lora"))
    assert old_line.count("n/a") >= 10
    cpu_line = next(line for line in report.splitlines() if line.startswith("| cpu | full"))
    assert "| n/a | 900 MiB |" in cpu_line and cpu_line.endswith("$4.10 * |")  # 0.5 h x 2 x $4.1
    assert "CPU run" in report and "not the price of the CPU time" in report
    assert any("no metrics.jsonl" in n for n in result.notes)
    assert any("skipped unreadable line(s) 5, 7" in n for n in result.notes)
    # Steps 2, 4, 5 were logged, not every step: the loss curve is drawn against steps.
    assert loss_axis(result.rows) == "step"
    assert_png(result.plots["loss.png"])


def test_loss_axis_is_tokens_when_every_step_was_logged(tmp_path):
    a = read_run(write_run(tmp_path / "a", summary("lora"), train_records([2.0, 1.0, 0.5], target_tokens=10)))
    b = read_run(write_run(tmp_path / "b", summary("full"), train_records([2.0, 1.0], target_tokens=30)))
    assert loss_axis([a, b]) == "target tokens"
    xs, ys, at_step = loss_points(a, "target tokens")
    assert xs == [10, 20, 30] and ys == [2.0, 1.0, 0.5] and at_step == {1: 10, 2: 20, 3: 30}
    for run, n in ((a, 3), (b, 2)):
        for i, r in enumerate(run.train_records):
            r["tokens"] = 1000 * (i + 1)
        assert len(run.train_records) == n
    assert loss_axis([a, b]) == "tokens"
    assert loss_points(b, "tokens")[0] == [1000, 2000]


def test_not_a_run_is_a_clear_error_and_nothing_is_written(tmp_path, three_methods):
    out = tmp_path / "out"
    (tmp_path / "file.txt").write_text("x")
    write_run(tmp_path / "running", None, train_records([1.0]))
    write_run(tmp_path / "broken", None, None)
    (tmp_path / "broken" / "summary.json").write_text("{not json")
    write_run(tmp_path / "listy", None, None)
    (tmp_path / "listy" / "summary.json").write_text("[1, 2]")
    cases = {
        tmp_path / "missing": "no such directory",
        tmp_path / "file.txt": "not a directory",
        tmp_path / "running": "no summary.json (it has metrics.jsonl: the run has not finished",
        tmp_path / "broken": "summary.json: unreadable",
        tmp_path / "listy": "expected a JSON object, found list",
    }
    for bad, message in cases.items():
        with pytest.raises(CompareError, match=message.replace("(", r"\(")) as e:
            compare([three_methods[0], bad], output=out)
        assert e.value.exit_code == 2 and isinstance(e.value, lorakit.LorakitError)
    with pytest.raises(CompareError, match="given twice"):
        compare([three_methods[0], tmp_path / "x" / ".." / "lora"], output=out)
    with pytest.raises(CompareError, match="at least one run"):
        compare([], output=out)
    for price in (-1.0, float("nan"), "4"):
        with pytest.raises(CompareError, match="gpu_hour_price"):
            compare(three_methods, output=out, gpu_hour_price=price)
    assert not out.exists()
    with pytest.raises(CompareError, match="exists and is not a directory"):
        compare(three_methods, output=tmp_path / "file.txt")


def test_labels_tell_runs_apart():
    paths = [Path("/r/a/run"), Path("/r/b/run"), Path("/r/c/other")]
    assert unique_labels(paths) == ["a/run", "b/run", "c/other"]
    assert unique_labels([Path("/x/lora"), Path("/y/full")]) == ["lora", "full"]


def test_without_matplotlib_the_report_is_written_and_old_plots_removed(three_methods, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert (out / "loss.png").parent.mkdir(parents=True) is None
    (out / "loss.png").write_bytes(b"stale")
    (out / "notes.txt").write_text("mine")
    monkeypatch.setattr(
        plots, "matplotlib_missing", lambda: "matplotlib is not installed (pip install matplotlib)"
    )
    result = compare(three_methods, output=out)
    assert result.plots == {} and not (out / "loss.png").exists() and (out / "notes.txt").is_file()
    assert "no plots: matplotlib is not installed" in result.report.read_text()


def test_default_output_is_compare_report_in_the_working_directory(three_methods, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plots, "matplotlib_missing", lambda: "not needed here")  # plots are tested above
    result = lorakit.compare(three_methods[:2])
    assert result.output_dir == tmp_path / "compare-report" and result.report.is_file()


def test_a_dpo_run_shows_its_preference_metrics_beside_an_sft_run_of_the_same_base(tmp_path):
    dpo_eval = {
        "loss": 0.31,
        "rewards/chosen": 0.52,
        "rewards/rejected": -0.41,
        "margin": 0.93,
        "accuracy": 96.9,
    }
    sft = write_run(tmp_path / "sft", summary("lora", eval={"loss": 1.25}), train_records([2.0, 1.2]))
    dpo_records = [dict(r, **{"rewards/chosen": 0.1, "margin": 0.2}) for r in train_records([0.69, 0.3])]
    dpo = write_run(
        tmp_path / "dpo",
        summary("lora", method_options=["dpo beta=0.1"], loss={"first": 0.69, "last": 0.3}, eval=dpo_eval),
        [*dpo_records, {"kind": "eval", "step": 2, "epoch": 0, **dpo_eval}],
    )
    result = compare([sft, dpo], output=tmp_path / "report")
    assert [r.objective for r in result.rows] == ["sft", "dpo"]
    report = result.report.read_text().splitlines()
    header = next(line for line in report if line.startswith("| run | method")).split(" | ")
    # The main table's rows (the relative table's rows come later and start alike).
    sft_row, dpo_row = (
        next(line for line in report if line.startswith(f"| {r} |")).split(" | ") for r in ("sft", "dpo")
    )
    column = {name: header.index(f"eval {name}") for name in ("loss", "dpo loss", *list(dpo_eval)[1:])}
    # The DPO loss is its own column: an SFT cross-entropy and a DPO loss are not one quantity.
    assert sft_row[column["loss"]] == "1.2500" and dpo_row[column["loss"]] == "n/a"
    assert dpo_row[column["dpo loss"]] == "0.3100" and sft_row[column["dpo loss"]] == "n/a"
    for name, shown in (("rewards/chosen", "0.52"), ("rewards/rejected", "-0.41"), ("margin", "0.93")):
        assert dpo_row[column[name]] == shown and sft_row[column[name]] == "n/a"
    assert dpo_row[column["accuracy"]] == "96.90"
    assert dpo_row[1] == "lora (dpo beta=0.1)" and "0.6900 -> 0.3000 (dpo)" in dpo_row
    # Relative to the SFT run: no difference of unlike losses.
    rel = next(line for line in report if line.startswith("| dpo | ") and "x |" in line)
    rel_header = next(line for line in report if line.startswith("| run | tokens/s")).split(" | ")
    assert rel.split(" | ")[rel_header.index("eval loss diff")] == "n/a"
    assert_png(result.plots["eval.png"])


def test_the_objective_is_read_from_the_summary_not_guessed_from_metric_names(tmp_path):
    """ORPO reports DPO's metric names; its summary.json records `objective: orpo`, which the comparison
    reads (a summary from before that key: recognised by its metrics, as before)."""
    orpo_eval = {
        "loss": 0.9,
        "rewards/chosen": -0.05,
        "rewards/rejected": -0.09,
        "margin": 0.04,
        "accuracy": 75.0,
    }
    records = [dict(r, **{"rewards/chosen": -0.1, "margin": 0.02}) for r in train_records([1.9, 1.1])]
    orpo = write_run(
        tmp_path / "orpo",
        summary(
            "lora",
            objective="orpo",
            method_options=["orpo lambda=0.1"],
            loss={"first": 1.9, "last": 1.1},
            eval=orpo_eval,
        ),
        [*records, {"kind": "eval", "step": 2, "epoch": 0, **orpo_eval}],
    )
    old = write_run(tmp_path / "old", summary("lora", eval=orpo_eval), records)
    plugin = write_run(tmp_path / "plugin", summary("lora", objective="someone_elses"), train_records([1.0]))
    rows = [read_run(p) for p in (orpo, old, plugin)]
    assert [r.objective for r in rows] == ["orpo", "dpo", "someone_elses"]
    # ORPO's loss is its own quantity; an objective this process does not know is kept apart by its name.
    assert rows[0].eval["orpo loss"] == 0.9 and "loss" not in rows[0].eval
    assert rows[2].loss_label == "someone_elses"
