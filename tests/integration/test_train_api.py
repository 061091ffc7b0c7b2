"""lorakit.train in-process (one process, private group): LoRA on ZeRO-2 and full fine-tuning on ZeRO-3."""

import json

import pytest
import torch

import lorakit
from lorakit.recipe import recipe_from_dict
from tests.conftest import tiny_recipe_dict


@pytest.mark.slow
def test_train_api_lora_zero2(cache_dir, tmp_path):
    recipe = recipe_from_dict(
        tiny_recipe_dict(
            cache_dir,
            tmp_path / "run",
            train={"epochs": 2, "lr": 1e-2, "gradient_accumulation_steps": 3},
            distributed={"zero_stage": 2},
            eval={"metrics": ["rouge", "exact_match"]},
        )
    )
    result = lorakit.train(recipe)
    s = result.summary
    assert result.run_dir == (tmp_path / "run").resolve()
    # 32 rows / 4 per batch = 8 micro-batches -> 3 windows per epoch (the last one short), 2 epochs.
    assert s["steps"] == 6 and s["epochs"] == 2
    assert s["train_samples"] == 64
    assert s["loss"]["last"] < s["loss"]["first"]
    assert s["zero_stage"] == 2 and s["world_size"] == 1
    assert {"loss", "rouge1", "exact_match"} <= set(s["eval"])
    evals = [
        json.loads(line)
        for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "eval"
    ]
    assert [e["epoch"] for e in evals] == [0, 1]
    assert (result.run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert not torch.distributed.is_initialized()  # the private group is torn down


@pytest.mark.slow
def test_full_finetune_zero3_saves_a_loadable_model(cache_dir, tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    recipe = recipe_from_dict(
        tiny_recipe_dict(
            cache_dir,
            tmp_path / "run",
            method={"kind": "full"},
            train={"max_steps": 3, "lr": 1e-3},
            distributed={"zero_stage": 3},
            eval={"generate": False},
        )
    )
    s = lorakit.train(recipe).summary
    assert s["method"] == "full" and s["trainable_params"] == s["total_params"]
    assert s["adapter_dir"] is None and s["steps"] == 3
    model = AutoModelForSeq2SeqLM.from_pretrained(s["model_dir"])
    base = AutoModelForSeq2SeqLM.from_pretrained(s["model_source"])
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, base.get_parameter(n))]
    assert changed and "lm_head.weight" in changed
    assert model.lm_head.weight is not model.shared.weight
