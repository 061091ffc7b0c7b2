"""A checkpoint's manifest: every file it holds with its size and SHA-256, written when the checkpoint is
saved and checked before any of it is loaded.

Loading a checkpoint unpickles parts of it (DeepSpeed's torch.load, DCP's .metadata), so a damaged or
half-copied checkpoint must be found from its bytes alone, before either library opens a file. Hashing
streams each file once at save (rank 0, after every rank wrote its part) and once at resume.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 8 << 20


def file_digest(path: Path) -> str:
    """SHA-256 of a file, streamed in 8 MiB chunks (checkpoints of full fine-tuning are large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() != MANIFEST)


def describe(root: Path) -> dict:
    """The manifest of the directory `root`: {format, files: {relative path: {size, sha256}}}."""
    files = {
        p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": file_digest(p)}
        for p in _files(root)
    }
    return {"format": FORMAT, "files": files}


def write_manifest(root: Path, write_json) -> None:
    """Describe `root` into root/manifest.json through `write_json(path, obj)` (the run directory's
    durable JSON writer)."""
    write_json(root / MANIFEST, describe(root))


def problem(root: Path) -> str | None:
    """What is wrong with the checkpoint directory `root` against its manifest (a missing, extra, resized
    or changed file, an unreadable manifest), or None when every file is as saved. Sizes are compared
    first, so a truncated file is found without hashing the rest."""
    try:
        manifest = json.loads((root / MANIFEST).read_text())
        expected = manifest["files"]
    except FileNotFoundError:
        return f"its {MANIFEST} is missing"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST} cannot be read ({e})"
    present = {p.relative_to(root).as_posix(): p for p in _files(root)}
    missing = sorted(set(expected) - set(present))
    if missing:
        return f"{missing[0]} is missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    extra = sorted(set(present) - set(expected))
    if extra:
        return f"{extra[0]} is not in its {MANIFEST}"
    for name, want in expected.items():
        size = present[name].stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, {want['size']} when saved"
    for name, want in expected.items():
        if file_digest(present[name]) != want["sha256"]:
            return f"{name} changed since it was saved (SHA-256 differs)"
    return None
