"""The launcher's root-cause line (launch.root_cause_line): a rank that died without an error of its own is
named, with where the survivors were stuck, instead of a survivor's unfinished collective."""

from __future__ import annotations

from lorakit.engine.launch import root_cause_line

# What a survivor records in exit.json when its collective lost the peer (api.record_failure).
STUCK = {"code": 1, "error": "WorkerFailedError", "message": "rank 0 stopped during training at step 7: ..."}
STUCK |= {"peer_lost": True, "rank": 0, "where": "training at step 7"}


def _ended(exitcode: int, reported: bool, timestamp: int = 100) -> dict:
    signal = {-9: "SIGKILL", -6: "SIGABRT"}.get(exitcode)
    return {"exitcode": exitcode, "signal": signal, "reported": reported, "timestamp": timestamp}


def test_a_killed_rank_is_named_with_where_the_survivor_was_stuck():
    failures = {"0": _ended(1, True), "1": _ended(-9, False)}
    assert root_cause_line(STUCK, failures) == (
        "rank 1 was killed by SIGKILL (signal 9) during training at step 7; rank 0 stopped with it"
    )
    # The survivor killed by the agent before it recorded anything: the dead rank, without a phase.
    assert root_cause_line(None, {"1": _ended(-9, False)}) == "rank 1 was killed by SIGKILL (signal 9)"


def test_an_exit_without_an_error_is_named_and_the_first_to_end_wins():
    failures = {"0": _ended(1, True), "2": _ended(-6, False, 101), "1": _ended(9, False, 100)}
    assert root_cause_line(STUCK, failures) == (
        "rank 1 exited with code 9 (no error of its own) during training at step 7; rank 0 stopped with it"
    )
    # At the same second, a signal comes before an exit code.
    failures["2"]["timestamp"] = 100
    assert root_cause_line(STUCK, failures).startswith("rank 2 was killed by SIGABRT (signal 6)")


def test_a_recorded_root_cause_or_reported_failures_leave_the_record_as_it_is():
    own = {"code": 1, "error": "WorkerFailedError", "message": "rank 1 failed during load: ..."}
    assert root_cause_line(own, {"0": _ended(1, True), "1": _ended(-9, False)}) is None
    # Every failed rank stopped on an error of its own: the survivor's record is all there is.
    assert root_cause_line(STUCK, {"0": _ended(1, True), "1": _ended(1, True)}) is None
    # The recording survivor is never its own root cause, reported or not.
    assert root_cause_line(STUCK, {"0": _ended(1, False)}) is None
    assert root_cause_line(None, {}) is None


def test_a_stop_every_rank_makes_is_recorded_as_itself_whichever_rank_records_first(tmp_path):
    """Preemption (and divergence) stops every rank together; rank 0 writes exit.json as its kind, but on a
    loaded machine rank 1 reached api.record_failure first and wrote the stop as a failure of its own:
    the launcher then said "error: rank 1 failed during training at step 7: Preempted: ..." and the run's
    last line was no longer the preemption's (tests/integration/test_resume.py failed so in a whole run)."""
    import pytest

    from lorakit.api import _raise_worker_exit, record_failure
    from lorakit.engine.loop import Preempted, TrainingDiverged

    stop = (
        "stopped at step 6 on request (SIGTERM/SIGUSR1); checkpoint saved to run/checkpoints/step-00000006."
    )
    for kind in (Preempted, TrainingDiverged):
        run = tmp_path / kind.__name__
        run.mkdir()
        record_failure(run, kind(stop))
        with pytest.raises(kind, match=r"^stopped at step 6 ") as raised:
            _raise_worker_exit(run, {})
        assert raised.value.exit_code == kind.exit_code
