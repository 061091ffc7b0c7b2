"""python -m lorakit.merge as a user types it: refusals exit 2 with a message and write nothing.
(The quickstart run merged through the CLI: tests/e2e/test_quickstart.py.)"""

from tests.conftest import run_cli
from tests.unit.test_merge_checks import make_adapter


def run_merge(*args):
    return run_cli("lorakit.merge", *args, timeout=300)


def test_refusals_exit_2_with_a_message_and_write_nothing(cache_dir, tmp_path):
    untrained = make_adapter(cache_dir, tmp_path / "untrained", scale=0.0)
    out = tmp_path / "out"
    proc = run_merge(untrained, "--output", out)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: " in proc.stderr and "the adapter has no effect" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_merge(tmp_path / "nowhere", "--output", out, "--max-shard-size", "5GB")
    assert proc.returncode == 2 and "no such directory" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["untrained"]


def test_streaming_options(cache_dir, tmp_path):
    adapter = make_adapter(cache_dir, tmp_path / "adapter")
    out = tmp_path / "out"
    proc = run_merge(
        adapter, "--output", out, "--strategy", "stream", "--verify-logits", "never", "--dtype", "float32"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "streaming, shard by shard" in proc.stdout and "logits check skipped" in proc.stdout
    assert "merged tensors equal W + scale * B A" in proc.stdout and (out / "model.safetensors").is_file()
