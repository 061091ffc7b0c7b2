"""Resumable checkpoints: written atomically, found again on relaunch, pruned to the newest few.

A checkpoint is a directory `run_dir/checkpoints/step-00000120/` holding
- `engine/`: DeepSpeed's own checkpoint of the engine (trainable weights, optimizer and LR-scheduler state,
  partitioned per rank under ZeRO; frozen base weights are left out for adapters, since the base is
  reloaded from the model source on resume),
- `rng/rank-N.json` + `rng/rank-N.safetensors`: each rank's Python, NumPy and torch RNG states and its own
  counters, so dropout draws the same masks after a resume,
- `state.json`: the loop's position (epoch, micro-batches done in it, step), the counters summary.json is
  built from, and what the run must share with the checkpoint (recipe fingerprint, world size). Written
  last: a checkpoint is complete when its directory has its final name, and that happens only after every
  rank finished writing into a temporary directory (`.tmp-step-...`) that is then renamed in one step, so a
  crash while saving leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lorakit import rundir, storage
from lorakit.engine import dist
from lorakit.errors import RecipeError

ENGINE = "engine"
STATE = "state.json"
_NAME = re.compile(r"^step-(\d{8})$")
_TMP_PREFIX = ".tmp-"
DOC = "docs/resume.md#resuming-trainresume"
FORMAT_VERSION = 1

# Recipe keys that do not change the training trajectory: a relaunch may change them and still resume.
_FREE_KEYS = {
    ("train", "resume"),
    ("train", "log_every"),
    ("train", "on_nonfinite"),
    ("train", "max_skipped_steps"),
    ("train", "early_stopping_patience"),
    ("checkpoint",),
    ("eval",),
    ("output",),
    ("distributed", "backend"),
    ("distributed", "timeout_minutes"),
    ("data", "num_proc"),
    ("data", "cache_dir"),
}


@dataclass
class LoopState:
    """Where the training loop is and what it has counted so far (the same on every rank)."""

    step: int = 0
    epoch: int = 0
    # Micro-batches of `epoch` already trained (every rank trains the same number).
    micro_batches_done: int = 0
    losses: list[float] = field(default_factory=list)
    global_real_tokens: int = 0
    global_token_slots: int = 0
    train_seconds: float = 0.0
    skipped_steps: list[int] = field(default_factory=list)
    eval: dict[str, Any] = field(default_factory=dict)
    # Lines of metrics.jsonl written up to this state: a resume drops the lines an interrupted run wrote
    # after its last checkpoint, so the file reads as one uninterrupted run.
    metrics_records: int = 0
    # The step of the last evaluation (0: none yet), so an epoch end right after an eval.every evaluation
    # does not evaluate the same weights twice.
    last_eval_step: int = 0
    # checkpoint.best_metric: {metric, mode, value, step, epoch} of the best evaluation so far, and the
    # evaluations since it (train.early_stopping_patience); engine/best.py keeps them.
    best: dict[str, Any] | None = None
    evals_since_best: int = 0
    # Why training stopped before its planned steps (early_stopping), so a relaunch does not continue it.
    stop_reason: str | None = None

    def tokens_per_second(self) -> float:
        """Useful (non-pad) tokens per second of training, over all ranks."""
        return self.global_real_tokens / self.train_seconds if self.train_seconds else 0.0


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk."""

    path: Path
    step: int
    state: dict[str, Any]


def checkpoints_dir(run_dir: Path) -> Path:
    """Where a run keeps its checkpoints."""
    return run_dir / rundir.CHECKPOINTS


def recipe_fingerprint(recipe) -> str:
    """A digest of every recipe value that shapes the training trajectory (data, model, method, optimiser,
    batching, parallelism), so a checkpoint is never resumed into a different run. Values left at their
    defaults are not part of it, so a lorakit release that adds a recipe key can still resume older runs."""
    raw = recipe.model_dump(mode="json", exclude_defaults=True)
    for path in _FREE_KEYS:
        node = raw
        for key in path[:-1]:
            node = node.get(key, {})
        node.pop(path[-1], None)
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _differences(va, vb, f"{prefix}{key}.")
        elif va != vb:
            out.append(f"{prefix}{key}: {va!r} then, {vb!r} now")
    return out


def complete_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """The run's complete checkpoints, oldest first."""
    root = checkpoints_dir(run_dir)
    found = []
    if root.is_dir():
        for d in root.iterdir():
            m = _NAME.match(d.name)
            if m and (d / STATE).is_file():
                found.append(Checkpoint(d, int(m.group(1)), json.loads((d / STATE).read_text())))
    return sorted(found, key=lambda c: c.step)


def read_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint directory named by the user (train.resume: PATH), checked to be complete."""
    path = Path(path).expanduser().resolve()
    if not (path / STATE).is_file() or not (path / ENGINE).is_dir():
        raise RecipeError(
            f"train.resume: {path} is not a complete lorakit checkpoint (no {STATE} and {ENGINE}/ in it); "
            "give a directory like OUTPUT_DIR/checkpoints/step-00000120, or auto",
            doc=DOC,
        )
    state = json.loads((path / STATE).read_text())
    return Checkpoint(path, int(state["loop"]["step"]), state)


def find_resume(recipe, run_dir: Path, world: int | None = None) -> Checkpoint | None:
    """The checkpoint this run resumes from (train.resume: auto | never | PATH), checked against the recipe
    and the world size (default: this process group's); None to start fresh. Rank 0 decides; every rank
    gets the same answer."""
    choice = error = None
    if dist.is_main():
        try:
            choice = _choose(recipe, run_dir, dist.world_size() if world is None else world)
        except RecipeError as e:
            # Every rank must raise, or the others would wait for rank 0 forever.
            error = str(e)
    path, error = dist.broadcast_object((str(choice.path) if choice else None, error))
    if error:
        raise RecipeError(error, doc=DOC)
    return read_checkpoint(Path(path)) if path else None


def _choose(recipe, run_dir: Path, world: int) -> Checkpoint | None:
    resume = recipe.train.resume
    root = checkpoints_dir(run_dir)
    if resume == "never":
        shutil.rmtree(root, ignore_errors=True)
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir)
        if not found:
            return None
        ckpt = found[-1]
    else:
        ckpt = read_checkpoint(Path(resume))
    check_compatible(ckpt, recipe, world)
    return ckpt


def check_compatible(ckpt: Checkpoint, recipe, world: int) -> None:
    """Refuse a checkpoint written by a different recipe or world size, naming what differs."""
    state = ckpt.state
    if state.get("format") != FORMAT_VERSION:
        raise RecipeError(
            f"{ckpt.path}: checkpoint format {state.get('format')} is not {FORMAT_VERSION}",
            doc="docs/resume.md#format-and-trust",
        )
    if state["world_size"] != world:
        raise RecipeError(
            f"{ckpt.path} was written by {state['world_size']} processes and this run has {world}: ZeRO "
            "partitions its optimizer state per process, so resume with the same number of processes (or "
            "set train.resume: never to start over)",
            doc=DOC,
        )
    if state["fingerprint"] != recipe_fingerprint(recipe):
        then = state.get("recipe", {})
        now = recipe.model_dump(mode="json")
        # Keys a newer lorakit added are absent from `then`; at their defaults they changed nothing.
        then = _with_defaults(then, recipe.model_dump(mode="json", exclude_defaults=True), now)
        diff = [d for d in _differences(then, now) if not _free(d)]
        raise RecipeError(
            f"{ckpt.path} was written by a different recipe ({'; '.join(diff[:5]) or 'fingerprint differs'}): "
            "resuming would not continue the same run. Restore those values, set train.resume: never to "
            "start over in this output.dir, or use another output.dir",
            doc=DOC,
        )


def _with_defaults(then: dict, set_now: dict, now: dict) -> dict:
    out = dict(then)
    for key, value in now.items():
        if isinstance(value, dict):
            out[key] = _with_defaults(then.get(key, {}) or {}, set_now.get(key, {}), value)
        elif key not in then and key not in set_now:
            out[key] = value
    return out


def _free(difference: str) -> bool:
    key = tuple(difference.split(":", 1)[0].split("."))
    return any(key[: len(p)] == p for p in _FREE_KEYS)


def _rng_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
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


def _set_rng_state(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
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
    meta, tensors = _rng_state()
    try:
        yield
    finally:
        _set_rng_state(meta, tensors)


def save_checkpoint(
    engine,
    recipe,
    run_dir: Path,
    loop: LoopState,
    rank_counters: dict[str, Any],
    *,
    adapter: bool,
    reason: str,
) -> Path:
    """Write a complete checkpoint of the current step on every rank (collective); return its path."""
    root = checkpoints_dir(run_dir)
    name = f"step-{loop.step:08d}"
    final, tmp = root / name, root / f"{_TMP_PREFIX}{name}"
    what = f"the checkpoint of step {loop.step}"
    # Agreed collectively: every rank writes its part, then all learn whether any failed (a full disk, an
    # error) before any goes on. Only then, with no rank still writing, does rank 0 remove the partial
    # directory; the previous checkpoint stays the newest complete one.
    try:
        dist.on_main("checkpoint save", _fresh_directory, tmp, at=loop.step)
        dist.on_every_rank(
            "checkpoint save",
            _write_rank_part,
            engine,
            tmp,
            rank_counters,
            adapter,
            what,
            final,
            at=loop.step,
        )
        dist.on_main(
            "checkpoint save", _publish, recipe, run_dir, loop, reason, final, tmp, what, at=loop.step
        )
    except Exception:
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _fresh_directory(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def _write_rank_part(engine, tmp: Path, rank_counters, adapter: bool, what: str, final: Path) -> None:
    """This rank's share of a checkpoint: its engine partition, RNG states and counters."""
    with storage.writing(what, final):
        # Frozen base weights are not state: resume reloads them from model.name_or_path.
        engine.save_checkpoint(str(tmp), tag=ENGINE, save_latest=False, exclude_frozen_parameters=adapter)
        write_rank_rng(tmp / "rng", rank_counters)


def write_rank_rng(rng_dir: Path, rank_counters: dict[str, Any]) -> None:
    """This rank's Python, NumPy and torch RNG states and its counters, under `rng_dir`."""
    from safetensors.torch import save_file

    meta, tensors = _rng_state()
    rng_dir.mkdir(exist_ok=True)
    r = dist.rank()
    save_file(tensors, str(rng_dir / f"rank-{r}.safetensors"))
    rundir.write_json(rng_dir / f"rank-{r}.json", {"rng": meta, "counters": rank_counters})


def _publish(recipe, run_dir: Path, loop: LoopState, reason: str, final: Path, tmp: Path, what: str) -> None:
    """Rank 0: state.json last, then the rename that makes the checkpoint complete, then the prune."""
    root = final.parent
    with storage.writing(what, final):
        state = {
            "format": FORMAT_VERSION,
            "reason": reason,
            "world_size": dist.world_size(),
            "fingerprint": recipe_fingerprint(recipe),
            "recipe": recipe.model_dump(mode="json"),
            "loop": asdict(loop),
        }
        rundir.write_json(tmp / STATE, state)
        _fsync_tree(tmp)
        if final.exists():
            # Same step saved twice (an epoch end that is also an `every` step): keep the newer one.
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    prune(run_dir, recipe.checkpoint.keep)


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints, and leftovers of interrupted saves."""
    found = complete_checkpoints(run_dir)
    for old in found[: max(len(found) - keep, 0)]:
        shutil.rmtree(old.path, ignore_errors=True)
    remove_partial_saves(run_dir)


def remove_partial_saves(run_dir: Path) -> None:
    """Delete what interrupted or failed saves left (`.tmp-step-*`); only safe when no rank is writing."""
    for d in checkpoints_dir(run_dir).glob(f"{_TMP_PREFIX}*"):
        shutil.rmtree(d, ignore_errors=True)


def load_checkpoint(engine, ckpt: Checkpoint, *, adapter: bool) -> tuple[LoopState, dict[str, Any]]:
    """Restore the engine, this rank's RNG states and counters from `ckpt` (collective); return the loop
    state and this rank's counters."""
    from safetensors.torch import load_file

    path, _ = engine.load_checkpoint(
        str(ckpt.path),
        tag=ENGINE,
        # The frozen base is not in an adapter checkpoint; it came from the model source already.
        load_module_strict=not adapter,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the engine state from {ckpt.path / ENGINE}")
    r = dist.rank()
    saved = json.loads((ckpt.path / "rng" / f"rank-{r}.json").read_text())
    _set_rng_state(saved["rng"], load_file(str(ckpt.path / "rng" / f"rank-{r}.safetensors")))
    return LoopState(**ckpt.state["loop"]), saved["counters"]


def _fsync_tree(path: Path) -> None:
    # The rename must not reach the disk before the files it publishes.
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
