"""What a checkpoint must share with the run that resumes it: lorakit's checkpoint format, the world size,
and every recipe value that shapes the training trajectory (a fingerprint of them, and the differences named
when they do not match)."""

from __future__ import annotations

import hashlib
import json

from lorakit.errors import RecipeError

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


def check_compatible(ckpt, recipe, world: int) -> None:
    """Refuse a checkpoint (engine.checkpoint.Checkpoint) written by a different recipe or world size,
    naming what differs."""
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
