"""Metric records and their sinks.

The loop and the evaluation hand every record (a flat dict: `kind` "train" or "eval", `step`, `epoch`, the
numbers) to a `MetricsLogger`, which passes it to each sink. `JsonlSink` writes the run directory's
metrics.jsonl, the record that compare and the benchmarks read and that a resumed run continues. The
tracking backends of output.report_to (tensorboard_sink, wandb_sink, mlflow_sink; chosen in trackers.py)
are sinks too, each importing its library lazily in its own module so the extras stay optional.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from lorakit import rundir, storage


class MetricsSink(Protocol):
    """Receives every metric record of a run, in order, on rank 0."""

    def write(self, record: dict[str, Any]) -> None:
        """Take one record."""
        ...

    def close(self) -> None:
        """Flush and release whatever the sink holds; no record follows."""
        ...


class JsonlSink:
    """Append-only metrics.jsonl: one JSON object per line, flushed as it is written.

    `keep` (a resumed run): keep the first `keep` lines of an existing file, the ones written up to the
    checkpoint, and append after them; otherwise start a new file.
    """

    def __init__(self, path: Path, keep: int | None = None):
        self.path = path
        self.count = 0
        if keep is not None and path.exists():
            lines = [line for line in path.read_text().splitlines() if line.strip()][:keep]
            rundir.write_text(path, "".join(line + "\n" for line in lines))
            self.count = len(lines)
        self._f = open(path, "a" if keep is not None else "w")  # noqa: SIM115 - lives as long as the run

    def write(self, record: dict[str, Any]) -> None:
        """Append `record` as one line."""
        # A line cut short by a full disk is dropped by the resume, which keeps only the lines written up to
        # its checkpoint.
        with storage.writing(self.path.name, self.path):
            self._f.write(json.dumps(record, default=float) + "\n")
            self._f.flush()
        self.count += 1

    def close(self) -> None:
        """Close the file, its lines and its name fsynced to the disk."""
        if not self._f.closed:
            with storage.writing(self.path.name, self.path):
                self._f.flush()
                os.fsync(self._f.fileno())
                storage.fsync_dir(self.path.parent)
        self._f.close()


class MetricsLogger:
    """Passes each record to every sink; with no sinks (ranks other than 0) it records nothing.

    `records` is the number of lines in metrics.jsonl, which a checkpoint stores so that a resume drops
    what an interrupted run logged after it.
    """

    def __init__(self, sinks: Sequence[MetricsSink] = ()):
        self.sinks = list(sinks)

    @classmethod
    def for_run(
        cls,
        run_dir: Path,
        keep: int | None = None,
        *,
        report_to: Sequence[str] = (),
        recipe: dict[str, Any] | None = None,
        recipe_yaml: str = "",
        resumed_step: int | None = None,
        tracker_timeout: float = 60.0,
    ) -> MetricsLogger:
        """The sinks of a run directory: metrics.jsonl (keeping its first `keep` lines on resume) and the
        trackers of `report_to` (continuing their runs from `resumed_step`, the checkpoint's step, on
        resume; a fresh run gets `recipe`, the resolved recipe, as their hyper-parameters). A tracker that does
        not start within `tracker_timeout` seconds is left out, with a warning (observe/guard.py)."""
        from lorakit.observe import trackers

        sinks: list[MetricsSink] = [JsonlSink(run_dir / rundir.METRICS, keep=keep)]
        if resumed_step is None:
            trackers.clear(run_dir)
        if report_to:
            sinks += trackers.open_sinks(
                report_to, run_dir, recipe or {}, recipe_yaml, resumed_step, timeout=tracker_timeout
            )
        return cls(sinks)

    @property
    def records(self) -> int:
        """Lines written to metrics.jsonl so far (0 where there is none)."""
        return next((s.count for s in self.sinks if isinstance(s, JsonlSink)), 0)

    def __call__(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        """Close every sink (once). Background sinks start closing together, so the time limit of each
        (output.tracker_timeout_seconds) is the limit of them all."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            start = getattr(sink, "start_close", None)
            if start is not None:
                start()
        for sink in sinks:
            sink.close()
