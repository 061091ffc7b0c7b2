"""A tracker that fails or hangs costs warnings, never the run (observe/guard.py)."""

from __future__ import annotations

import threading
import time

import pytest

from lorakit.observe import guard
from lorakit.observe.guard import GuardedSink, TrackerWarning, start_sinks


class Flaky:
    def __init__(self, fail_first: int = 0, always: bool = False):
        self.fail_first, self.always, self.calls, self.records, self.closed = fail_first, always, 0, [], False

    def write(self, record):
        self.calls += 1
        if self.always or self.calls <= self.fail_first:
            raise ConnectionError("server is down\nmore detail")
        self.records.append(record["step"])

    def close(self):
        self.closed = True


def test_a_failed_write_warns_once_backs_off_then_retries(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(guard.time, "monotonic", lambda: clock[0])
    failures = []
    sink = Flaky(fail_first=1)
    guarded = GuardedSink("mlflow", sink, on_failure=lambda name, message: failures.append((name, message)))
    with pytest.warns(TrackerWarning, match=r"tracker mlflow could not take the record of step 1 .*5 s"):
        guarded.write({"step": 1})
    guarded.write({"step": 2})  # backing off: skipped, no call
    assert sink.calls == 1
    clock[0] += guard.FIRST_BACKOFF
    guarded.write({"step": 3})
    assert sink.records == [3] and failures == [("mlflow", "ConnectionError: server is down")]
    guarded.close()
    assert sink.closed


def test_a_sink_that_keeps_failing_disables_itself(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(guard.time, "monotonic", lambda: clock[0])
    sink = Flaky(always=True)
    guarded = GuardedSink("wandb", sink)
    with pytest.warns(TrackerWarning) as caught:
        for step in range(1, 50):
            guarded.write({"step": step})
            clock[0] += 1000
    assert sink.calls == guard.MAX_FAILURES and guarded.disabled
    assert len(caught) == guard.MAX_FAILURES and "disabled for the rest of the run" in str(caught[-1].message)
    guarded.close()
    assert not sink.closed


def test_a_background_sink_never_holds_up_the_caller():
    release = threading.Event()

    class Slow(Flaky):
        def write(self, record):
            release.wait(5)
            super().write(record)

    sink = Slow()
    guarded = GuardedSink("mlflow", sink, background=True, close_timeout=5)
    start = time.monotonic()
    for step in range(1, 4):
        guarded.write({"step": step})
    assert time.monotonic() - start < 1
    release.set()
    guarded.close()
    assert sink.records == [1, 2, 3] and sink.closed


def test_trackers_start_together_within_the_limit_or_are_left_out():
    hang = threading.Event()
    made = []

    def hanging():
        hang.wait(10)
        made.append("late")
        return Flaky()

    def failing():
        raise OSError("connection refused")

    start = time.monotonic()
    with pytest.warns(TrackerWarning) as caught:
        out = start_sinks({"tensorboard": Flaky, "wandb": hanging, "mlflow": failing}, timeout=0.5)
    assert time.monotonic() - start < 3
    assert isinstance(out["tensorboard"][0], Flaky) and out["tensorboard"][1] is None
    assert out["wandb"] == (None, "did not start within output.tracker_timeout_seconds=0.5")
    assert out["mlflow"] == (None, "failed to start: OSError: connection refused")
    assert len(caught) == 2
    hang.set()
