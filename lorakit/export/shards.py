"""Safetensors shards read and written one tensor at a time, so a merge holds one tensor, not one model.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
offsets) and the tensors' bytes. Every shape and dtype of the output is known from the base's headers
before anything is read, so each output shard's header is written first and its tensors are streamed in
after it. Each written shard is read back with the safetensors library and compared byte for byte (CRC-32)
with what was written.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from lorakit.errors import MergeError, VerificationError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

# safetensors dtype names <-> torch dtypes (the ones a transformers checkpoint holds).
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint: its key, the file holding it, its shape and dtype."""

    key: str
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory (the index's, in order), or [] when it has none."""
    index = directory / INDEX
    if index.is_file():
        names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [directory / n for n in names]
    return [directory / SINGLE] if (directory / SINGLE).is_file() else []


def read_entries(files: list[Path]) -> list[Entry]:
    """Every tensor of the checkpoint, from the headers only (nothing is loaded), in file order."""
    from safetensors import safe_open

    entries = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                dtype = _DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise MergeError(
                        f"{path}: tensor {key} has dtype {sl.get_dtype()}, which lorakit cannot merge"
                    )
                entries.append(Entry(key, path, tuple(sl.get_shape()), dtype))
    return entries


class Reader:
    """Reads tensors of a checkpoint one at a time, keeping one file open (entries come file by file)."""

    def __init__(self) -> None:
        self._path: Path | None = None
        self._file = None

    def get(self, entry: Entry) -> torch.Tensor:
        """The tensor of `entry`, in its stored dtype."""
        from safetensors import safe_open

        if entry.file != self._path:
            self.close()
            self._file = safe_open(str(entry.file), framework="pt").__enter__()
            self._path = entry.file
        return self._file.get_tensor(entry.key)

    def close(self) -> None:
        """Close the open file, if any."""
        if self._file is not None:
            self._file.__exit__(None, None, None)
        self._file, self._path = None, None


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes a tensor of `shape` and `dtype` takes."""
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def plan_shards(items: list[tuple[str, tuple[int, ...], torch.dtype]], max_bytes: int) -> list[list[int]]:
    """Group items (key, shape, dtype), in order, into shards of at most max_bytes (a larger tensor gets a
    shard of its own), as transformers' save_pretrained does; returns the item indices of each shard."""
    shards: list[list[int]] = []
    size = 0
    for i, (_, shape, dtype) in enumerate(items):
        b = nbytes(shape, dtype)
        if not shards or size + b > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += b
    return shards


def shard_names(count: int) -> list[str]:
    """transformers' file names: model.safetensors, or model-0000i-of-0000N.safetensors."""
    if count == 1:
        return [SINGLE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


class ShardWriter:
    """Writes one safetensors file whose tensors' keys, shapes and dtypes are known up front."""

    def __init__(self, path: Path, items: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
        offset = 0
        self._expect: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        for key, shape, dtype in items:
            size = nbytes(shape, dtype)
            header[key] = {
                "dtype": _NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
            self._expect.append((key, shape, dtype))
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.path = path
        self.size = offset
        self.crcs: dict[str, int] = {}
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close(), also on error
        self._file.write(struct.pack("<Q", len(text)) + text)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Append the next tensor (in the order given to the constructor)."""
        want = self._expect[len(self.crcs)]
        if (key, tuple(tensor.shape), tensor.dtype) != want:
            raise MergeError(
                f"internal: shard {self.path.name} expected {want}, got {key} {tuple(tensor.shape)}"
            )
        data = _bytes(tensor)
        self.crcs[key] = zlib.crc32(data)
        self._file.write(data)

    def close(self) -> None:
        """Finish the file; refuses one that did not get every tensor."""
        self.abort()
        if len(self.crcs) != len(self._expect):
            raise MergeError(f"internal: shard {self.path.name} got {len(self.crcs)} of {len(self._expect)}")

    def abort(self) -> None:
        """Close the file as it is (the caller is failing; the temporary directory goes with it)."""
        self._file.close()


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, little-endian in memory order (no copy when it is contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def check_written(path: Path, crcs: dict[str, int]) -> None:
    """Read a written shard back with the safetensors library: the same keys, each tensor's bytes as
    written."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        if sorted(keys) != sorted(crcs):
            raise VerificationError(f"{path.name}: read back, its tensors differ from the ones written")
        for key in keys:
            if zlib.crc32(_bytes(f.get_tensor(key))) != crcs[key]:
                raise VerificationError(f"{path.name}: tensor {key} read back differs from what was written")


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> None:
    """model.safetensors.index.json, as transformers writes it."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
