import json
import stat

from lorakit import rundir
from lorakit.observe import JsonlSink


def test_run_dir_files_are_atomic_and_readable(tmp_path):
    target = tmp_path / "summary.json"
    rundir.write_json(target, {"a": 1})
    rundir.write_text(tmp_path / "recipe.yaml", "x: 1\n")
    assert json.loads(target.read_text()) == {"a": 1}
    for f in (target, tmp_path / "recipe.yaml"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml", "summary.json"]  # no temp files left


def test_versions_and_metrics_log(tmp_path):
    v = rundir.versions()
    assert v["lorakit"] and v["torch"] and v["deepspeed"]
    log = JsonlSink(tmp_path / rundir.METRICS)
    log.write({"kind": "train", "step": 1, "loss": 2.5})
    log.write({"kind": "eval", "step": 1, "loss": 2.0})
    log.close()
    assert [r["kind"] for r in rundir.read_metrics(tmp_path)] == ["train", "eval"]
