"""What a result records about where and on what it was measured: machine, versions, load, lorakit's source."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def machine() -> dict:
    """The machine a result was measured on (the host's CPU; a GPU result adds its device separately)."""
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    out = {"platform": platform.platform(), "machine": platform.machine(), "cpu_model": cpu}
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    out["cpu_bf16"] = sorted({"avx512_bf16", "amx_bf16"} & set(flags))  # [] : bf16 matmuls are emulated
    return {**out, "cpu_count": os.cpu_count(), "usable_cores": cores, "accelerator": "none (CPU only)"}


def versions() -> dict:
    """Python and the packages a training run depends on; lorakit as it reports itself."""
    import lorakit
    from lorakit.rundir import versions as run_versions

    return {**run_versions(), "lorakit": getattr(lorakit, "__version__", None)}


def load_average() -> dict:
    return dict(zip(("1min", "5min", "15min"), os.getloadavg(), strict=True))


def source_files() -> dict[str, str]:
    """{path: sha256} of lorakit's source files, to name the files that changed while a benchmark ran."""
    files = sorted((ROOT / "lorakit").rglob("*.py"))
    return {str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in files}


def source_digest(files: dict[str, str]) -> str:
    """One hash of lorakit's source files ({path: sha256}, as source_files gives them)."""
    return hashlib.sha256("".join(f"{p}\0{h}\n" for p, h in files.items()).encode()).hexdigest()[:16]


class Provenance:
    """Taken at the start of an invocation; `end()` returns the blocks a result records about it (lorakit's
    source is hashed at both ends: other work may go on in the checkout meanwhile)."""

    def __init__(self) -> None:
        from lorakit.rundir import git_revision

        self.t0, self.load = time.perf_counter(), load_average()
        self.date = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.revision, self.dirty, self.files = git_revision(ROOT), None, source_files()
        if self.revision:  # whether lorakit/ has uncommitted changes (None when git cannot tell)
            diff = subprocess.run(["git", "status", "--porcelain", "lorakit"], cwd=ROOT, capture_output=True)
            self.dirty = bool(diff.stdout.strip()) if diff.returncode == 0 else None

    def start(self) -> dict:
        """The fields known when the benchmark starts."""
        out = {"date": self.date, "load_average_at_start": self.load, "machine": machine()}
        return {**out, "versions": versions(), "git_revision": self.revision}

    def end(self) -> dict:
        """The fields known when it ends: what changed in lorakit meanwhile, the load, the wall time."""
        files = source_files()
        start, end = source_digest(self.files), source_digest(files)
        changed = sorted(p for p in self.files.keys() | files.keys() if self.files.get(p) != files.get(p))
        source = {"changed_during_run": changed, "git_revision_at_start": self.revision}
        source.update(uncommitted_changes_at_start=self.dirty, sha256_at_start=start, sha256_at_end=end)
        source["unchanged_during_run"] = start == end
        out = {"lorakit_source": source, "load_average_at_end": load_average()}
        return {**out, "benchmark_wall_seconds": time.perf_counter() - self.t0}
