"""lorakit.merge on runs trained in-process: T5 and Llama, LoRA and QLoRA, bf16 and fp32, sharding, a full
run, output.merge in a recipe, and the refusals that need a trained adapter.

Every merged directory is checked independently of the merge's own probe: loaded with from_pretrained, it
must reproduce the adapter model (base + PeftModel, unmerged) on real text within the dtype's tolerance.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

import lorakit
from lorakit import rundir
from lorakit.errors import AdapterError, MergeError, VerificationError
from lorakit.export import RELATIVE_TOLERANCE
from tests.conftest import tiny_recipe

CAUSAL_DATA = {"format": "instruction", "max_length": "auto"}
# name -> tiny recipe overrides. Few steps: the adapters only need a clear effect on the logits.
RUNS = {
    # ZeRO-3 in-process, and output.merge: the recipe merges at the end of training.
    "t5-lora": dict(distributed={"zero_stage": 3}, output={"merge": True}),
    "llama-lora": dict(model={"name_or_path": "tiny:llama"}, data=CAUSAL_DATA, distributed={"zero_stage": 2}),
    "t5-qlora": dict(model={"dtype": "bfloat16"}, method={"kind": "qlora"}, data={"packing": False}),
    "llama-qlora": dict(
        model={"name_or_path": "tiny:llama", "dtype": "bfloat16"}, method={"kind": "qlora"}, data=CAUSAL_DATA
    ),
    "t5-full": dict(
        method={"kind": "full"}, distributed={"zero_stage": 3}, train={"max_steps": 2, "lr": 1e-3}
    ),
}
TEXTS = [
    "Summarize the following news article:\nThe city council met on Tuesday to discuss the new park.\nSummary:\n",
    "Summarize the following news article:\nA storm closed schools across the region for two days.\nSummary:\n",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("merge-runs")
    out = {}
    for name, sections in RUNS.items():
        sections = {k: dict(v) for k, v in sections.items()}
        sections.setdefault("train", {}).setdefault("max_steps", 3)
        sections["train"].setdefault("lr", 1e-2)
        sections["eval"] = {"generate": False}
        out[name] = lorakit.train(tiny_recipe(cache_dir, base / name, **sections)).run_dir
    return out


def _classes(run_dir: Path):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    seq2seq = rundir.read_summary(run_dir)["model"] == "tiny:t5"
    return (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM), AutoTokenizer, seq2seq


def text_logits(model, tok, seq2seq: bool) -> torch.Tensor:
    """Logits on real text, padded: a different probe from the merge's own random tokens."""
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    kwargs = dict(enc)
    if seq2seq:
        kwargs["decoder_input_ids"] = tok(
            ["The council", "Schools closed"], return_tensors="pt", padding=True
        )["input_ids"]
    with torch.no_grad():
        logits = model.eval()(**kwargs, use_cache=False).logits.float()
    return logits if seq2seq else logits[enc["attention_mask"].bool()]  # real positions only


def adapter_logits(run_dir: Path, dtype: str) -> torch.Tensor:
    """The reference built by hand: the unquantized base + PeftModel (unmerged), in `dtype`."""
    from peft import PeftModel

    auto, auto_tok, seq2seq = _classes(run_dir)
    base = auto.from_pretrained(rundir.read_summary(run_dir)["model_source"], dtype=getattr(torch, dtype))
    model = PeftModel.from_pretrained(base, run_dir / "adapter")
    return text_logits(model, auto_tok.from_pretrained(run_dir / "adapter"), seq2seq)


def loaded_logits(run_dir: Path, merged: Path, dtype: str) -> torch.Tensor:
    auto, auto_tok, seq2seq = _classes(run_dir)
    model = auto.from_pretrained(merged)  # its own saved dtype
    assert model.dtype == getattr(torch, dtype)
    return text_logits(model, auto_tok.from_pretrained(merged), seq2seq)


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: str) -> float:
    diff = float((got - ref).abs().max())
    assert diff <= RELATIVE_TOLERANCE[dtype] * max(float(ref.abs().max()), 1.0), diff
    return diff


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["t5-lora", "llama-lora", "t5-qlora", "llama-qlora"])
def test_merged_model_loads_and_matches_the_adapter_model(runs, name, dtype, tmp_path, capsys):
    run_dir = runs[name]
    out = tmp_path / "merged"
    result = lorakit.merge(run_dir, out, dtype=dtype, compare_quantized=name.endswith("qlora"))
    assert result.output_dir == out.resolve() and result.shards == 1 and result.dtype == dtype
    # In memory: merged, then the saved copy reloaded; streamed: the saved copy reloaded (and every tensor).
    merged_check, reloaded_check = result.checks[0], result.checks[-1]
    assert merged_check.passed and reloaded_check.passed
    assert result.strategy == "stream" and result.tensors.merged > 0 and result.tensors.worst <= 1
    # The probe sees the adapter (an export of the unmerged base would fail the check), far above the error.
    assert merged_check.effect_visible and merged_check.adapter_effect > 10 * merged_check.max_logit_diff
    if dtype == "float32":
        assert merged_check.max_logit_diff < 1e-4

    assert_close(loaded_logits(run_dir, out, dtype), adapter_logits(run_dir, dtype), dtype)
    for name_ in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "README.md",
        "model.safetensors",
    ):
        assert (out / name_).is_file(), name_
    config = json.loads((out / "config.json").read_text())
    assert config["use_cache"] is True and config["dtype"] == dtype
    card = (out / "README.md").read_text()
    summary = rundir.read_summary(run_dir)
    assert summary["model"] in card and f"{summary['eval']['loss']:.4f}" in card
    assert "lorakit 0.1.0" in card and "kind: " in card  # version, and the recipe
    printed = capsys.readouterr().out
    if name.endswith("qlora"):
        assert result.method == "qlora"
        assert "unquantized" in card and "QLoRA run" in printed
        # Reported, not gated: the 4-bit base differs from the dequantized one by its quantization error.
        assert result.quantized is not None and result.quantized.max_logit_diff > 0
        assert "4-bit base" in printed


@pytest.mark.slow
def test_output_merge_in_the_recipe_merges_after_training(runs):
    run_dir = runs["t5-lora"]
    summary = rundir.read_summary(run_dir)
    assert summary["merged_dir"] == str(run_dir / "merged") and summary["zero_stage"] == 3
    ref = adapter_logits(run_dir, "float32")  # the recipe's model.dtype
    assert_close(loaded_logits(run_dir, run_dir / "merged", "float32"), ref, "float32")
    assert not list(run_dir.glob(".merged*"))  # no temp directory left beside it


@pytest.mark.slow
def test_small_shards_have_a_complete_index(runs, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForSeq2SeqLM

    run_dir = runs["t5-lora"]
    out = tmp_path / "sharded"
    result = lorakit.merge(run_dir, out, dtype="float32", max_shard_size="300KB")
    files = sorted(out.glob("*.safetensors"))
    assert result.shards == len(files) >= 3 and not (out / "model.safetensors").exists()
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map.values()) == {f.name for f in files}
    stored = {}
    for f in files:
        assert f.stat().st_size <= 300_000 or len(safe_open(str(f), "pt").keys()) == 1
        with safe_open(str(f), framework="pt") as sf:
            stored.update(dict.fromkeys(sf.keys(), f.name))
    assert stored == weight_map  # every tensor listed, in the file the index names
    sharded = AutoModelForSeq2SeqLM.from_pretrained(out)
    whole = AutoModelForSeq2SeqLM.from_pretrained(run_dir / "merged")
    assert all(
        torch.equal(a, b)
        for a, b in zip(sharded.state_dict().values(), whole.state_dict().values(), strict=True)
    )


@pytest.mark.slow
def test_full_run_exports_in_the_requested_dtype(runs, tmp_path):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    run_dir = runs["t5-full"]
    result = lorakit.merge(run_dir, tmp_path / "full", dtype="bfloat16")
    assert result.method == "full" and len(result.checks) == 1 and result.checks[0].max_logit_diff == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "full")
    exported = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "full")
    saved = AutoModelForSeq2SeqLM.from_pretrained(run_dir / "model", dtype=torch.bfloat16)
    assert exported.dtype == torch.bfloat16
    assert_close(text_logits(exported, tok, True), text_logits(saved, tok, True), "bfloat16")
    # The run saved its training config (use_cache off); the export is for serving.
    assert json.loads((run_dir / "model" / "config.json").read_text())["use_cache"] is False
    assert json.loads((tmp_path / "full" / "config.json").read_text())["use_cache"] is True
    assert "fully fine-tuned" in (tmp_path / "full" / "README.md").read_text()
    with pytest.raises(MergeError, match="no base to merge into"):
        lorakit.merge(run_dir, tmp_path / "x", base="tiny:t5")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, base, message",
    [
        ("llama-lora", "tiny:qwen2", "model_type 'llama' -> 'qwen2'"),
        ("t5-lora", "tiny:llama", "model_type 't5' -> 'llama'"),
    ],
)
def test_adapter_for_another_base_is_refused(runs, name, base, message, tmp_path):
    with pytest.raises(AdapterError, match="does not match the base") as e:
        lorakit.merge(runs[name], tmp_path / "out", base=base)
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_zeroed_adapter_is_refused(runs, tmp_path):
    from safetensors.torch import load_file, save_file

    adapter = tmp_path / "adapter"
    shutil.copytree(runs["llama-lora"] / "adapter", adapter)
    weights = load_file(adapter / "adapter_model.safetensors")
    save_file(
        {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in weights.items()},
        adapter / "adapter_model.safetensors",
    )
    with pytest.raises(AdapterError, match="has no effect"):
        lorakit.merge(adapter, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["memory", "stream"])
def test_interrupted_save_leaves_nothing(runs, tmp_path, monkeypatch, strategy):
    import lorakit.export.job as job
    import lorakit.export.stream_job as stream_job

    def interrupted(model, directory, shard_bytes):
        model.save_pretrained(str(directory), max_shard_size=shard_bytes)  # half the work is on disk
        raise KeyboardInterrupt

    def interrupted_stream(plan, directory, shard_bytes):
        stream_job_write(plan, directory, shard_bytes)  # the shards are on disk
        raise KeyboardInterrupt

    stream_job_write = stream_job.write_shards
    monkeypatch.setattr(job, "_save_model", interrupted)
    monkeypatch.setattr(stream_job, "write_shards", interrupted_stream)
    out = tmp_path / "deeper" / "merged"
    with pytest.raises(KeyboardInterrupt):
        lorakit.merge(runs["llama-lora"], out, strategy=strategy)
    assert not out.exists() and not (tmp_path / "deeper").exists()
    assert list(tmp_path.iterdir()) == []  # no temp directory either


@pytest.mark.slow
def test_an_export_of_the_unmerged_base_fails_verification(runs, tmp_path, monkeypatch):
    import lorakit.export.job as job

    # The peer failure: the LoRA layers dropped instead of merged, so the base is exported as is.
    monkeypatch.setattr(job, "_merge_weights", lambda peft_model: peft_model.unload())
    out = tmp_path / "merged"
    out.mkdir()  # an empty directory may be the target; it must stay as it was
    with pytest.raises(VerificationError, match="merge refused, nothing written") as e:
        lorakit.merge(runs["t5-qlora"], out, dtype="bfloat16", strategy="memory")
    assert e.value.exit_code == 3
    assert out.is_dir() and not any(out.iterdir()) and [p.name for p in tmp_path.iterdir()] == ["merged"]


@pytest.mark.slow
def test_a_streamed_merge_that_skips_a_delta_fails_its_tensor_check(runs, tmp_path, monkeypatch):
    import lorakit.export.stream as stream

    real = stream.merge_tensor
    # The peer failure, streamed: one module's delta is not added (the base tensor written as it was).
    skipped = []

    def skip_one(w, delta):
        if skipped:
            return real(w, delta)
        skipped.append(delta.module)
        return w.float()

    monkeypatch.setattr("lorakit.export.stream_job.merge_tensor", skip_one)
    out = tmp_path / "merged"
    with pytest.raises(VerificationError, match="is not W [+] scale [*] B A") as e:
        lorakit.merge(runs["llama-lora"], out, dtype="bfloat16", verify="never")
    assert e.value.exit_code == 3 and skipped[0] in str(e.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_existing_output_needs_force(runs, tmp_path):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(MergeError, match="exists and is not empty; choose another or pass --force"):
        lorakit.merge(runs["llama-lora"], out)
    assert (out / "old.txt").is_file()
    lorakit.merge(runs["llama-lora"], out, force=True)
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]
    with pytest.raises(MergeError, match="which the merge reads"):
        lorakit.merge(runs["llama-lora"], runs["llama-lora"], force=True)
