"""A GPU benchmark's result beyond its runs: targets, plan and profile, the table it prints, the exit status,
and the parts of several invocations merged into one."""

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
        side = w.get("sides", {}).get(t.get("side"), {})
        if "ratio" in t:
            value = w.get("ratios", {}).get(t["ratio"])
        elif t.get("of") == "plan":
            value = (side.get("plan") or {}).get("ratio")
        else:
            value = side.get(t.get("of") or "mfu")
        out[key] = {**t, "measured": value, "met": None if value is None else target_met(t, value)}
    return out


def target_met(target: dict, value: float) -> bool:
    """`at_least` a value, or `within` a share of 1 (a measured/planned ratio)."""
    if "within" in target:
        return bool(abs(value - 1) <= target["within"])
    return bool(value >= target["at_least"])


def against_plan(recipe: dict, side: dict, gpu_memory: int | None) -> dict:
    """lorakit.plan for the recipe a side trained, on one GPU of this one's memory: its allocated bytes
    (per-GPU less the framework overhead) against the measured peak (on CPU: the process's peak RSS)."""
    try:
        from lorakit.planner import plan
        from lorakit.recipe import recipe_from_dict

        device = "cuda" if gpu_memory else "cpu"
        estimate = plan(recipe_from_dict(recipe), gpus=1, gpu_memory=gpu_memory, device=device).estimate
    except Exception as e:  # the measurement stands without it
        return {"error": f"{type(e).__name__}: {e}"[-1000:]}
    per_gpu = estimate.per_gpu_bytes
    planned = per_gpu - estimate.gpu_overhead
    peak = side.get("peak_gpu_memory_bytes") or side["peak_cpu_rss_bytes"]
    out = {"device": device, "planned_allocated_bytes": planned, "planned_per_gpu_bytes": per_gpu}
    return {**out, "measured_peak_bytes": peak, "ratio": peak / planned, "breakdown": estimate.to_dict()}


def describe_extras(side: dict) -> list[str]:
    """The log lines of a side's plan comparison and profile."""
    lines = []
    if (p := side.get("plan")) and "ratio" in p:
        gib = f"{p['measured_peak_bytes'] / 2**30:.1f} GiB measured, {p['planned_allocated_bytes'] / 2**30:.1f} planned"
        lines.append(f"against lorakit.plan: x{p['ratio']:.2f} ({gib})")
    if prof := side.get("profile"):
        busy = prof.get("device_busy_share")
        busy = "" if busy is None else f", device busy {busy:.0%}"
        syncs = prof.get("host_syncs")
        syncs = "" if syncs is None else f", {syncs} host syncs, {prof['kernel_launches']} kernel launches"
        lines.append(f"profile of step {prof['step']}: {prof['step_seconds']:.3f} s{busy}{syncs}")
        lines += [f"  {k['share']:6.1%} {k['calls']:5d}x {k['name'][:90]}" for k in prof["top"][:8]]
    return lines


DEVICE_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profile_summary(prof, step: int, seconds: float, top: int = 25) -> dict:
    """What one profiled step spent its time on: kernels (or CPU operators), device busy share, host ops."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    ranked = kernels or [e for e in events if e.self_cpu_time_total > 0]
    time_of = (lambda e: e.self_device_time_total) if kernels else (lambda e: e.self_cpu_time_total)
    spent = sum(time_of(e) for e in ranked)
    busy = spent / 1e6 if kernels else None  # the kernels' own time: the device was busy that long
    ranked = sorted(ranked, key=time_of, reverse=True)[:top]
    rows = [
        {"name": e.key[:200], "calls": e.count, "ms": time_of(e) / 1e3, "share": time_of(e) / (spent or 1)}
        for e in ranked
    ]
    host = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: e.self_cpu_time_total)
    out = {"step": step, "step_seconds": seconds, "what": "device kernels" if kernels else "CPU operators"}
    out.update(device_busy_seconds=busy, device_busy_share=None if busy is None else busy / seconds)
    out["kernel_launches"] = sum(e.count for e in kernels)
    # Where the host waited for the device (an .item() is one); without a device, the reads that would be.
    waits = DEVICE_SYNCS if kernels else ("aten::_local_scalar_dense",)
    out["host_syncs"] = sum(e.count for e in events if e.key in waits)
    out["host_top"] = [
        {"name": e.key[:200], "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3}
        for e in reversed(host[-10:])
    ]
    return {**out, "top": rows}


def share(value: float | None) -> str:
    """A fraction as a percentage, or n/a (no datasheet peak, or a result written before the count)."""
    return "n/a" if value is None else f"{value:.1%}"


def table(result: dict) -> str:
    lines = [
        "workload              side             useful tok/s     MFU MFUnemo  %matmul  pad.eff  peak GiB   vs hf"
    ]
    for name, w in result["workloads"].items():
        for side, r in w.get("sides", {}).items():
            if not measured(r):
                lines.append(f"{name:21s} {side:15s} {r.get('status', '?')}")
                continue
            ratio, mem = w["ratios"].get(f"{side}/hf"), (r["peak_gpu_memory_bytes"] or 0) / 2**30
            mfu, nemo, vs = share(r.get("mfu")), share(r.get("mfu_nemo")), f"x{ratio:.2f}" if ratio else ""
            rate, eff = r["useful_tokens_per_second"], r["padding_efficiency_timed"]
            matmul = r["mfu_vs_measured_matmul"]
            numbers = f"{rate:13,.0f} {mfu:>7s} {nemo:>7s} {matmul:7.1%} {eff:8.2f} {mem:9.1f} {vs:>7s}"
            lines.append(f"{name:21s} {side:15s} {numbers}")
        if not w.get("sides") and w.get("status") in ("skipped", "failed"):
            why = (w.get("reason") or w.get("error") or "").splitlines() or [""]
            lines.append(f"{name:21s} {w['status']}: {why[0][:70]}")
    return "\n".join(lines)


def exit_status(result: dict) -> int:
    """1 when a workload failed or is partial, or when GPU tests were asked for and did not pass; else 0."""
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
