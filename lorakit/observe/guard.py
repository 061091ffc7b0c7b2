"""Tracker sinks that cannot stop training.

A tracker (TensorBoard, W&B, MLflow) is a copy of metrics.jsonl for people to look at; a server that is
down, a network blip or a full disk under its files must cost a warning, never the run. So:
- `start_sinks` builds the sinks at once, with a time limit (wandb.init and MLflow's client retry for minutes when their
  server is unreachable); a sink that fails or does not start in time is left out, with one warning.
- `GuardedSink` passes records on; a failed write is one warning, after which the sink waits (doubling
  back-off) before it tries again, and after `MAX_FAILURES` failures in a row it disables itself. Remote
  sinks write from a thread of their own, so a slow server never slows a step.
Every failure is kept in `failure` so summary.json (through trackers.json) says which sinks failed.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from lorakit.disclosure import redact

# Failed writes in a row after which a sink is disabled for the rest of the run.
MAX_FAILURES = 5
# Seconds before the first retry after a failed write; doubled after each further failure.
FIRST_BACKOFF = 5.0


class TrackerWarning(UserWarning):
    """A tracker failed to start or to take a record; training goes on without it."""


def warn(message: str) -> None:
    """One warning line on stderr, from any thread; credentials in it (a tracking URI's password, a token
    in a server's error) are redacted."""
    warnings.warn(redact(message), TrackerWarning, stacklevel=2)


def start_sinks(
    makers: dict[str, Callable[[], Any]], timeout: float
) -> dict[str, tuple[Any | None, str | None]]:
    """Build each sink with its maker, all at once, within `timeout` seconds: name -> (sink, None), or
    (None, why) after one warning.

    A start still running at the limit is left to its daemon thread (a library call cannot be
    interrupted); whatever it builds later is closed, never used."""
    starts = {name: _Start(name, make) for name, make in makers.items()}
    deadline = time.monotonic() + timeout
    out = {}
    for name, start in starts.items():
        start.thread.join(max(deadline - time.monotonic(), 0.0))
        out[name] = start.outcome(timeout)
        if out[name][0] is None:
            warn(
                f"tracker {name} {out[name][1]}; training goes on without it (the records are in metrics.jsonl)"
            )
    return out


class _Start:
    def __init__(self, name: str, make: Callable[[], Any]):
        self.make, self.box, self.lock = make, {}, threading.Lock()
        self.abandoned = False
        self.thread = threading.Thread(target=self._run, name=f"lorakit-{name}-start", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            sink = self.make()
        except Exception as e:
            self.box["error"] = e
            return
        with self.lock:
            if not self.abandoned:
                self.box["sink"] = sink
                return
        _close_quietly(sink)

    def outcome(self, timeout: float) -> tuple[Any | None, str | None]:
        with self.lock:
            if "sink" in self.box:
                return self.box["sink"], None
            if "error" in self.box:
                e = self.box["error"]
                return None, f"failed to start: {type(e).__name__}: {_first_line(e)}"
            self.abandoned = True
        return None, f"did not start within output.tracker_timeout_seconds={timeout:g}"


class GuardedSink:
    """`sink` behind a guard: failures are warnings with back-off, then the sink disables itself.

    `background`: write from a thread of its own (remote sinks), so a slow or unreachable server never
    holds up training; that thread also closes the sink (wandb.finish, MLflow's set_terminated, which retry
    for minutes against a server that is down), and `close` waits at most `close_timeout` seconds for it to
    take the last records and close: a finished run never waits longer on a tracker, so the other ranks
    waiting at the end-of-run collective do not time out and mark it failed.
    `on_failure(name, message)` is told of the first failure (to record it in trackers.json)."""

    def __init__(
        self,
        name: str,
        sink: Any,
        *,
        background: bool = False,
        close_timeout: float = 60.0,
        on_failure: Callable[[str, str], None] | None = None,
    ):
        self.name, self.sink = name, sink
        self.failures = 0
        self.failure: str | None = None
        self.disabled = False
        self._retry_at = 0.0
        self._on_failure = on_failure
        self._close_timeout = close_timeout
        self._close_by: float | None = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._drain, name=f"lorakit-{name}-writer", daemon=True)
            self._thread.start()

    def write(self, record: dict[str, Any]) -> None:
        """Pass `record` on (or queue it), unless the sink is disabled or backing off."""
        if self._queue is not None:
            self._queue.put(record)
        else:
            self._write(record)

    def _drain(self) -> None:
        assert self._queue is not None
        while True:
            record = self._queue.get()
            if record is None:
                self._close_sink()
                return
            self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        if self.disabled or time.monotonic() < self._retry_at:
            return
        try:
            self.sink.write(record)
        except Exception as e:
            self._failed(f"{type(e).__name__}: {_first_line(e)}", record.get("step"))
        else:
            self.failures = 0

    def _failed(self, message: str, step: Any) -> None:
        self.failures += 1
        if self.failure is None:
            self.failure = message
            if self._on_failure is not None:
                try:
                    self._on_failure(self.name, message)
                except Exception:  # noqa: S110 - recording the failure must not fail the run either
                    pass
        if self.failures >= MAX_FAILURES:
            self.disabled = True
            warn(
                f"tracker {self.name} failed {self.failures} times in a row (last at step {step}: {message}); "
                "disabled for the rest of the run (the records are in metrics.jsonl)"
            )
            return
        backoff = FIRST_BACKOFF * 2 ** (self.failures - 1)
        self._retry_at = time.monotonic() + backoff
        warn(
            f"tracker {self.name} could not take the record of step {step} ({message}); records are skipped "
            f"for {backoff:g} s, then it tries again (they are all in metrics.jsonl)"
        )

    def start_close(self) -> None:
        """Begin closing: a background sink takes its last records and closes in its own thread, within
        `close_timeout` seconds from now (MetricsLogger starts every sink's close at once)."""
        if self._thread is not None and self._queue is not None and self._close_by is None:
            self._close_by = time.monotonic() + self._close_timeout
            self._queue.put(None)

    def close(self) -> None:
        """Close the sink: a background one within the time limit (a late one is left to its daemon
        thread and recorded as failed); failures warn."""
        if self._thread is None:
            self._close_sink()
            return
        self.start_close()
        assert self._close_by is not None
        self._thread.join(max(self._close_by - time.monotonic(), 0.0))
        if self._thread.is_alive():
            self._failed(
                f"it did not take its last records and close within {self._close_timeout:g} s "
                "(output.tracker_timeout_seconds)",
                None,
            )

    def _close_sink(self) -> None:
        if self.disabled:
            return
        try:
            self.sink.close()
        except Exception as e:
            self._failed(f"closing failed: {type(e).__name__}: {_first_line(e)}", None)


def _close_quietly(sink: Any) -> None:
    try:
        sink.close()
    except Exception:  # noqa: S110 - a sink abandoned after its start timed out
        pass


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"
