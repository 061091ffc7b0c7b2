"""Running a benchmark script (benchmarks/NAME.py) from its tests: the smoke run and usage errors."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

RESULTS = ROOT / "benchmarks" / "results"


def run_script(name: str, *args, timeout: int = 900) -> subprocess.CompletedProcess:
    """`name`: the script, then any measurement of it ("seq2seq padding")."""
    script, *measurement = name.split()
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), *measurement, *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def smoke(name: str, tmp_path, cache_dir, *args) -> tuple[dict, subprocess.CompletedProcess]:
    """`--smoke` (the spec's small settings) into tmp_path/result.json; the committed results stay as
    they are. Returns the result and the finished process."""
    before = {p: p.read_bytes() for p in RESULTS.glob("*.json")}
    out = tmp_path / "result.json"
    proc = run_script(name, "--smoke", "--cache-dir", cache_dir, "--output", out, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p: p.read_bytes() for p in RESULTS.glob("*.json")} == before
    assert out.with_suffix(".png").is_file() or "needs matplotlib" in proc.stdout
    return json.loads(out.read_text()), proc


def assert_usage_error(name: str, tmp_path, args: list[str], message: str) -> None:
    """Bad options exit with code 2, say what is wrong, and write nothing."""
    proc = run_script(name, *args, "--output", tmp_path / "x.json", timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "x.json").exists()
