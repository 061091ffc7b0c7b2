"""lorakit.train in-process (one process, private group): LoRA on ZeRO-2 and full fine-tuning on ZeRO-3."""

import json

import pytest
import torch

import lorakit
from tests.conftest import tiny_recipe


@pytest.mark.slow
def test_train_api_lora_zero2(cache_dir, tmp_path, capsys):
    recipe = tiny_recipe(
        cache_dir,
        tmp_path / "run",
        train={"epochs": 2, "lr": 1e-2, "gradient_accumulation_steps": 3},
        distributed={"zero_stage": 2},
        eval={"metrics": ["rouge", "exact_match"]},
    )
    result = lorakit.train(recipe)
    s = result.summary
    assert result.run_dir == (tmp_path / "run").resolve()
    # 32 rows / 4 per batch = 8 micro-batches -> 3 windows per epoch (the last one short), 2 epochs.
    assert s["steps"] == 6 and s["epochs"] == 2
    assert s["train_samples"] == 64
    assert s["loss"]["last"] < s["loss"]["first"]
    assert s["zero_stage"] == 2 and s["world_size"] == 1
    assert s["flops"]["flops_per_token"] is None and "encoder-decoder" in s["flops"]["why"]
    # Packed T5 rows (data.packing auto) on the CPU: the per-example loop for each attention kind, named in
    # summary.json and, once each, on the console with the reason.
    assert s["attention"] == "lorakit_varlen_sdpa"
    assert set(s["attention_kernels"]) == {"encoder", "decoder", "cross"}
    assert all(set(k) == {"loop"} and k["loop"] > 0 for k in s["attention_kernels"].values())
    out = capsys.readouterr().out
    line = "packed attention: T5 encoder self-attention -> per-example SDPA (lorakit.model.varlen) (cpu: "
    assert out.count(line) == 1, out[-3000:]
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

    recipe = tiny_recipe(
        cache_dir,
        tmp_path / "run",
        method={"kind": "full"},
        train={"max_steps": 3, "lr": 1e-3},
        distributed={"zero_stage": 3},
        eval={"generate": False},
    )
    s = lorakit.train(recipe).summary
    assert s["method"] == "full" and s["trainable_params"] == s["total_params"]
    assert s["adapter_dir"] is None and s["steps"] == 3
    model = AutoModelForSeq2SeqLM.from_pretrained(s["model_dir"])
    base = AutoModelForSeq2SeqLM.from_pretrained(s["model_source"])
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, base.get_parameter(n))]
    assert changed and "lm_head.weight" in changed
    assert model.lm_head.weight is not model.shared.weight


def _chat_rows(n: int) -> list[dict]:
    """Two-turn conversations whose answers follow from the question (so a LoRA can learn them)."""
    colors = ["red", "blue", "green", "white", "black", "yellow"]
    rows = []
    for i in range(n):
        c = colors[i % len(colors)]
        rows.append(
            {
                "messages": [
                    {"role": "system", "content": "Answer with one word."},
                    {"role": "user", "content": f"Name the color: {c}."},
                    {"role": "assistant", "content": c},
                    {"role": "user", "content": f"Again, the color {c}?"},
                    {"role": "assistant", "content": f"{c} again"},
                ]
            }
        )
    return rows


@pytest.mark.slow
def test_train_api_packed_chat_on_qwen2(cache_dir, tmp_path):
    data_dir = tmp_path / "chat"
    data_dir.mkdir()
    for split, n in (("train", 96), ("validation", 8)):
        lines = (json.dumps(r) for r in _chat_rows(n))
        (data_dir / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    recipe = tiny_recipe(
        cache_dir,
        tmp_path / "run",
        model={"name_or_path": "tiny:qwen2"},
        data={
            "source": str(data_dir),
            "format": "chat",
            "packing": True,
            "max_length": "auto",
            "max_samples": 96,
        },
        # ~91 tokens per conversation: 4 per packed row.
        train={"epochs": 3, "lr": 2e-2, "max_tokens": 384},
        distributed={"zero_stage": 2},
        eval={"metrics": ["exact_match"], "max_new_tokens": 4},
    )
    s = lorakit.train(recipe).summary
    assert s["attention"] == "lorakit_varlen_sdpa" and s["batching"]["packing"]
    assert s["train_samples"] == 3 * 96
    assert s["packing_efficiency"] > 0.9
    assert s["loss"]["last"] < 0.6 * s["loss"]["first"]
    assert s["data"]["format"] == "chat" and s["data"]["overlong"]["dropped"] == 0
    assert "exact_match" in s["eval"]
    # Both MFU counts' FLOPs per token (issue 61): NeMo's is 4 per frozen weight and 2 per LoRA weight
    # (ours 4 and 6); no bf16 peak is known for a CPU, so no MFU.
    flops = s["flops"]["flops_per_token"]
    assert 0 < flops["nemo"] < flops["lorakit"]
    assert s["flops"]["mfu"] is None and s["flops"]["mfu_nemo"] is None


def test_packing_budget_below_the_longest_example_is_a_clear_error(cache_dir, tmp_path):
    from lorakit.errors import DataError

    recipe = tiny_recipe(cache_dir, tmp_path / "run", data={"packing": True}, train={"max_tokens": 50})
    with pytest.raises(
        DataError, match=r"train\.max_tokens=50 is smaller than the longest source \(96 tokens\)"
    ):
        lorakit.train(recipe)


def test_log_every_thins_metrics_but_keeps_the_last_step(cache_dir, tmp_path):
    recipe = tiny_recipe(
        cache_dir,
        tmp_path / "run",
        train={"max_steps": 5, "log_every": 2},
        eval={"enabled": False},
        output={"save_adapter": False},
    )
    result = lorakit.train(recipe)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [2, 4, 5]
    assert result.summary["steps"] == 5
