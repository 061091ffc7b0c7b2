"""Secrets never reach a file or the console, files keep the user's umask, and closing the trackers is
bounded by output.tracker_timeout_seconds (issue 44: review items M3, M7, L5, L7)."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
import warnings

import pytest

from lorakit import disclosure, rundir
from lorakit.cli import error_message
from lorakit.disclosure import redact
from lorakit.errors import DataError
from lorakit.export.output import atomic_directory
from lorakit.observe.guard import GuardedSink, TrackerWarning
from lorakit.observe.metrics import MetricsLogger

ENV = {"WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567", "HF_TOKEN": "hf_" + "A1" * 17}


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("https://alice:s3cret@mlflow.example.com/", "https://alice:***@mlflow.example.com/"),
        ("postgresql://mlflow:pa55word@db:5432/mlflow", "postgresql://mlflow:***@db:5432/mlflow"),
        ("https://ghp_tok3n@github.com/me/x", "https://***@github.com/me/x"),
        ("http://host/api?run=1&token=abc123&x=2", "http://host/api?run=1&token=***&x=2"),
        ("https://s3/x?X-Amz-Signature=deadbeef", "https://s3/x?X-Amz-Signature=***"),
        # A URL a library took for a path and normalised (datasets: "Unable to find /data/https:/u:pw@...").
        ("/data/https:/alice:s3cret@host/t.jsonl", "/data/https:/alice:***@host/t.jsonl"),
        ("login with hf_" + "B2" * 17 + " now", "login with hf_*** now"),  # any HF token, set or not
        (f"HF_TOKEN={ENV['HF_TOKEN']}", "HF_TOKEN=***"),
        ("key 0123456789abcdef0123456789abcdef01234567 in a message", "key *** in a message"),
        # What is not a credential stays as it was.
        ("http://localhost:5000/#/experiments", "http://localhost:5000/#/experiments"),
        ("file:///home/me/runs/r/mlruns", "file:///home/me/runs/r/mlruns"),
        ("meta-llama/Llama-3.1-8B at step 12", "meta-llama/Llama-3.1-8B at step 12"),
    ],
)
def test_redact(text, shown):
    assert redact(text, ENV) == shown


def test_a_run_directory_file_holds_no_credential(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", ENV["WANDB_API_KEY"])
    where = {
        "mlflow": {"tracking_uri": "postgresql://mlflow:pa55word@db/mlflow", "run_id": "r1"},
        "wandb": {"failed": f"AuthenticationError: key {ENV['WANDB_API_KEY']} refused"},
    }
    rundir.write_json(tmp_path / rundir.TRACKERS, where)
    rundir.write_json(tmp_path / rundir.SUMMARY, {"trackers": where})
    for name in (rundir.TRACKERS, rundir.SUMMARY):
        text = (tmp_path / name).read_text()
        assert "pa55word" not in text and ENV["WANDB_API_KEY"] not in text, name
        assert "postgresql://mlflow:***@db/mlflow" in text


def test_the_console_shows_no_credential(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", ENV["HF_TOKEN"])
    error = DataError(f"data.source: cannot read https://u:pw@host/d.jsonl?token=t0k with {ENV['HF_TOKEN']}")
    assert (
        error_message(error)
        == "error: data.source: cannot read https://u:***@host/d.jsonl?token=*** with ***"
    )

    class Refusing:
        def write(self, record):
            raise ConnectionError("https://alice:s3cret@mlflow.example.com/ refused the connection")

        def close(self):
            pass

    sink = GuardedSink("mlflow", Refusing())
    with pytest.warns(TrackerWarning) as caught:
        sink.write({"step": 1})
    assert "s3cret" not in str(caught[0].message) and "alice:***@" in str(caught[0].message)


def _datasets_error(home) -> Exception:
    """A real error of another library: datasets asked for a data file under the home directory whose path
    holds a token."""
    import datasets

    try:
        datasets.load_dataset("json", data_files=str(home / "data" / ENV["HF_TOKEN"] / "t.jsonl"))
    except Exception as e:
        return e
    raise AssertionError("datasets found the file")


def test_a_foreign_errors_traceback_is_printed_and_written_redacted(tmp_path, monkeypatch, capsys):
    """An error that is not lorakit's (here datasets', and one raised from it that quotes a URL with a
    password) reaches the console as Python's traceback, from every CLI (cli.run_cli) with exit code 1, and
    torchrun's error file (launch.report_to_agent), which plain torchrun prints, as the same traceback:
    credentials redacted, the home directory written as ~."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from lorakit.cli import run_cli
    from lorakit.engine.launch import report_to_agent

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("HF_TOKEN", ENV["HF_TOKEN"])
    error = _datasets_error(tmp_path)
    assert ENV["HF_TOKEN"] in str(error) and type(error).__module__.split(".")[0] != "lorakit"

    def body():
        raise RuntimeError("while reading https://alice:s3cret@host/t.jsonl?sig=t0k") from error

    assert run_cli(body) == 1
    printed = capsys.readouterr().err
    errfile = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(errfile))
    try:
        body()
    except RuntimeError as e:
        report_to_agent(e)
    # torchrun's own reader of a worker's error file (the root cause it prints)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(errfile))
    written = json.loads(errfile.read_text())["message"]["extraInfo"]["py_callstack"]
    for text in (printed, written, json.dumps(failure.message)):
        assert "s3cret" not in text and "t0k" not in text and ENV["HF_TOKEN"] not in text, text
        assert "alice:***@host" in text and "sig=***" in text
    for text in (printed, written):
        assert text.startswith("Traceback (most recent call last):")
        assert "~/data/***/t.jsonl" in text and str(tmp_path) not in text, text
        assert text.rstrip().endswith("RuntimeError: while reading https://alice:***@host/t.jsonl?sig=***")
    assert failure.message["message"] == "RuntimeError: while reading https://alice:***@host/t.jsonl?sig=***"


def test_a_crashed_doctor_check_is_reported_redacted():
    from lorakit.doctor.core import _guard

    def check():
        raise ConnectionError("https://alice:s3cret@mlflow.example.com/ refused the connection")

    (result,) = _guard("environment", "trackers", check)
    assert "s3cret" not in result.detail and "alice:***@" in result.detail
    assert "s3cret" not in result.data["traceback"] and "alice:***@" in result.data["traceback"]


@pytest.mark.parametrize("mask", [0o077, 0o002])
def test_files_keep_the_users_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        assert disclosure.umask() == mask
        rundir.write_text(tmp_path / rundir.PREDICTIONS, "{}\n")
        with atomic_directory(tmp_path / "merged", force=False) as tmp:
            (tmp / "model.safetensors").write_bytes(b"w")
            os.chmod(tmp / "model.safetensors", 0o600)  # what some writers do
            (tmp / "sub").mkdir()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / rundir.PREDICTIONS).stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE((tmp_path / "merged" / "model.safetensors").stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE((tmp_path / "merged" / "sub").stat().st_mode) == 0o777 & ~mask


class Hanging:
    """A remote tracker whose close (wandb.finish, MLflow's set_terminated) waits on a server that is down."""

    def __init__(self):
        self.records, self.release, self.closed = [], threading.Event(), False

    def write(self, record):
        self.records.append(record["step"])

    def close(self):
        self.release.wait(30)
        self.closed = True


def test_closing_the_trackers_is_bounded_by_the_tracker_timeout(tmp_path):
    failures = []
    sinks = [
        GuardedSink(
            name, Hanging(), background=True, close_timeout=0.5, on_failure=lambda n, m: failures.append(n)
        )
        for name in ("wandb", "mlflow")
    ]
    log = MetricsLogger(sinks)
    log({"kind": "train", "step": 1, "loss": 1.0})
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log.close()
    took = time.monotonic() - start
    # Both closed together: one limit for all, not one after the other.
    assert 0.4 < took < 0.9, took
    assert sorted(failures) == ["mlflow", "wandb"]
    assert all(s.sink.records == [1] and not s.sink.closed for s in sinks)
    assert "did not take its last records and close within 0.5 s" in str(caught[0].message)
    for s in sinks:
        s.sink.release.set()


def test_a_tracker_closes_in_its_writer_thread_when_in_time():
    sink = Hanging()
    sink.release.set()
    guarded = GuardedSink("wandb", sink, background=True, close_timeout=5)
    guarded.write({"step": 3})
    guarded.close()
    assert sink.closed and sink.records == [3] and guarded.failure is None


def test_the_mlflow_sink_never_changes_the_environment_while_training(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from lorakit.observe import trackers

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    sinks = trackers.open_sinks(["mlflow"], tmp_path, {"train": {"lr": 1.0}}, "", None, timeout=60)
    # Set once, on this (the main) thread, before the writer thread started; never unset by it.
    assert os.environ.get("MLFLOW_ALLOW_FILE_STORE") == "true"
    before = dict(os.environ)
    log = MetricsLogger(sinks)
    for step in range(1, 4):
        log({"kind": "train", "step": step, "loss": 1.0 / step})
    log.close()
    changes = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}
    assert changes == set()
    where = json.loads((tmp_path / rundir.TRACKERS).read_text())
    assert where["mlflow"]["tracking_uri"].startswith("file:") and "failed" not in where["mlflow"]


def test_the_end_of_run_report_shows_no_tracker_credential(tmp_path):
    from lorakit.engine.result import TrainResult
    from lorakit.run import report_lines

    summary = {
        "loss": {"first": 2.0, "last": 1.0},
        "steps": 4,
        "trackers": {
            "mlflow": {"tracking_uri": "https://alice:s3cret@mlflow.example.com", "run_id": "r"},
            "wandb": {"dir": str(tmp_path / "wandb"), "failed": "https://x/?api_key=abc refused"},
        },
    }
    lines = report_lines(TrainResult(tmp_path, summary))
    assert "mlflow:   https://alice:***@mlflow.example.com" in lines
    assert f"wandb:    {tmp_path / 'wandb'} failed (https://x/?api_key=*** refused)" in lines
    assert not any("s3cret" in line or "abc" in line for line in lines)
