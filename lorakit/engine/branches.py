"""Checkpoints that a resume leaves behind, moved aside instead of deleted.

`train.resume: <older step>` starts a new branch of the run: the abandoned branch's newer checkpoints (and
its best/ weights, when they are from after the chosen step) are moved into
`checkpoints/abandoned/<when>-<why>/` with an `abandoned.json` saying what and why, so a later
`resume: auto` continues the chosen branch and pruning never weighs them against it. `train.resume: never`
and damaged checkpoints (engine/manifest.py) are set aside the same way: nothing a run wrote is deleted
because another run started.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from lorakit import rundir, storage

ABANDONED = "abandoned"
RECORD = "abandoned.json"


def abandoned_dir(run_dir: Path) -> Path:
    """Where set-aside checkpoints go."""
    return run_dir / rundir.CHECKPOINTS / ABANDONED


def best_step(run_dir: Path) -> int | None:
    """The step of the weights in run_dir/best (best.json), or None when there are none."""
    info = rundir.read_json_if_exists(run_dir / rundir.BEST / rundir.BEST_INFO)
    step = info.get("step") if isinstance(info, dict) else None
    return int(step) if isinstance(step, int) else None


def set_aside(run_dir: Path, checkpoints: list[Path], why: str, *, best: bool = False) -> Path | None:
    """Move `checkpoints` (and run_dir/best with `best`) into a new folder under checkpoints/abandoned/,
    recorded in its abandoned.json, and say so; returns the folder (None when there was nothing to move)."""
    best_dir = run_dir / rundir.BEST
    moving = [p for p in checkpoints if p.exists()] + ([best_dir] if best and best_dir.is_dir() else [])
    if not moving:
        return None
    slug = re.sub(r"[^a-z0-9]+", "-", why.lower()).strip("-")[:40]
    base = abandoned_dir(run_dir) / f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{slug}"
    folder, n = base, 1
    while folder.exists():
        n += 1
        folder = base.with_name(f"{base.name}-{n}")
    folder.mkdir(parents=True)
    for p in moving:
        os.rename(p, folder / p.name)
    record = {
        "why": why,
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "moved": [str(p.relative_to(run_dir)) for p in moving],
    }
    rundir.write_json(folder / RECORD, record)
    for parent in {p.parent for p in moving}:
        storage.fsync_dir(parent)
    names = ", ".join(p.name + "/" for p in moving)
    print(
        f"{why}: moved {names} aside to {folder} (recorded in {RECORD}; delete it when not needed)",
        flush=True,
    )
    return folder


def moved_aside(run_dir: Path) -> list[dict]:
    """The records of everything set aside in this run directory, oldest first."""
    root = abandoned_dir(run_dir)
    if not root.is_dir():
        return []
    records = []
    for folder in sorted(root.iterdir()):
        try:
            records.append({"folder": str(folder), **json.loads((folder / RECORD).read_text())})
        except (OSError, ValueError):
            continue
    return records
