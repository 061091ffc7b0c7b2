"""What a push may show the world (docs/publish.md#what-is-pushed): only the files lorakit wrote, a recipe
and card without this machine's absolute paths or any credential, and a list of every file and its size
printed before anything is uploaded.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import yaml

from lorakit.disclosure import redact, redact_data
from lorakit.recipe.load import load_yaml

# The files lorakit writes into adapter/, model/ and a merged export (engine/save.py, export/job.py, the
# tokenizer's and generation config's save_pretrained); anything else a user dropped there stays local.
WRITTEN = (
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_NOTE = "# lorakit.push replaced this machine's absolute paths by their last part: {fields}\n"


def written_by_lorakit(name: str) -> bool:
    """Whether a file named `name` in an adapter, model or merged export is one lorakit writes."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in WRITTEN)


def is_local_path(value: str) -> bool:
    """Whether `value` is an absolute path of this machine (/..., ~/..., C:\\...), not a Hub id or URL."""
    return value.startswith(("/", "~")) or bool(re.match(r"^[A-Za-z]:[\\/]", value))


def public_path(value: str) -> str:
    """An absolute local path as its last part (`/home/me/data/train.jsonl` -> `train.jsonl`); anything
    else unchanged."""
    if not is_local_path(value):
        return value
    path = PureWindowsPath(value) if re.match(r"^[A-Za-z]:", value) else PurePosixPath(value)
    return path.name or value


def public_recipe(text: str) -> tuple[str, list[str]]:
    """(the recipe YAML to publish, the dotted fields whose absolute paths were shortened): each absolute
    path becomes its last part, credentials are redacted, and a first comment line says what changed."""
    fields: list[str] = []
    # Bounded in depth and size as any recipe is (RecipeError, one line): the text was read back from disk.
    data = _shorten(load_yaml(text, "recipe.yaml"), "", fields)
    if not fields:
        return redact(text), []
    out = yaml.safe_dump(redact_data(data), sort_keys=False)
    return _NOTE.format(fields=", ".join(fields)) + out, fields


def _shorten(node: Any, where: str, fields: list[str]) -> Any:
    if isinstance(node, dict):
        return {k: _shorten(v, f"{where}.{k}" if where else str(k), fields) for k, v in node.items()}
    if isinstance(node, list):
        return [_shorten(v, f"{where}.{i}", fields) for i, v in enumerate(node)]
    if isinstance(node, str) and is_local_path(node):
        fields.append(where)
        return public_path(node)
    return node


def upload_lines(repo_id: str, files: dict[str, Path | bytes], card: str) -> list[str]:
    """What the push is about to upload: one line per file (its path in the repository and its size),
    after a line with the count and total size."""
    from lorakit.units import format_bytes

    sizes = {name: len(f) if isinstance(f, bytes) else Path(f).stat().st_size for name, f in files.items()}
    sizes["README.md"] = len(card.encode())
    width = max(len(name) for name in sizes)
    lines = [f"uploading to {repo_id}: {len(sizes)} files, {format_bytes(sum(sizes.values()))}"]
    lines += [f"  {name:<{width}}  {format_bytes(size)}" for name, size in sorted(sizes.items())]
    return lines
