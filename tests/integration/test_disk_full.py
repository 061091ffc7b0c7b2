"""No space left while writing, injected into each writer of a real `python -m lorakit.run` (1 process;
the 2-process checkpoint case is in test_resume.py): exit code 74 and a message naming what was being
written, no partial file under a final name, the run lock released, and a relaunch resumes from the
previous complete checkpoint and finishes."""

from pathlib import Path

import pytest
import yaml

from lorakit import rundir
from lorakit.engine.checkpoint import complete_checkpoints
from lorakit.runlock import LOCK
from tests.conftest import run_cli, tiny_recipe_dict
from tests.integration.test_resume import launch

pytestmark = pytest.mark.slow

# writer: (glob of the file whose write runs out of space, what the message names, the final path)
WRITERS = {
    "checkpoint": (
        "*/checkpoints/.tmp-step-00000004/*",
        "the checkpoint of step 4",
        "checkpoints/step-00000004",
    ),
    "adapter": ("*/.adapter.tmp-*/adapter_model.safetensors", "the adapter", "adapter"),
    "summary": ("*/.summary.json-*", "summary.json", "summary.json"),
    "merged": ("*/.merged.tmp-*/model*.safetensors", "the merged model", "merged"),
}


def _recipe(cache_dir: Path, tmp_path: Path) -> Path:
    raw = tiny_recipe_dict(
        cache_dir,
        tmp_path / "run",
        train={"max_steps": 4},
        eval={"enabled": False},
        checkpoint={"every": 2, "keep": 3},
        output={"dir": str(tmp_path / "run"), "merge": True},
    )
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_full_disk_while_writing_exits_74_and_the_relaunch_resumes(cache_dir, tmp_path):
    """Each writer in turn, in the order a run writes them: each launch resumes what the previous one left
    (from its last complete checkpoint) and runs out of space in the next writer; the last one finishes."""
    run = tmp_path / "run"
    recipe = _recipe(cache_dir, tmp_path)
    resumes = None  # the checkpoint the next launch resumes from
    for writer, (pattern, what, final) in WRITERS.items():
        failed = launch(recipe, fault=f"enospc:{pattern}")
        assert failed.returncode == 74, failed.stderr[-5000:]
        assert f"error: no space left on the device while writing {what} ({run / final})" in failed.stderr
        doc = "docs/merge.md#atomic-output" if writer == "merged" else "docs/resume.md#a-full-disk"
        assert failed.stderr.rstrip().endswith(f"see {doc}")
        assert "Traceback" not in failed.stderr
        # Nothing under the final name, no partial leftovers beside it, and the lock is released.
        assert not (run / final).exists()
        leftovers = [p.name for p in run.rglob(".*") if p != run / rundir.MARKER]
        assert leftovers == [], leftovers
        assert not (run / LOCK).exists()
        expected = [2] if writer == "checkpoint" else [2, 4]
        assert [c.step for c in complete_checkpoints(run)] == expected
        # This launch resumed from where the previous one's full disk left the run, and got past its writer.
        if resumes is not None:
            resumed_from = (run / "checkpoints" / f"step-{resumes:08d}").resolve()
            assert f"resuming from {resumed_from} " in failed.stdout + failed.stderr
        if writer in ("summary", "merged"):
            assert (run / "adapter" / "adapter_model.safetensors").is_file()
        if writer == "merged":
            # Training finished and was recorded; only the export is missing.
            assert rundir.read_summary(run)["merged_dir"] is None
        resumes = expected[-1]

    # No fault to install at its start, so the session's warm interpreter runs it (tests/conftest.py).
    resumed = run_cli("lorakit.run", recipe)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    summary = rundir.read_summary(run)
    assert summary["resumed_from"]["step"] == 4 and summary["steps"] == 4
    assert sorted(r["step"] for r in rundir.read_metrics(run) if r["kind"] == "train") == [1, 2, 3, 4]
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    assert summary["merged_dir"] == str(run / "merged") and (run / "merged" / "config.json").is_file()
