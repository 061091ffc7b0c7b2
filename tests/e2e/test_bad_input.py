"""Bad input: exit code 2, a message naming the field or column, and no run directory."""

import subprocess
import sys

import pytest

from tests.conftest import RECIPES, ROOT


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.learning_rate=1e-4", "train.learning_rate: unknown key"),
        ("train.micro_batch_size=eight", "train.micro_batch_size"),
        ("data.target_column=summary", "data.target_column: column 'summary' not found"),
        ("data.input_column=text", "data.input_column: column 'text' not found"),
    ],
)
def test_malformed_recipe_exits_2_and_writes_nothing(override, message, cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lorakit.run",
            str(RECIPES / "quickstart.yaml"),
            override,
            f"data.cache_dir={cache_dir}",
            f"output.dir={run_dir}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()


def test_prepare_reports_bad_columns_too(cache_dir, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lorakit.prepare",
            str(RECIPES / "quickstart.yaml"),
            "data.target_column=nope",
            f"data.cache_dir={cache_dir}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "data.target_column" in proc.stderr
