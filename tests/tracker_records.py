"""Read back what the tracking backends received, each with its own library: TensorBoard's
EventAccumulator, W&B's record protobufs from an offline run's .wandb file, MLflow's client."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from lorakit.observe.mlflow_sink import allow_file_store

# An offline run's .wandb file: a 7-byte header (":W&B", magic 0xBEE1, version), then W&B's LevelDB-log
# framing: 32 KiB blocks of chunks, each with a 7-byte header (crc32, length, type: full, first, middle,
# last), each chunk sequence one serialized wandb_internal_pb2.Record.
_WANDB_HEADER = 7
_BLOCK = 32 * 1024
_CHUNK_HEADER = 7


def _wandb_chunks(data: bytes):
    assert data[:4] == b":W&B", data[:7]
    pos, pending = _WANDB_HEADER, b""
    while pos + _CHUNK_HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:  # block trailer: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        pos += _CHUNK_HEADER + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def _wandb_records(run_dir: Path, kind: str):
    from wandb.proto import wandb_internal_pb2

    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for raw in _wandb_chunks(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == kind:
                yield getattr(record, kind)


def wandb_config(run_dir: Path) -> dict:
    """The W&B run's config (the last value of each key) from its offline runs under run_dir/wandb: the run
    record's config at init, then any config updates."""
    config = {}
    updates = [run.config for run in _wandb_records(run_dir, "run")] + list(_wandb_records(run_dir, "config"))
    for update in updates:
        for item in update.update:
            config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config


def wandb_history(run_dir: Path) -> list[dict]:
    """Every history row logged to the W&B offline runs under run_dir/wandb (oldest run first)."""
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in history.item}
        for history in _wandb_records(run_dir, "history")
    ]


def wandb_series(run_dir: Path, tag: str) -> dict[int, float]:
    """{step: value} of W&B metric `tag` (a step logged twice keeps its last value)."""
    return {int(r["step"]): r[tag] for r in wandb_history(run_dir) if tag in r}


def tensorboard_series(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of scalar `tag` as TensorBoard shows it (purged steps dropped), in order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def mlflow_series(tracking_uri: str, run_id: str, tag: str) -> list[tuple[int, float]]:
    """(step, value) of MLflow metric `tag`, in logged order."""
    from mlflow.tracking import MlflowClient

    # MLflow 3 opens a file store only when asked to, as lorakit's sink asks.
    allow_file_store(tracking_uri)
    client = MlflowClient(tracking_uri=tracking_uri)
    return [(m.step, m.value) for m in client.get_metric_history(run_id, tag)]


def mlflow_params(tracking_uri: str, run_id: str) -> dict[str, str]:
    """The MLflow run's parameters."""
    from mlflow.tracking import MlflowClient

    allow_file_store(tracking_uri)
    return MlflowClient(tracking_uri=tracking_uri).get_run(run_id).data.params
