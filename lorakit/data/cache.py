"""Tokenized datasets cached on disk under a fingerprint of everything that shapes them."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import datasets

from lorakit import storage

# Bump when tokenization output changes for the same inputs, so stale caches are not reused.
# 2: rows are read and checked by lorakit.data.sources (CSV values stay text; bad-row stats).
FORMAT_VERSION = 2


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the tokenizer's vocabulary, rules and special tokens."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(tokenizer.get_vocab()).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    h.update(str(tokenizer.eos_token_id).encode())
    return h.hexdigest()[:16]


def fingerprint(parts: dict[str, Any]) -> str:
    """Stable short hash of a JSON-able description of the data settings."""
    payload = json.dumps({"format": FORMAT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def cache_path(cache_dir: str, key: str) -> Path:
    """Directory holding the tokenized splits for `key`."""
    return Path(cache_dir).expanduser() / "datasets" / key


def load_cached(path: Path) -> tuple[dict[str, datasets.Dataset], dict[str, Any]] | None:
    """The cached splits and metadata at `path`, or None when there is no complete entry."""
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        return None
    meta = json.loads(meta_file.read_text())
    splits = {name: datasets.load_from_disk(str(path / name)) for name in meta["splits"]}
    return splits, meta


def save_cached(path: Path, splits: dict[str, datasets.Dataset], meta: dict[str, Any]) -> None:
    """Write splits + meta.json atomically: a reader sees a complete entry or none."""
    # A full disk is a DiskFullError (exit 74, one line naming data.cache_dir), not a datasets traceback.
    with storage.writing(f"the tokenized data cache (data.cache_dir) {path.name}", path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        try:
            for name, ds in splits.items():
                ds.save_to_disk(str(tmp / name))
            (tmp / "meta.json").write_text(json.dumps({**meta, "splits": list(splits)}, indent=2))
            try:
                storage.publish_directory(tmp, path)  # fsynced, renamed, parent fsynced
            except OSError:
                # Another process finished the same entry first; theirs is equivalent.
                if not (path / "meta.json").is_file():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
