"""Gemma 3 as gemma-3-4b/12b/27b-it ship (Gemma3ForConditionalGeneration: a SigLIP vision tower and a
projector beside the language model, tensors named as on the hub), fine-tuned on text: LoRA with
all-linear adapts the language model only (said once on the console, counted so by the planner), the
adapter holds no vision-tower module, and the streaming merge reads the hub's key names through
transformers' conversion mapping (no fallback to the in-memory merge) and writes what the in-memory merge
writes; the export loads as Gemma3ForConditionalGeneration with the vision tower byte-identical."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import lorakit
from lorakit import rundir
from lorakit.testing import build_tiny_gemma3_multimodal
from tests.conftest import tiny_recipe

TOWERS = ("vision_tower", "multi_modal_projector")


def _weights(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors |= load_file(str(f))
    return tensors


@pytest.fixture(scope="module")
def run(cache_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("gemma3-mm")
    build_tiny_gemma3_multimodal(base / "model")
    recipe = tiny_recipe(
        cache_dir,
        base / "run",
        model={"name_or_path": str(base / "model")},
        method={"target_modules": "all-linear"},
        data={"format": "instruction", "max_length": "auto", "max_samples": 16},
        train={"max_steps": 3, "lr": 1e-2},
        eval={"generate": False},
    )
    return base, recipe


@pytest.mark.slow
def test_text_lora_adapts_the_language_model_only_and_both_merges_agree(run, tmp_path, capsys):
    from transformers import AutoConfig

    base, recipe = run
    result = lorakit.train(recipe)
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "multimodal checkpoint" in line]
    assert len(said) == 1 and "language model only" in said[0] and "vision_tower" in said[0], out

    adapter = load_file(str(result.run_dir / "adapter" / "adapter_model.safetensors"))
    assert adapter and not [k for k in adapter if any(t in k for t in TOWERS)]
    assert all(".language_model." in k for k in adapter)
    config = json.loads((result.run_dir / "adapter" / "adapter_config.json").read_text())
    assert config["exclude_modules"] and "vision_tower" in config["exclude_modules"]
    # The planner counts what was adapted: its trainable parameters are the run's.
    summary = rundir.read_summary(result.run_dir)
    assert (
        summary["plan"]["trainable_params"]
        == summary["trainable_params"]
        == sum(t.numel() for t in adapter.values())
    ), summary["plan"]

    streamed = lorakit.merge(result.run_dir, tmp_path / "stream", strategy="stream", dtype="float32")
    memory = lorakit.merge(result.run_dir, tmp_path / "memory", strategy="memory", dtype="float32")
    assert streamed.strategy == "stream" and memory.strategy == "memory"
    assert streamed.tensors.merged == len(adapter) // 2
    assert "merging in memory" not in capsys.readouterr().out.split("merging (streaming")[0]
    a, b, original = _weights(tmp_path / "stream"), _weights(tmp_path / "memory"), _weights(base / "model")
    assert a.keys() == b.keys() == original.keys()  # the hub's names, as the base checkpoint's
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]
    towers = [k for k in original if k.startswith(TOWERS)]
    assert any(k.startswith("vision_tower.vision_model.") for k in towers)
    assert all(a[k].dtype == original[k].dtype and torch.equal(a[k], original[k]) for k in towers)
    changed = [k for k in original if not torch.equal(a[k], original[k])]
    assert changed and all(k.startswith("language_model.model.layers.") for k in changed), changed
    for out_dir in ("stream", "memory"):
        assert AutoConfig.from_pretrained(tmp_path / out_dir).architectures == [
            "Gemma3ForConditionalGeneration"
        ]
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "stream")
    assert type(merged).__name__ == "Gemma3ForConditionalGeneration"
