"""The streaming merge on adapters built directly (no training): tensor for tensor identical to peft's
in-memory merge in float32, checked in bfloat16, about one tensor in memory on a multi-shard model, the
merges it hands to peft, and its pieces (checkpoint keys, shard layout, the writer)."""

import json
import threading
from pathlib import Path

import pytest
import torch

import lorakit
from lorakit.errors import MergeError
from lorakit.export.shards import ShardWriter, check_written, plan_shards, shard_names
from lorakit.export.stream import checkpoint_key
from lorakit.testing import build_tiny_model, resolve_model_source
from tests.export_fixtures import random_adapter
from tests.unit.test_merge_checks import make_adapter


def random_lora(base: str, out: Path, seq2seq: bool, **lora) -> Path:
    """A LoRA adapter (all linear layers) with random non-zero B on the model at `base`."""
    lora = {"target_modules": "all-linear", "task_type": "SEQ_2_SEQ_LM" if seq2seq else None, **lora}
    return random_adapter("default", None, out, base=base, scale=0.05, **lora)


def _state(directory: Path, seq2seq: bool) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return (
        (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(directory).state_dict()
    )


@pytest.mark.parametrize(
    "kind, lora",
    [
        ("t5", {}),
        # rsLoRA and per-module ranks and alphas: the scale must be peft's for every module.
        ("llama", dict(use_rslora=True, rank_pattern={"q_proj": 8}, alpha_pattern={"down_proj": 3})),
    ],
)
def test_streamed_float32_merge_is_identical_to_peft_merge(kind, lora, cache_dir, tmp_path):
    from safetensors.torch import load_file

    base = resolve_model_source(f"tiny:{kind}", cache_dir)
    adapter = random_lora(base, tmp_path / "adapter", kind == "t5", **lora)
    streamed = lorakit.merge(adapter, tmp_path / "stream", dtype="float32", strategy="stream", verify="never")
    memory = lorakit.merge(adapter, tmp_path / "memory", dtype="float32", strategy="memory")
    assert (streamed.strategy, memory.strategy) == ("stream", "memory")
    assert streamed.checks == () and streamed.tensors.merged > 0 and streamed.tensors.worst <= 1
    a, b = _state(tmp_path / "stream", kind == "t5"), _state(tmp_path / "memory", kind == "t5")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    files_a, files_b = (
        load_file(tmp_path / "stream" / "model.safetensors"),
        load_file(tmp_path / "memory" / "model.safetensors"),
    )
    assert all(torch.equal(files_a[k], files_b[k]) for k in files_a.keys() & files_b.keys())
    config_a, config_b = (
        json.loads((tmp_path / d / "config.json").read_text()) for d in ("stream", "memory")
    )
    assert config_a == config_b


def test_streamed_bfloat16_merge_passes_the_logits_check(cache_dir, tmp_path):
    from safetensors import safe_open

    base = resolve_model_source("tiny:t5", cache_dir)
    adapter = random_lora(base, tmp_path / "adapter", True)
    result = lorakit.merge(adapter, tmp_path / "out", dtype="bfloat16", verify="always")
    (check,) = result.checks
    assert result.strategy == "stream" and check.passed and check.effect_visible
    assert (
        "merged vs the adapter model (the streamed export, reloaded)" == check.name
        and result.tensors.worst <= 1
    )
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert "tensors: " in (tmp_path / "out" / "README.md").read_text()


def _private_bytes() -> int:
    """This process's anonymous resident memory (file-backed pages, e.g. mmapped safetensors, excluded)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")


class PeakSampler:
    """The largest private memory seen while the block runs, sampled every millisecond."""

    def __enter__(self):
        self.base = self.peak = _private_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _private_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _private_bytes())


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_a_multi_shard_merge_holds_about_one_tensor_not_one_shard(tmp_path):
    from transformers import AutoModelForCausalLM

    # ~50 MB of float32 weights in 12 MB shards; the largest matrix is 3 MB.
    shape = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8)
    build_tiny_model("llama", tmp_path / "base", num_key_value_heads=4, **shape)
    AutoModelForCausalLM.from_pretrained(tmp_path / "base").save_pretrained(
        tmp_path / "base", max_shard_size="12MB"
    )
    shard_files = sorted((tmp_path / "base").glob("model-*.safetensors"))
    assert len(shard_files) >= 4
    adapter = random_lora(str(tmp_path / "base"), tmp_path / "adapter", False, r=8)
    adapter_bytes = (adapter / "adapter_model.safetensors").stat().st_size
    options = dict(dtype="float32", max_shard_size="12MB", verify="never", strategy="stream")
    lorakit.merge(adapter, tmp_path / "warm-up", **options)  # lazy imports and their caches come first
    with PeakSampler() as mem:
        result = lorakit.merge(adapter, tmp_path / "out", **options)
    largest = max(f.stat().st_size for f in [*shard_files, *(tmp_path / "out").glob("*.safetensors")])
    grown = mem.peak - mem.base
    print(f"private memory grew {grown / 1e6:.1f} MB; largest shard {largest / 1e6:.1f} MB")
    assert result.shards >= 4 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert grown < 1.5 * largest + adapter_bytes, (grown, largest, adapter_bytes)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.model.layers[3].mlp.down_proj.weight.shape == (512, 1536)


def test_a_merge_that_is_not_per_tensor_goes_to_peft_or_is_refused(cache_dir, tmp_path, capsys):
    adapter = make_adapter(cache_dir, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "fan_in_fan_out": True}))
    with pytest.raises(MergeError, match="cannot run shard by shard: the adapter uses fan_in_fan_out") as e:
        lorakit.merge(adapter, tmp_path / "out", strategy="stream")
    assert e.value.exit_code == 2 and not (tmp_path / "out").exists()
    with pytest.raises(MergeError, match="--verify-logits 'sometimes'"):
        lorakit.merge(adapter, tmp_path / "out", verify="sometimes")
    with pytest.raises(MergeError, match="--strategy 'fast'"):
        lorakit.merge(adapter, tmp_path / "out", strategy="fast")


def test_checkpoint_keys_with_and_without_the_base_model_prefix():
    keys = {"model.layers.0.q.weight", "layers.1.q.weight", "lm_head.weight"}
    assert checkpoint_key("model.layers.0.q.weight", keys, "model") == "model.layers.0.q.weight"
    assert checkpoint_key("model.layers.1.q.weight", keys, "model") == "layers.1.q.weight"
    assert checkpoint_key("layers.0.q.weight", keys, "model") == "model.layers.0.q.weight"
    assert checkpoint_key("model.layers.2.q.weight", keys, "model") is None


def test_shards_are_planned_like_transformers_and_written_readable(tmp_path):
    from safetensors.torch import load_file

    items = [("a", (10, 10), torch.float32), ("b", (100,), torch.float32), ("c", (1000,), torch.bfloat16)]
    assert plan_shards(items, 800) == [[0, 1], [2]]  # 400 + 400 bytes fit; 2000 bytes get their own shard
    assert plan_shards(items, 10**6) == [[0, 1, 2]]
    assert shard_names(1) == ["model.safetensors"] and shard_names(2)[1] == "model-00002-of-00002.safetensors"
    tensors = {
        "a": torch.randn(10, 10),
        "b": torch.arange(100, dtype=torch.int64),
        "c": torch.randn(3, 5).to(torch.bfloat16),
    }
    writer = ShardWriter(
        tmp_path / "x.safetensors", [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
    )
    for k, t in tensors.items():
        writer.write(k, t)
    writer.close()
    check_written(writer.path, writer.crcs)
    back = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(back[k], t) for k, t in tensors.items())
    incomplete = ShardWriter(tmp_path / "y.safetensors", [("a", (10, 10), torch.float32)])
    with pytest.raises(MergeError, match="got 0 of 1"):
        incomplete.close()


def test_the_merge_never_writes_into_the_base_tensor():
    """safetensors' tensors live in its private file mapping: a merge in place there keeps every written page
    in memory until the file closes (the first version held a whole base shard that way)."""
    from lorakit.export.stream import Delta, merge_tensor

    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(6, 4).to(dtype)
        before = w.clone()
        a, b = torch.randn(2, 4), torch.randn(6, 2)
        merged = merge_tensor(w, Delta("m", a, b, 0.5))
        assert torch.equal(w, before) and merged.data_ptr() != w.data_ptr() and merged.dtype == torch.float32
        assert torch.equal(merged, w.float() + (b @ a) * 0.5)  # peft's order of operations, bit for bit
