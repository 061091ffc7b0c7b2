"""Merge checks on adapters built directly (no training): refusals with messages saying what is wrong, an
adapter directory merged on its own, output rules, and the API / module plumbing."""

import json
from pathlib import Path

import pytest
import torch

import lorakit
from lorakit.errors import AdapterError, MergeError, RecipeError
from lorakit.export.output import atomic_directory, parse_size
from lorakit.recipe import recipe_from_dict
from tests.conftest import tiny_recipe, tiny_recipe_dict
from tests.export_fixtures import random_adapter


def make_adapter(cache_dir: Path, out: Path, kind: str = "llama", scale: float = 0.05) -> Path:
    """A PEFT LoRA adapter on tiny:KIND with random non-zero lora_B (`scale` 0: as saved before training)."""
    # peft draws lora_A from the global stream: seeded here, the adapter does not depend on which tests ran
    # before in this process (one order made the bf16 check's adapter effect 10.2% of the logits, not ~8%).
    with torch.random.fork_rng():
        torch.manual_seed(0)
        lora = {"target_modules": "all-linear", "task_type": "CAUSAL_LM"}
        return random_adapter(kind, cache_dir, out, seed=0, scale=scale, **lora)


def rewrite_weights(adapter: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    path = adapter / "adapter_model.safetensors"
    save_file(change(load_file(path)), path)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, cache_dir) -> Path:
    return make_adapter(cache_dir, tmp_path_factory.mktemp("adapter") / "adapter")


@pytest.fixture
def copy_of(adapter, tmp_path):
    import shutil

    def copy() -> Path:
        return Path(shutil.copytree(adapter, tmp_path / "copy"))

    return copy


def test_an_adapter_directory_merges_onto_the_base_it_names(adapter, tmp_path):
    from transformers import AutoModelForCausalLM

    result = lorakit.merge(adapter, tmp_path / "merged", dtype="float32")
    assert result.method == "lora" and all(c.passed for c in result.checks)
    assert result.checks[0].max_logit_diff < 1e-4 < result.checks[0].adapter_effect
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "merged").dtype == torch.float32
    # No tokenizer in the adapter directory: the base's is exported.
    assert (tmp_path / "merged" / "tokenizer.json").is_file()


def _drop_lora(w):
    return {"base_model.model.lm_head.bias": torch.zeros(3)}


def _empty_tensors(w):
    return {k: torch.empty(0) for k in w}


def _nan(w):
    w = dict(w)
    key = next(k for k in w if "lora_A" in k)
    w[key] = torch.full_like(w[key], float("nan"))
    return w


def _zero_b(w):
    return {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in w.items()}


def _zero_a(w):
    return {k: torch.zeros_like(v) if "lora_A" in k else v for k, v in w.items()}


def _missing_module(w):
    return {k.replace("layers.1.", "layers.7."): v for k, v in w.items()}


def _other_shape(w):
    return {k: v[:, :32].contiguous() if "lora_A" in k else v for k, v in w.items()}


@pytest.mark.parametrize(
    "change, message",
    [
        (_drop_lora, "empty adapter, no LoRA tensors"),
        (_empty_tensors, "tensors have no elements"),
        (_nan, "NaN or inf"),
        (_zero_b, "the adapter has no effect: lora_B (or lora_A) is all zeros"),
        (_zero_a, "the adapter has no effect"),
        (_missing_module, "modules are not in the base (e.g. model.layers.7."),
        (_other_shape, "modules have other shapes (e.g."),
    ],
)
def test_broken_adapters_are_refused(copy_of, tmp_path, change, message):
    adapter = copy_of()
    rewrite_weights(adapter, change)
    with pytest.raises(AdapterError) as e:
        lorakit.merge(adapter, tmp_path / "out")
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


def test_adapter_saved_before_training_is_refused(cache_dir, tmp_path):
    adapter = make_adapter(cache_dir, tmp_path / "untrained", scale=0.0)
    with pytest.raises(AdapterError, match="saved before any training step, or by a broken ZeRO-3 save"):
        lorakit.merge(adapter, tmp_path / "out")


def test_missing_or_zero_size_weights_are_refused(copy_of, tmp_path):
    adapter = copy_of()
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(AdapterError, match="the weights file is 0 bytes"):
        lorakit.merge(adapter, tmp_path / "out")
    weights.unlink()
    with pytest.raises(AdapterError, match="empty adapter, no adapter_model.safetensors"):
        lorakit.merge(adapter, tmp_path / "out")
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(MergeError, match="neither a run directory"):
        lorakit.merge(adapter, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bad_options_are_refused(adapter, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(MergeError, match="--dtype 'int8'"):
        lorakit.merge(adapter, out, dtype="int8")
    with pytest.raises(MergeError, match="--max-shard-size 'lots'"):
        lorakit.merge(adapter, out, max_shard_size="lots")
    with pytest.raises(MergeError, match="--base 'tiny:gpt9'"):
        lorakit.merge(adapter, out, base="tiny:gpt9")
    with pytest.raises(MergeError, match="--compare-quantized: .* is a lora run, not QLoRA"):
        lorakit.merge(adapter, out, compare_quantized=True)
    with pytest.raises(MergeError, match="no such directory"):
        lorakit.merge(tmp_path / "nowhere", out)
    with pytest.raises(MergeError, match="which the merge reads"):
        lorakit.merge(adapter, adapter.parent, force=True)
    assert not out.exists()


def test_another_base_with_the_same_shapes_is_refused(adapter, tmp_path):
    # tiny:llama and tiny:qwen2 have the same module names and shapes; only the architecture tells them apart.
    with pytest.raises(AdapterError, match="model_type 'llama' -> 'qwen2'"):
        lorakit.merge(adapter, tmp_path / "out", base="tiny:qwen2")


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("100KiB") == 102_400
    assert parse_size("1.5MB") == 1_500_000
    assert parse_size(1234) == 1234
    for bad in ("", "5XB", "-1GB", "0"):
        with pytest.raises(MergeError):
            parse_size(bad)


def test_output_merge_needs_a_saved_adapter(cache_dir, tmp_path):
    raw = tiny_recipe_dict(cache_dir, tmp_path, output={"merge": True, "save_adapter": False})
    with pytest.raises(RecipeError, match="output.merge needs output.save_adapter: true"):
        recipe_from_dict(raw)
    assert tiny_recipe(cache_dir, tmp_path).output.merge is False


def test_lorakit_merge_stays_callable_after_the_cli_module_is_imported(tmp_path):
    import importlib

    importlib.import_module("lorakit.merge")  # rebinds the package attribute to the module
    assert callable(lorakit.merge)
    with pytest.raises(MergeError, match="no such directory"):
        lorakit.merge(tmp_path / "nowhere", tmp_path / "out")
    assert json.loads(json.dumps(lorakit.__all__)).count("merge") == 1


def test_atomic_directory_publishes_whole_or_not_at_all(tmp_path):
    out = tmp_path / "out"
    out.mkdir()  # an empty directory is replaced by the rename
    with atomic_directory(out, force=False) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.tmp-")
        (tmp / "a").write_text("new")
    assert (out / "a").read_text() == "new" and (out / "a").stat().st_mode & 0o777 == 0o644
    with pytest.raises(RuntimeError), atomic_directory(out, force=True) as tmp:
        (tmp / "a").write_text("newer")
        raise RuntimeError("failed half-way")
    assert (out / "a").read_text() == "new"  # untouched
    with atomic_directory(out, force=True) as tmp:
        (tmp / "b").write_text("newer")
    assert [p.name for p in out.iterdir()] == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp or old directory left


def _unload(peft_model):
    """A merge that drops the LoRA layers without adding their delta: the base, exported as merged."""
    return peft_model.unload()


def _merge_zeroed(peft_model):
    """A merge that adds a delta zeroed on the way (lora_B lost before merging)."""
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.zero_()
    return peft_model.merge_and_unload(safe_merge=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("broken_merge", [_unload, _merge_zeroed])
def test_a_merge_that_did_not_apply_the_adapter_fails_verification(
    cache_dir, tmp_path, monkeypatch, dtype, broken_merge
):
    """An adapter that moves the logits by about 8% of the largest, within bf16's 10% tolerance: its correct
    merge passes, and a merge that leaves the base as it was fails in both dtypes, since the merged model is
    no closer to the adapter model than the base is."""
    import lorakit.export.job as job
    from lorakit.errors import VerificationError
    from lorakit.export.verify import EFFECT_SHARE, RELATIVE_TOLERANCE

    adapter = make_adapter(cache_dir, tmp_path / "adapter", scale=0.0025)
    # The in-memory merge (peft's) is what _merge_weights stands for; the streaming merge's own skipped delta
    # is tests/integration/test_merge.py's.
    check = lorakit.merge(adapter, tmp_path / "merged", dtype=dtype, strategy="memory").checks[0]
    assert check.passed and check.max_logit_diff < EFFECT_SHARE * check.adapter_effect
    assert check.adapter_effect < RELATIVE_TOLERANCE["bfloat16"] * check.scale  # the old check passed a no-op
    monkeypatch.setattr(job, "_merge_weights", broken_merge)
    with pytest.raises(VerificationError, match="hardly closer to the adapter model than the base") as e:
        lorakit.merge(adapter, tmp_path / "not-merged", dtype=dtype, strategy="memory")
    assert e.value.exit_code == 3 and "delta did not reach the merged weights" in str(e.value)
    assert not (tmp_path / "not-merged").exists()
