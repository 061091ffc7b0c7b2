"""A GPU benchmark's result beyond its runs: the targets judged, the table it prints, the exit status, and
the parts of several invocations (one lease command each) merged into one result."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.harness.device import gpu_tests_passed


def measured(r: dict) -> bool:
    return r.get("status") == "measured"


def evaluate_targets(workloads: dict, targets: dict) -> dict:
    """Each target with its measured value and whether it was met (None: not measured)."""
    out = {}
    for key, t in targets.items():
        w = workloads.get(t["workload"], {})
        if "ratio" in t:
            value = w.get("ratios", {}).get(t["ratio"])
        else:
            value = w.get("sides", {}).get(t["side"], {}).get("mfu")
        out[key] = {**t, "measured": value, "met": None if value is None else bool(value >= t["at_least"])}
    return out


def table(result: dict) -> str:
    lines = [
        "workload              side             useful tok/s     MFU  %matmul  pad.eff  peak GiB   vs hf"
    ]
    for name, w in result["workloads"].items():
        for side, r in w.get("sides", {}).items():
            if not measured(r):
                lines.append(f"{name:21s} {side:15s} {r.get('status', '?')}")
                continue
            ratio, mem = w["ratios"].get(f"{side}/hf"), (r["peak_gpu_memory_bytes"] or 0) / 2**30
            mfu, vs = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a", f"x{ratio:.2f}" if ratio else ""
            rate, eff = r["useful_tokens_per_second"], r["padding_efficiency_timed"]
            numbers = (
                f"{rate:13,.0f} {mfu:>7s} {r['mfu_vs_measured_matmul']:7.1%} {eff:8.2f} {mem:9.1f} {vs:>7s}"
            )
            lines.append(f"{name:21s} {side:15s} {numbers}")
        if not w.get("sides") and w.get("status") in ("skipped", "failed"):
            why = (w.get("reason") or w.get("error") or "").splitlines() or [""]
            lines.append(f"{name:21s} {w['status']}: {why[0][:70]}")
    return "\n".join(lines)


def exit_status(result: dict) -> int:
    """The script's exit status for a measured result: 1 when a workload failed or is partial, or when GPU
    tests were asked for (--run-gpu-tests) and did not pass; else 0."""
    failed = [n for n, w in result["workloads"].items() if w.get("status") in ("failed", "partial")]
    gpu = result.get("gpu_tests")
    return 1 if failed or (gpu is not None and not gpu_tests_passed(gpu)) else 0


def merge(paths: list[str], output: Path, write) -> int:
    """Combine the results of several invocations into one, written by `write(result)`."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    devices = {p["peak_flops"]["device"] for p in parts}
    if len(devices) != 1:
        print(f"error: the parts were measured on different devices: {sorted(devices)}", file=sys.stderr)
        return 2
    result = dict(parts[0], workloads={})
    for p in parts:
        for name, w in p["workloads"].items():
            # An earlier measured copy beats a later skipped or failed one; a later try beats a skip.
            if measured(w) or result["workloads"].get(name, {"status": "skipped"}).get("status") == "skipped":
                result["workloads"][name] = w
    keys = ("command", "date", "git_revision", "lorakit_source_sha256", "benchmark_wall_seconds", "versions")
    fields = (*keys, "gpu_tests")
    result["parts"] = [{k: p.get(k) for k in fields} | {"workloads": list(p["workloads"])} for p in parts]
    result["command"] = " ; ".join(p["command"] for p in parts)
    result["benchmark_wall_seconds"] = sum(p.get("benchmark_wall_seconds") or 0 for p in parts)
    result["gpu_tests"] = ([p["gpu_tests"] for p in parts if p.get("gpu_tests")] or [None])[-1]
    write(result)
    print(table(result))
    print(f"wrote {output}")
    return 0
