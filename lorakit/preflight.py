"""Checks before a run does any work: output.dir and data.cache_dir are directories (or can be created),
can be written, and their filesystems have room for what the run will write there.

The launching process (lorakit.train, `python -m lorakit.run`) calls `check_run_paths` before tokenizing,
loading the model or starting torchrun, so a path mistake costs seconds, not a model load. Failures are
RunDirError (exit code 2) naming the field, the path and the reason. The space needed is an estimate from
the model's parameter census (the planner's, on the meta device; no weights are read): the adapter or
model, one checkpoint, the merged export with output.merge, and a margin.
"""

from __future__ import annotations

import errno
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from lorakit.errors import RecipeError, RunDirError
from lorakit.storage import existing_ancestor, free_bytes

# Tokenized datasets are smaller than their text, but their size is unknown before tokenizing: a floor.
CACHE_MIN_BYTES = 64 << 20
# metrics.jsonl, summary.json, the resolved recipe, and the tokenizer files saved with the adapter (a
# large vocabulary's tokenizer.json is ~10 MB, saved again with a merged export).
MARGIN_BYTES = 32 << 20
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# A checkpoint holds, per trainable parameter: its weight in model.dtype, the fp32 master weight and Adam's
# two fp32 moments (lorakit/planner/states.py). Frozen weights are not in it.
_OPTIMIZER_BYTES = 4 + 8


@dataclass(frozen=True)
class SpaceNeed:
    """Bytes a run writes into output.dir, estimated from its parameter counts."""

    saved: int  # the adapter (lora, qlora) or the model (full)
    checkpoint: int  # one resumable checkpoint
    merged: int  # the merged export (output.merge), else 0
    saved_name: str = "the adapter"

    @property
    def total(self) -> int:
        return self.saved + self.checkpoint + self.merged + MARGIN_BYTES

    def describe(self) -> str:
        """`the adapter 2.0 MiB, one checkpoint 6.0 MiB, ...`."""
        parts = [f"{self.saved_name} {_fmt(self.saved)}", f"one checkpoint {_fmt(self.checkpoint)}"]
        if self.merged:
            parts.append(f"the merged model {_fmt(self.merged)}")
        parts.append(f"{_fmt(MARGIN_BYTES)} for logs and tokenizer files")
        return ", ".join(parts)


def check_run_paths(recipe) -> SpaceNeed | None:
    """Refuse (RunDirError) an output.dir or data.cache_dir that is a file, cannot be created or written,
    or whose filesystem lacks the space the run needs; return the estimate (None when the model's size
    could not be known without loading it). Creates nothing: a test file is made and removed at once."""
    out = Path(recipe.output.dir).expanduser().resolve()
    cache = Path(recipe.data.cache_dir).expanduser().resolve()
    check_directory(out, "output.dir")
    check_directory(cache, "data.cache_dir")
    need = estimate_space(recipe)
    out_need = need.total if need is not None else MARGIN_BYTES
    out_what = need.describe() if need is not None else f"{_fmt(MARGIN_BYTES)} (the model's size is unknown)"
    _check_space([(out, "output.dir", out_need, out_what), (cache, "data.cache_dir", CACHE_MIN_BYTES, None)])
    return need


def check_cache_dir(recipe) -> None:
    """The data.cache_dir part of check_run_paths (python -m lorakit.prepare writes nothing else)."""
    cache = Path(recipe.data.cache_dir).expanduser().resolve()
    check_directory(cache, "data.cache_dir")
    _check_space([(cache, "data.cache_dir", CACHE_MIN_BYTES, None)])


def prepare(recipe):
    """Tokenize and cache the recipe's data (or find it cached), after checking data.cache_dir; needs no GPU.
    Returns lorakit.data.PreparedData. Here, below the API and the doctor, since both prepare data."""
    from lorakit.model.source import load_config, load_tokenizer
    from lorakit.objectives import prepare_data  # the objective's rows (SFT examples, DPO pairs)

    check_cache_dir(recipe)
    check_model_dir(recipe)
    source, config = load_config(recipe)
    tokenizer = load_tokenizer(recipe, source)
    check_tokenizer(recipe, tokenizer)
    return prepare_data(recipe, tokenizer, config)


# A tokenizer is one of these files (fast: tokenizer.json; slow: its vocabulary or sentencepiece model).
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt",
)  # fmt: skip
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def check_model_dir(recipe) -> None:
    """A local model.name_or_path is a complete model directory: config.json, every shard its index names,
    weights, and a tokenizer. RecipeError (exit 2) naming the missing file otherwise; a hub id is left to
    the download."""
    name = recipe.model.name_or_path
    path = Path(name).expanduser()
    if not path.exists():
        if name.startswith(("/", "./", "../", "~")):
            raise RecipeError(f"model.name_or_path {name!r}: no such directory")
        return  # a hub id (or tiny:KIND)
    if not path.is_dir():
        raise RecipeError(f"model.name_or_path {name!r} is a file; point it at a model directory")
    missing = None if (path / "config.json").is_file() else "config.json"
    for index in _INDEXES:
        if missing is None and (path / index).is_file():
            missing = _missing_shard(path / index, name)
    if missing is not None:
        raise RecipeError(
            f"model.name_or_path {name!r}: {path / missing} is missing; the directory is incomplete "
            "(copy or download the model again)"
        )
    if not any(f.suffix in (".safetensors", ".bin", ".pt", ".pth") for f in path.iterdir()):
        raise RecipeError(f"model.name_or_path {name!r}: {path} holds no weight files (*.safetensors)")
    if not recipe.model.trust_remote_code and not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise RecipeError(
            f"model.name_or_path {name!r}: {path} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
            "save the model's tokenizer into it (tokenizer.save_pretrained)"
        )


def _missing_shard(index: Path, name: str) -> str | None:
    """The first shard file `index` names that is not beside it, or None."""
    import json

    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise RecipeError(f"model.name_or_path {name!r}: {index} is not a shard index ({e})") from e
    return next((shard for shard in shards if not (index.parent / shard).is_file()), None)


def check_tokenizer(recipe, tokenizer) -> None:
    """Padding needs a pad token: lorakit uses the tokenizer's own, else its eos token (documented in
    docs/faults.md); a tokenizer with neither is refused, naming the model."""
    if tokenizer.pad_token_id is None:
        raise RecipeError(
            f"model.name_or_path {recipe.model.name_or_path!r}: its tokenizer has neither a pad token nor an "
            "eos token, and lorakit pads with one of them; set pad_token (or eos_token) in its "
            "tokenizer_config.json"
        )


def check_directory(path: Path, field: str) -> None:
    """`path` is a writable directory, or can be created as one (RunDirError naming `field` otherwise)."""
    if path.exists():
        if not path.is_dir():
            raise RunDirError(
                f"{field} {path} exists and is not a directory; point {field} at a directory (it is "
                "created when missing), or move the file away"
            )
        _probe(path, field, path)
        return
    parent = existing_ancestor(path)
    if not parent.is_dir():
        raise RunDirError(f"{field} {path} cannot be created: {parent} is a file, not a directory")
    _probe(parent, field, path)


def _probe(directory: Path, field: str, path: Path) -> None:
    # Writing is the only reliable test: os.access trusts mode bits that root ignores, NFS servers that
    # squash root, and mounts that refuse every write (a read-only bind mount can say W_OK).
    probe = directory / f".lorakit-write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        reason = {
            errno.EROFS: "it is on a read-only filesystem",
            errno.EACCES: "permission denied",
            errno.EPERM: "operation not permitted",
            errno.ENOSPC: "no space left on the device",
            errno.EDQUOT: "the disk quota is used up",
        }.get(e.errno, e.strerror or str(e))
        where = f"{path} cannot be created in {directory}" if directory != path else f"{path} is not writable"
        raise RunDirError(
            f"{field}: {where}: {reason}; point {field} at a directory this user can write"
        ) from e


def _check_space(needs: list[tuple[Path, str, int, str | None]]) -> None:
    # Paths on one filesystem share its free space: output.dir and data.cache_dir are often on one disk.
    by_fs: dict[int, list[tuple[Path, str, int, str | None]]] = {}
    for need in needs:
        by_fs.setdefault(os.stat(existing_ancestor(need[0])).st_dev, []).append(need)
    for group in by_fs.values():
        path = group[0][0]
        free = free_bytes(path)
        total = sum(n for _, _, n, _ in group)
        if free >= total:
            continue
        wants = "; ".join(
            f"{field} {p} needs about {_fmt(n)}" + (f" ({what})" if what else "")
            for p, field, n, what in group
        )
        fields = " or ".join(field for _, field, _, _ in group)
        where = "its filesystem" if len(group) == 1 else "the filesystem they share"
        raise RunDirError(
            f"not enough free space: {wants}, and {where} has {_fmt(free)} free. Free space there or point "
            f"{fields} at another filesystem"
        )


def estimate_space(recipe) -> SpaceNeed | None:
    """What the run writes into output.dir, from the model config's parameter census (no weights read);
    None when the config cannot be had without loading the model (or running its remote code)."""
    config = _config(recipe)
    if config is None:
        return None
    try:
        from lorakit.planner.arch import arch_from_config
        from lorakit.planner.states import counts

        weight = _DTYPE_BYTES[recipe.model.dtype]
        arch = arch_from_config(config)
        c = counts(arch, recipe.method, weight, None)
    except Exception:  # an estimate must never stop a run the job itself could start
        return None
    adapter = recipe.method.adapter()
    # A PiSSA / OLoRA adapter is saved converted to rank 2r (engine/save.py): twice its LoRA matrices.
    saved_adapter = c.trainable * (2 if recipe.method.mutates_base() else 1)
    return SpaceNeed(
        saved=(saved_adapter if adapter else arch.total_params) * weight,
        checkpoint=c.trainable * (weight + _OPTIMIZER_BYTES),
        merged=arch.total_params * weight if recipe.output.merge else 0,
        saved_name="the adapter" if adapter else "the model",
    )


def _config(recipe):
    name = recipe.model.name_or_path
    if name.startswith("tiny:"):
        from lorakit.errors import RecipeError
        from lorakit.testing import tiny_config

        try:
            # Not through resolve_model_source: that builds the model into data.cache_dir.
            return tiny_config(name.removeprefix("tiny:"))
        except RecipeError:
            return None  # the job names the unknown kind
    if recipe.model.trust_remote_code:
        return None  # building its census would run the model's own code before the job decides to
    from lorakit.planner.arch import resolve_config
    from lorakit.planner.units import PlanError

    try:
        return resolve_config(recipe)  # a local directory's config.json, or the planner's built-in table
    except PlanError:
        pass
    try:
        from transformers import AutoConfig

        # The hub cache only: the check must not wait on the network (the job downloads what it needs).
        return AutoConfig.from_pretrained(name, revision=recipe.model.revision, local_files_only=True)
    except Exception:
        return None


def _fmt(n: int) -> str:
    from lorakit.units import format_bytes

    return format_bytes(n)
