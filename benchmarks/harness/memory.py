"""Memory of a multi-process run, as the rehearsal at real shapes measures it: each process's private memory
(RssAnon) sampled over the run, the phases and optimizer steps read from the run's own records, and the
peaks set against the planner's numbers."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

GIB = 1 << 30


class Sampler:
    """Samples the private memory (RssAnon, /proc/PID/status) of a process tree every `every` seconds, worker
    ranks named by their RANK variable: `samples` holds {t, rank -> bytes}."""

    def __init__(self, root: int, every: float = 0.2):
        self.root, self.every, self.t0, self.samples = root, every, time.monotonic(), []
        self._stop, self._thread = threading.Event(), threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        import psutil

        while not self._stop.wait(self.every):
            row = {"t": time.monotonic() - self.t0}
            try:
                procs = [psutil.Process(self.root), *psutil.Process(self.root).children(recursive=True)]
            except psutil.Error:
                procs = []
            for p in procs:
                try:
                    rank = p.environ().get("RANK") if p.pid != self.root else None
                    status = Path(f"/proc/{p.pid}/status").read_text().splitlines()
                except (psutil.Error, OSError):  # gone
                    continue
                anon = next((int(ln.split()[1]) * 1024 for ln in status if ln.startswith("RssAnon:")), None)
                if anon is not None:
                    row[f"rank{rank}" if rank is not None else f"pid{p.pid}"] = anon
            self.samples.append(row)


def step_times(run_dir: Path, seen: dict[int, float], t0: float) -> None:
    """Adds the time (since `t0`) each new train record of the run's metrics.jsonl was first seen at; step 0:
    when the first step began (its record's time less its duration)."""
    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return
    for line in f.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train" and rec["step"] not in seen:
            seen[rec["step"]] = time.monotonic() - t0
            if rec["step"] == 1 and rec.get("tokens_per_second"):
                seen[0] = seen[1] - rec["tokens"] / rec["tokens_per_second"]


def gib(n: float) -> float:
    return round(n / GIB, 3)


def _peaks(samples: list[dict], rows: list[dict]) -> dict:
    """Each rank's (of all the samples) peak private memory over `rows` (GiB)."""
    ranks = sorted({k for row in samples for k in row if k.startswith("rank")})
    return {rk: gib(max((r.get(rk, 0) for r in rows), default=0)) for rk in ranks}


def phases(samples: list[dict], step_t: dict[int, float], end: float) -> dict:
    """Peak private memory of each rank in each phase (GiB). Step 0's time is when the first step began (its
    record's time less its duration), step N's when its record was written."""
    last, began = max(step_t), step_t.get(0, step_t.get(1, end))
    bounds = {"load": (0.0, began), "first_step": (began, step_t.get(1, end))}
    bounds.update(steady=(step_t.get(2, end), step_t[last]), save=(step_t[last], end))
    return {
        name: _peaks(samples, [r for r in samples if a <= r["t"] <= b]) for name, (a, b) in bounds.items()
    }


def per_step(samples: list[dict], step_t: dict[int, float], peak: bool = False) -> dict:
    """Each rank's private memory at each step's record (GiB): flat in steady state, or growing. With `peak`:
    each rank's peak within each step, from the previous step's record (step 1: when it began) to its own. A
    sample at the record alone may land before or after ZeRO-3 frees what it gathered, so the peaks are what
    "flat from step 2 on" is judged by."""
    out, previous = {}, step_t.get(0)
    for step, t in sorted(step_t.items()):
        if step == 0:
            continue
        start = previous if peak and previous is not None else -math.inf
        rows, previous = [r for r in samples if start < r["t"] <= t], t
        if rows:
            out[step] = _peaks(samples, rows if peak else rows[-1:])
    return out


def per_step_peak(samples: list[dict], step_t: dict[int, float]) -> dict:
    return per_step(samples, step_t, peak=True)


def against_plan(result: dict) -> dict:
    """Each phase's peak per rank against the plan for that phase per process, the merge's peak against the
    merge's plan, and the growth from step 2 to the last step."""
    t = result["train"]
    planned = t["planned_phases_gib"]
    out = {"planned_per_process_gib": planned}
    for name, ranks in t["phases"].items():
        out[name] = {rk: round(v / planned[name], 3) for rk, v in ranks.items()}
    if result.get("merge") and planned.get("merge"):
        out["merge"] = round(result["merge"]["peak_private_gib"] / planned["merge"], 3)
    by_step = {str(k): v for k, v in t["per_step_peak"].items()}  # JSON keys, as a written result has them
    steps = sorted(by_step, key=int)
    first, last = by_step.get("2", by_step[steps[0]]), by_step[steps[-1]]
    out["growth_step2_to_last_gib"] = {rk: round(last[rk] - first[rk], 3) for rk in last}
    steady = [by_step[k] for k in steps if int(k) >= 2] or [last]
    spread = {rk: [v[rk] for v in steady] for rk in last}
    out["steady_step_range_gib"] = {rk: round(max(v) - min(v), 3) for rk, v in spread.items()}
    return out
