"""Each rank's random number generators (Python, NumPy, torch and every CUDA device): saved with a checkpoint
so dropout draws the same masks after a resume, and put back after work that must not move them."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lorakit import dist, rundir


def rng_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """This process's Python and NumPy RNG states (JSON-able) and its torch and CUDA ones (tensors)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    meta = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = s
    return meta, tensors


def set_rng_state(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Put back the states rng_state returned."""
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available() and meta["cuda_devices"]:
        torch.cuda.set_rng_state_all([tensors[f"cuda{i}"] for i in range(meta["cuda_devices"])])


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Run the block without touching this process's Python, NumPy and torch RNG streams: what it draws
    (an evaluation's generation, say) is undone, so training's dropout masks stay those of a run without
    it."""
    meta, tensors = rng_state()
    try:
        yield
    finally:
        set_rng_state(meta, tensors)


def write_rank_rng(rng_dir: Path, rank_counters: dict[str, Any]) -> None:
    """This rank's Python, NumPy and torch RNG states and its counters, under `rng_dir`."""
    from safetensors.torch import save_file

    meta, tensors = rng_state()
    rng_dir.mkdir(exist_ok=True)
    r = dist.rank()
    save_file(tensors, str(rng_dir / f"rank-{r}.safetensors"))
    rundir.write_json(rng_dir / f"rank-{r}.json", {"rng": meta, "counters": rank_counters})


def read_rank_rng(rng_dir: Path) -> dict[str, Any]:
    """Restore this rank's RNG states written by write_rank_rng under `rng_dir`; return its counters."""
    from safetensors.torch import load_file

    r = dist.rank()
    saved = json.loads((rng_dir / f"rank-{r}.json").read_text())
    set_rng_state(saved["rng"], load_file(str(rng_dir / f"rank-{r}.safetensors")))
    return saved["counters"]
