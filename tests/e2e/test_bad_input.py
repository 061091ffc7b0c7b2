"""Bad input through the real CLIs (recipes/quickstart.yaml: 2 processes, ZeRO-3): exit code 2, a message
naming the field, or the file and line, and no run directory."""

import json
import subprocess

import pytest

from lorakit.data.samples import builtin_dataset_dir
from tests.conftest import RECIPES, run_cli


def _cli(module: str, *args) -> subprocess.CompletedProcess:
    return run_cli(module, RECIPES / "quickstart.yaml", *args, timeout=300)


def _news_dir(tmp_path, bad_line: int | None = None, bad: str = "") -> str:
    """train/validation.jsonl with the first builtin news rows; line `bad_line` of train replaced by `bad`."""
    src = builtin_dataset_dir("news_summaries")
    out = tmp_path / "news"
    out.mkdir()
    for split in ("train", "validation"):
        lines = (src / f"{split}.jsonl").read_text().splitlines()[:8]
        if split == "train" and bad_line is not None:
            lines[bad_line - 1] = bad
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return str(out)


def test_every_recipe_mistake_is_named_in_one_message_and_nothing_is_written(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    proc = _cli(
        "lorakit.run",
        "train.learning_rate=1e-4",
        "train.micro_batch_size=eight",
        "distributed.zero_stage=5",
        "data.overlong=sometimes",
        "oops",
        f"data.cache_dir={cache}",
        f"output.dir={run_dir}",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "invalid recipe (5 problems):" in proc.stderr
    for line in (
        "  override 'oops': expected KEY=VALUE",
        "  train.learning_rate: unknown key",
        "  train.micro_batch_size: Input should be a valid integer",
        "  distributed.zero_stage: Input should be 0, 1, 2 or 3 (got 5)",
        "  data.overlong: Input should be 'truncate', 'drop' or 'error' (got 'sometimes')",
    ):
        assert line in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists() and not cache.exists()


@pytest.mark.parametrize(
    "case",
    ["missing column", "malformed JSON line", "over-long example"],
)
def test_bad_data_exits_2_names_the_field_or_line_and_writes_nothing(case, cache_dir, tmp_path):
    if case == "missing column":
        overrides, message = ["data.target_column=summary"], "data.target_column: column 'summary' not found"
    elif case == "malformed JSON line":
        source = _news_dir(tmp_path, bad_line=3, bad='{"article": "storm", "highlights": "rain"')
        overrides = [f"data.source={source}"]
        message = f"{source}/train.jsonl line 3: invalid JSON (Expecting ',' delimiter at column 42)"
    else:
        source = _news_dir(tmp_path)
        overrides = [f"data.source={source}", "data.overlong=error", "data.max_source_length=16"]
        message = f"data.overlong is error: {source}/train.jsonl line 1 has a"
    run_dir = tmp_path / "run"
    proc = _cli("lorakit.run", *overrides, f"data.cache_dir={cache_dir}", f"output.dir={run_dir}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()


def test_prepare_reports_bad_rows_too(cache_dir, tmp_path):
    row = json.loads((builtin_dataset_dir("news_summaries") / "train.jsonl").read_text().splitlines()[1])
    source = _news_dir(tmp_path, bad_line=2, bad=json.dumps({**row, "highlights": None}))
    proc = _cli("lorakit.prepare", f"data.source={source}", f"data.cache_dir={cache_dir}")
    assert proc.returncode == 2
    assert f"{source}/train.jsonl line 2: column 'highlights' is null" in proc.stderr
    assert "data.on_bad_rows: skip" in proc.stderr
