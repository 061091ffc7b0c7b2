"""A full disk while writing: recognised however the writer reports it, named as a DiskFullError (exit
code 74), and no partial file under a final name."""

import errno

import pytest
import torch

from lorakit import rundir, storage
from lorakit.errors import DiskFullError
from lorakit.observe.metrics import JsonlSink
from tests.disk_faults import installed


def test_disk_full_is_recognised_from_each_writer(tmp_path, monkeypatch):
    assert storage.disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert storage.disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    # safetensors: a SafetensorError carrying the OS error's text.
    assert storage.disk_full(
        Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    )
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("saving failed") from inner
    except RuntimeError as chained:
        assert storage.disk_full(chained)
    # torch.save: a RuntimeError that says nothing of space; the filesystem tells.
    zip_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert not storage.disk_full(zip_error, tmp_path)
    with installed("disk-full", f"{tmp_path}*"):
        assert storage.disk_full(zip_error, tmp_path / "missing" / "file.pt")
        # Other errors are not a full disk, whatever the filesystem says.
        assert not storage.disk_full(ValueError("bad value"), tmp_path)
    assert not storage.disk_full(OSError(errno.EACCES, "Permission denied"), tmp_path)


def test_writing_names_what_and_where_and_cleans_up(tmp_path):
    cleaned = []
    with (
        pytest.raises(DiskFullError) as e,
        storage.writing("the adapter", tmp_path / "adapter", lambda: cleaned.append(1)),
    ):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert cleaned == [1]
    assert str(e.value).startswith(
        f"no space left on the device while writing the adapter ({tmp_path / 'adapter'})"
    )
    assert e.value.exit_code == 74 and e.value.doc_link() == "docs/resume.md#a-full-disk"
    # Anything else passes through untouched, without cleaning up.
    with pytest.raises(KeyError), storage.writing("x", tmp_path, lambda: cleaned.append(2)):
        raise KeyError("k")
    assert cleaned == [1]


def test_the_outer_writer_names_the_failure(tmp_path):
    with (
        pytest.raises(DiskFullError, match="while writing the checkpoint of step 4"),
        storage.writing("the checkpoint of step 4", tmp_path),
    ):
        with storage.writing("state.json", tmp_path / "state.json"):
            raise OSError(errno.ENOSPC, "No space left on device")


def test_write_text_leaves_neither_a_partial_file_nor_a_temporary_one(tmp_path):
    rundir.write_json(tmp_path / "summary.json", {"steps": 1})
    with (
        installed("enospc", "*/.summary.json-*") as fault,
        pytest.raises(DiskFullError, match="summary.json"),
    ):
        rundir.write_json(tmp_path / "summary.json", {"steps": 2})
    assert fault.fired == 1
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    assert rundir.read_summary(tmp_path) == {"steps": 1}  # the previous complete version


def test_metrics_log_names_its_file(tmp_path):
    log = JsonlSink(tmp_path / "metrics.jsonl")
    log.write({"step": 1})
    log.close()
    with installed("enospc", "*/metrics.jsonl"):
        log = JsonlSink(tmp_path / "metrics.jsonl", keep=1)
        with pytest.raises(DiskFullError, match="metrics.jsonl"):
            log.write({"step": 2})
    assert log.count == 1


def test_new_directory_publishes_whole_or_not_at_all(tmp_path):
    final = tmp_path / "adapter"
    with storage.new_directory(final) as tmp:
        (tmp / "a.txt").write_text("one")
    assert (final / "a.txt").read_text() == "one"
    # The fault stays installed while writing() looks: the disk is still full when the error arrives.
    with installed("enospc", "*/.adapter.tmp-*"), pytest.raises(DiskFullError, match="the adapter"):
        with storage.writing("the adapter", final), storage.new_directory(final) as tmp:
            torch.save({"w": torch.zeros(1000)}, tmp / "weights.pt")
    # The old adapter is intact, no partial one was published, no temporary directory is left.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
    assert sorted(p.name for p in final.iterdir()) == ["a.txt"]
    with storage.new_directory(final) as tmp:
        (tmp / "b.txt").write_text("two")
    assert sorted(p.name for p in final.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
