"""Resumable checkpoints: written atomically, found again on relaunch, pruned to the newest few.

A checkpoint is a directory `run_dir/checkpoints/step-00000120/` holding
- `engine/`: the backend's own checkpoint of the engine (Engine.save_checkpoint: trainable weights,
  optimizer and LR-scheduler state, each rank's shards where they are sharded; frozen base weights are left
  out for adapters, since the base is reloaded from the model source on resume),
- `rng/rank-N.json` + `rng/rank-N.safetensors`: each rank's Python, NumPy and torch RNG states and its own
  counters, so dropout draws the same masks after a resume (engine/rng.py),
- `steps/rank-N.safetensors`: what the step source keeps per rank beyond its position (a rollout source's
  generator, say; engine/steps.py), only where it keeps something,
- `state.json`: the loop's position (step, epoch, the step source's position in it), the counters summary.json is
  built from, and what the run must share with the checkpoint (engine/compatibility.py). Written
  last: a checkpoint is complete when its directory has its final name, and that happens only after every
  rank finished writing into a temporary directory (`.tmp-step-...`) that is then renamed in one step, so a
  crash while saving leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lorakit import dist, rundir, storage
from lorakit.backends import Engine
from lorakit.engine import branches, manifest, steps
from lorakit.engine.compatibility import DOC, FORMAT_VERSION, check_compatible, recipe_fingerprint
from lorakit.engine.rng import read_rank_rng, write_rank_rng
from lorakit.errors import RankFailedError, RecipeError

ENGINE = "engine"
STATE = "state.json"
STEPS = "steps"
_NAME = re.compile(r"^step-(\d{8})$")
_TMP_PREFIX = ".tmp-"


@dataclass
class LoopState:
    """Where the training loop is and what it has counted so far (the same on every rank)."""

    step: int = 0
    epoch: int = 0
    # The step source's position in `epoch` after the last window trained ({}: the epoch's start), the same
    # on every rank (engine/steps.py).
    position: dict[str, Any] = field(default_factory=dict)
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

    @classmethod
    def from_saved(cls, saved: dict[str, Any]) -> LoopState:
        """The state a checkpoint's state.json holds under "loop". A checkpoint from before step sources
        has `micro_batches_done` instead of a position: the static source's position, which it names so."""
        saved = dict(saved)
        if "micro_batches_done" in saved:
            done = saved.pop("micro_batches_done")
            saved.setdefault("position", {steps.DONE: done} if done else {})
        return cls(**saved)


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk."""

    path: Path
    step: int
    state: dict[str, Any]


def checkpoints_dir(run_dir: Path) -> Path:
    """Where a run keeps its checkpoints."""
    return run_dir / rundir.CHECKPOINTS


def _named(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every checkpoint under its final name with a state.json, oldest first."""
    root = checkpoints_dir(run_dir)
    found = []
    if root.is_dir():
        for d in root.iterdir():
            m = _NAME.match(d.name)
            if m and (d / STATE).is_file():
                found.append((int(m.group(1)), d))
    return sorted(found)


def complete_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """The run's complete checkpoints (final name, readable state.json), oldest first; their files are
    not checked against the manifest here (damage)."""
    found = []
    for step, d in _named(run_dir):
        try:
            found.append(Checkpoint(d, step, json.loads((d / STATE).read_text())))
        except (OSError, ValueError):
            continue
    return found


def damage(path: Path) -> str | None:
    """What is wrong with the checkpoint directory `path` (an unreadable state.json, no engine/, files
    that differ from its manifest), or None; reads nothing with pickle. A checkpoint of a lorakit from
    before manifests (its state.json names none) is checked for its parts only."""
    try:
        state = json.loads((path / STATE).read_text())
    except (OSError, ValueError) as e:
        return f"its {STATE} cannot be read ({e})"
    if not (path / ENGINE).is_dir():
        return f"it has no {ENGINE}/"
    if state.get("manifest") != manifest.MANIFEST:
        return None
    return manifest.problem(path)


def _read(path: Path) -> Checkpoint:
    state = json.loads((path / STATE).read_text())
    return Checkpoint(path, int(state["loop"]["step"]), state)


def read_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint directory named by the user (train.resume: PATH), checked to be complete and as saved
    (its manifest) before anything in it is loaded."""
    path = Path(path).expanduser().resolve()
    if not (path / STATE).is_file() or not (path / ENGINE).is_dir():
        raise RecipeError(
            f"train.resume: {path} is not a complete lorakit checkpoint (no {STATE} and {ENGINE}/ in it); "
            "give a directory like OUTPUT_DIR/checkpoints/step-00000120, or auto",
            doc=DOC,
        )
    why = damage(path)
    if why is not None:
        raise RecipeError(
            f"train.resume: {path} is damaged: {why}; nothing was loaded from it. Name another checkpoint, "
            "or auto",
            doc="docs/resume.md#damaged-checkpoints",
        )
    return _read(path)


def find_resume(recipe, run_dir: Path, world: int | None = None) -> Checkpoint | None:
    """The checkpoint this run resumes from (train.resume: auto | never | PATH), checked against its
    manifest, the recipe and the world size (default: this process group's); None to start fresh. Rank 0
    decides (and moves abandoned or damaged checkpoints aside, engine/branches.py); every rank gets the
    same answer."""
    choice = error = failure = None
    if dist.is_main():
        try:
            with dist.phase("resume"):
                choice = _choose(recipe, run_dir, dist.world_size() if world is None else world)
        except RecipeError as e:
            # Every rank must raise, or the others would wait for rank 0 forever.
            error = (str(e), e.doc)
        except Exception as e:  # not bad input (an unreadable file): the others still stop with its cause
            failure, error = e, (f"rank 0 failed during resume: {type(e).__name__}: {e}", None)
    path, error = dist.broadcast_object((str(choice.path) if choice else None, error))
    if failure is not None:
        raise failure
    if error and error[0].startswith("rank 0 failed during resume: "):
        raise RankFailedError(f"{error[0]}; rank {dist.rank()} stopped with it")
    if error:
        raise RecipeError(error[0], doc=error[1] or DOC)
    return _read(Path(path)) if path else None


def _choose(recipe, run_dir: Path, world: int) -> Checkpoint | None:
    resume = recipe.train.resume
    if resume == "never":
        # Start over: the earlier checkpoints are moved aside, not deleted (a failed relaunch loses nothing).
        branches.set_aside(run_dir, [d for _, d in _named(run_dir)], "train.resume: never")
        return None
    if resume == "auto":
        ckpt, fell_back = _newest_sound(run_dir)
        if ckpt is None:
            return None
    else:
        ckpt, fell_back = read_checkpoint(Path(resume)), True
    check_compatible(ckpt, recipe, world)
    if fell_back:
        _follow_branch(run_dir, ckpt)
    return ckpt


def _newest_sound(run_dir: Path) -> tuple[Checkpoint | None, bool]:
    """The newest checkpoint that is as saved, and whether a damaged newer one was passed over (each is
    moved aside with a warning naming it); RecipeError when there are checkpoints but none is sound."""
    named = _named(run_dir)
    damaged = []
    for _, d in reversed(named):
        why = damage(d)
        if why is None:
            return _read(d), bool(damaged)
        print(f"warning: checkpoint {d} is damaged ({why}); falling back to the previous one", flush=True)
        damaged.append(f"{d.name}: {why}")
        branches.set_aside(run_dir, [d], f"damaged checkpoint {d.name}")
    if damaged:
        raise RecipeError(
            f"train.resume: auto: every checkpoint in {checkpoints_dir(run_dir)} is damaged "
            f"({'; '.join(damaged)}); they were moved to {branches.abandoned_dir(run_dir)} and nothing was "
            "loaded. Resume from a copy you trust (train.resume: PATH) or start over (train.resume: never)",
            doc="docs/resume.md#damaged-checkpoints",
        )
    return None, False


def _follow_branch(run_dir: Path, ckpt: Checkpoint) -> None:
    """Resuming from an older step than the newest (a rollback, or a fallback past a damaged one): the
    newer checkpoints and best/ weights from after `ckpt` belong to the abandoned branch; move them aside
    so that a later `resume: auto` and best/ follow the chosen one."""
    newer = [d for step, d in _named(run_dir) if step > ckpt.step or (step == ckpt.step and d != ckpt.path)]
    best = branches.best_step(run_dir)
    best_newer = best is not None and best > ckpt.step
    branches.set_aside(run_dir, newer, f"rolled back to step {ckpt.step}", best=best_newer)


def save_checkpoint(
    engine: Engine,
    recipe,
    run_dir: Path,
    loop: LoopState,
    rank_counters: dict[str, Any],
    *,
    adapter: bool,
    reason: str,
    rank_steps: dict[str, Any] | None = None,
) -> Path:
    """Write a complete checkpoint of the current step on every rank (collective); return its path.
    `rank_steps`: this rank's StepSource.rank_state() (tensors; nothing is written for none)."""
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
            rank_steps or {},
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


def _write_rank_part(
    engine: Engine, tmp: Path, rank_counters, rank_steps, adapter: bool, what: str, final: Path
) -> None:
    """This rank's share of a checkpoint: its engine partition, RNG states and counters, and the step
    source's own state."""
    # The backend's save runs its own collectives (its barriers): a rank failing inside it leaves
    # the others there, not at the agreement, so they learn it through dist.foreign_collectives.
    with dist.foreign_collectives(), storage.writing(what, final):
        # Frozen base weights are not state: resume reloads them from model.name_or_path.
        engine.save_checkpoint(tmp, ENGINE, trainable_only=adapter)
    with storage.writing(what, final):
        write_rank_rng(tmp / "rng", rank_counters)
        if rank_steps:
            _write_rank_steps(tmp / STEPS, rank_steps)


def _rank_steps_file(steps_dir: Path) -> Path:
    return steps_dir / f"rank-{dist.rank()}.safetensors"


def _write_rank_steps(steps_dir: Path, tensors: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    steps_dir.mkdir(exist_ok=True)
    # safetensors refuses views that share memory; the source's state is small (a generator, a few rollouts).
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(_rank_steps_file(steps_dir)))


def _read_rank_steps(steps_dir: Path) -> dict[str, Any]:
    """This rank's step-source state; {} where the checkpoint has none (a static source, an older one)."""
    path = _rank_steps_file(steps_dir)
    if not path.is_file():
        return {}
    from safetensors.torch import load_file

    return load_file(str(path))


def _publish(recipe, run_dir: Path, loop: LoopState, reason: str, final: Path, tmp: Path, what: str) -> None:
    """Rank 0: state.json last, then the rename that makes the checkpoint complete, then the prune."""
    with storage.writing(what, final):
        state = {
            "format": FORMAT_VERSION,
            "manifest": manifest.MANIFEST,
            "reason": reason,
            "world_size": dist.world_size(),
            "fingerprint": recipe_fingerprint(recipe),
            "recipe": recipe.model_dump(mode="json"),
            "loop": asdict(loop),
        }
        rundir.write_json(tmp / STATE, state)
        # Every file with its size and hash, checked before a resume loads any of it (engine/manifest.py).
        manifest.write_manifest(tmp, rundir.write_json)
        # Same step saved twice (an epoch end that is also an `every` step): the newer one replaces it.
        storage.replace_directory(tmp, final)
    prune(run_dir, recipe.checkpoint.keep)


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints, and leftovers of interrupted saves."""
    found = _named(run_dir)
    # Silent: checkpoint.keep is the recipe's own policy, and a line per save cluttered every short run.
    for _, old in found[: max(len(found) - keep, 0)]:
        shutil.rmtree(old, ignore_errors=True)
    remove_partial_saves(run_dir)


def remove_partial_saves(run_dir: Path) -> None:
    """Delete what interrupted or failed saves left (`.tmp-step-*`); only safe when no rank is writing."""
    for d in checkpoints_dir(run_dir).glob(f"{_TMP_PREFIX}*"):
        shutil.rmtree(d, ignore_errors=True)


def load_checkpoint(
    engine: Engine, ckpt: Checkpoint, *, adapter: bool
) -> tuple[LoopState, dict[str, Any], dict[str, Any]]:
    """Restore the engine, this rank's RNG states and counters from `ckpt` (collective); return the loop
    state, this rank's counters and its step-source state (for StepSource.load_rank_state)."""
    # The frozen base is not in an adapter checkpoint; it came from the model source already.
    engine.load_checkpoint(ckpt.path, ENGINE, trainable_only=adapter)
    counters = read_rank_rng(ckpt.path / "rng")
    return LoopState.from_saved(ckpt.state["loop"]), counters, _read_rank_steps(ckpt.path / STEPS)
