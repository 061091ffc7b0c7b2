"""Helpers shared by the benchmark scripts: worker subprocesses, the machine and versions a result records,
a hash of lorakit's source, paired ratios.

The scripts are run from a checkout (`python benchmarks/NAME.py`); they put the checkout's root on sys.path
before importing this module as `benchmarks.common`.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSIONED = ("torch", "transformers", "peft", "deepspeed", "accelerate", "datasets", "lorakit")


def run_worker(script: str | Path, spec: dict, tmp: Path, name: str) -> dict:
    """Run `script --worker SPEC RESULT` in a fresh interpreter; returns the worker's JSON result plus
    `process_seconds` (the whole subprocess) and `load_avg_1min_before` (the machine's load when it began).

    Every run is its own process, so nothing (thread settings, DeepSpeed or transformers globals, allocator
    state) leaks from one run to the next. Raises RuntimeError with the tail of the run's output on failure.
    """
    spec_path, result_path, log_path = (tmp / f"{name}.{n}" for n in ("spec.json", "result.json", "log"))
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with open(log_path, "w") as out:
        proc = subprocess.run(
            [sys.executable, str(script), "--worker", str(spec_path), str(result_path)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    if proc.returncode != 0 or not result_path.is_file():
        tail = log_path.read_text()[-4000:]
        raise RuntimeError(f"{name} run failed (exit code {proc.returncode}); last output:\n{tail}")
    result = json.loads(result_path.read_text())
    result.update(process_seconds=time.perf_counter() - start, load_avg_1min_before=load)
    return result


def source_digest() -> str:
    """A hash of lorakit's source files, to detect code that changed while the benchmark ran."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted((ROOT / "lorakit").rglob("*.py")):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def source_files() -> dict[str, str]:
    """{path: sha256} of lorakit's source files, to name the files that changed while a benchmark ran."""
    import hashlib

    return {
        str(path.relative_to(ROOT)): hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        for path in sorted((ROOT / "lorakit").rglob("*.py"))
    }


def changed_files(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Paths added, removed or modified between two source_files() snapshots."""
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))


def source_dirty() -> bool | None:
    """Whether lorakit/ has uncommitted changes (None when git cannot tell)."""
    diff = subprocess.run(
        ["git", "status", "--porcelain", "--", "lorakit"], cwd=ROOT, capture_output=True, text=True
    )
    return bool(diff.stdout.strip()) if diff.returncode == 0 else None


def machine() -> dict:
    """The machine a result was measured on."""
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "accelerator": "none (CPU only)",
    }


def versions() -> dict:
    """Python and the versions of the packages a training run depends on."""
    out = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    import lorakit

    out["lorakit"] = getattr(lorakit, "__version__", out["lorakit"])
    return out


def load_average() -> dict:
    """The machine's 1/5/15-minute load averages now."""
    one, five, fifteen = os.getloadavg()
    return {"1min": one, "5min": five, "15min": fifteen}


def pairs(runs: list[dict], side: str, base_side: str) -> list[tuple[dict, dict]]:
    """(base run, side run) of every round (`repeat`) that ran both sides."""
    by_repeat: dict[int, dict] = {}
    for r in runs:
        by_repeat.setdefault(r["repeat"], {})[r["side"]] = r
    return [(d[base_side], d[side]) for _, d in sorted(by_repeat.items()) if base_side in d and side in d]


def paired_ratios(runs: list[dict], side: str, base_side: str, key: str) -> list[float]:
    """side / base of `key`, round by round."""
    return [s[key] / b[key] for b, s in pairs(runs, side, base_side)]


def median(values) -> float:
    return statistics.median(list(values))
