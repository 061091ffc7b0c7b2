"""python -m lorakit.doctor as a user types it: --quick on the causal quickstart in under a minute on a
2-core CPU, every check passing; a failed check exits 1 with what it means and what to do."""

from __future__ import annotations

import json
import os
import resource
import time

from tests.conftest import RECIPES, run_cli


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_quick_doctor_of_the_causal_quickstart_passes_in_under_a_minute(cache_dir, tmp_path):
    out = tmp_path / "doctor"
    start, cpu_start = time.monotonic(), _cpu_seconds()
    proc = run_cli(
        "lorakit.doctor", RECIPES / "quickstart_causal.yaml", "--quick", "--output", out,
        f"data.cache_dir={cache_dir}", f"output.dir={tmp_path / 'run'}", timeout=300,
    )  # fmt: skip
    elapsed, cpu = time.monotonic() - start, _cpu_seconds() - cpu_start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    # The command's own CPU time (every thread, user + system): under a minute means under a minute of wall
    # time on an idle machine of one core or more, whatever else shares the cores while the suite runs
    # (wall time on a loaded 2-core machine measures the other processes). About 20 s here.
    assert cpu < 60, f"--quick took {cpu:.0f} s of CPU time ({elapsed:.0f} s wall)"
    report = json.loads((out / "doctor.json").read_text())
    assert report["ok"] is True and report["quick"] is True
    assert report["recipe"] == str(RECIPES / "quickstart_causal.yaml")
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses["packed == alone"] == statuses["memory plan"] == "pass"
    assert statuses["block forward+backward"] == statuses["run time estimate"] == "pass"
    assert "| contracts | packed == alone | pass |" in (out / "doctor.md").read_text()
    assert "doctor: every check passed" in proc.stdout and "Traceback" not in proc.stderr


def test_a_failed_check_exits_1_and_says_what_to_do(tmp_path):
    # A build lock left by a killed DeepSpeed op build, an hour old: the environment check fails.
    lock = tmp_path / "extensions" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    old = time.time() - 3600
    os.utime(lock, (old, old))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    proc = run_cli("lorakit.doctor", "--output", tmp_path / "doctor", env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "FAILED environment/extension locks" in proc.stdout and f"rm {lock}" in proc.stdout
    assert "SKIP  contracts" in proc.stdout  # no recipe: the environment only
    assert json.loads((tmp_path / "doctor" / "doctor.json").read_text())["ok"] is False
