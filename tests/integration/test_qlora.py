"""QLoRA on 2 processes, ZeRO-2 and ZeRO-3, for a tiny Llama and a tiny T5: training, summary, adapter.

One torchrun launch trains the four recipes (qlora_worker.py); the checks then load each adapter with
PeftModel.from_pretrained onto the 4-bit base, in this process. Every launched process is told its CPU has
AVX512-BF16 (tests/bnb_layout.py; forked from a fork server forced so, forced_bnb.py, rather than started
fresh), so bitsandbytes' CPU inference layout is in play on any machine: the
runs evaluate between training steps and checkpoints, where that layout broke ZeRO-3. A ZeRO-3 QLoRA run
resumed after such an evaluation, in a fresh launch with dropout on, is test_fsdp.py's (beside FSDP2's).
"""

from pathlib import Path

import pytest
import torch

from lorakit import rundir
from tests.conftest import tiny_recipe_dict
from tests.integration.forced_bnb import forced_server
from tests.integration.qlora_worker import train_in_one_launch

RUNS = [(kind, stage) for kind in ("llama", "t5") for stage in (2, 3)]


def qlora_recipe(cache: Path, out: Path, kind: str, stage: int) -> dict:
    """A few steps of QLoRA on tiny:KIND, 2 processes, ZeRO `stage`; generation only on ZeRO-3."""
    data = {"max_samples": 32, "max_eval_samples": 8}
    # Two epochs: the epoch-end evaluation runs between training steps and before a checkpoint.
    train = {"max_steps": 6, "lr": 2e-2, "epochs": 2}
    if kind == "llama":
        # Packed rows with per-example attention: the causal path as users run it.
        data.update({"format": "instruction", "packing": True, "max_length": "auto"})
        train["max_tokens"] = 512
    else:
        data["packing"] = False
    return tiny_recipe_dict(
        cache,
        out,
        model={"name_or_path": f"tiny:{kind}", "dtype": "bfloat16", "gradient_checkpointing": True},
        method={"kind": "qlora", "r": 8, "alpha": 16},
        data=data,
        train=train,
        distributed={"num_processes": 2, "zero_stage": stage},
        eval={"generate": stage == 3, "max_new_tokens": 4},
        checkpoint={"every": 2},
    )


@pytest.fixture(scope="module")
def qlora_runs(tmp_path_factory, cache_dir):
    base = tmp_path_factory.mktemp("qlora")
    run_dirs = {(kind, stage): base / f"{kind}-zero{stage}" for kind, stage in RUNS}
    recipes = {
        base / f"{d.name}.yaml": qlora_recipe(cache_dir, d, kind, stage)
        for (kind, stage), d in run_dirs.items()
    }
    # Every process launched: bitsandbytes' AVX512-BF16 branch forced, whatever this CPU has.
    with forced_server(tmp_path_factory.mktemp("forced-bnb"), "1") as forced:
        proc = train_in_one_launch(recipes, forced.env)
    return proc, {key: rundir.read_summary(d) for key, d in run_dirs.items()}, run_dirs


def plain_numel(source: str, kind: str) -> int:
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    cls = AutoModelForSeq2SeqLM if kind == "t5" else AutoModelForCausalLM
    return sum(p.numel() for p in cls.from_pretrained(source).parameters())


@pytest.mark.slow
@pytest.mark.parametrize("kind, stage", RUNS)
def test_qlora_trains_and_reports_the_quantization(qlora_runs, kind, stage):
    proc, summaries, _ = qlora_runs
    s = summaries[kind, stage]
    assert s["method"] == "qlora" and s["world_size"] == 2 and s["zero_stage"] == stage
    assert s["loss"]["last"] < 0.9 * s["loss"]["first"], s["loss"]
    assert s["adapter_dir"] and "loss" in s["eval"]
    if stage == 3:
        assert "rouge1" in s["eval"]  # generation from the partitioned 4-bit base
    # Parameters are counted as the weights they stand for, not as packed 4-bit storage.
    assert s["total_params"] == plain_numel(s["model_source"], kind) + s["trainable_params"]

    q = s["quantization"]
    assert (q["type"], q["bits"], q["double_quant"]) == ("bitsandbytes-nf4", 4, True)
    assert q["compute_dtype"] == q["storage_dtype"] == "bfloat16"
    # T5: transformers keeps `wo` (its _keep_in_fp32_modules) out of quantization; lorakit reports it.
    assert q["unquantized_linear"] == (["lm_head", "wo"] if kind == "t5" else ["lm_head"])
    b = q["base_bytes"]
    base_params = s["total_params"] - s["trainable_params"]
    assert b["before"] == 2 * base_params  # every base weight in bf16
    # 4 bits per quantized weight, the constants, and the rest still in bf16.
    packed = q["quantized_params"] // 2
    assert b["after"] == packed + b["quant_constants"] + 2 * (base_params - q["quantized_params"])
    assert b["saved"] == b["before"] - b["after"] > 0
    assert b["quant_constants"] >= q["quantized_params"] // 64  # at least one byte per block of 64
    assert "quantization: bitsandbytes-nf4" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_zero3_counts_the_partitioned_base_like_zero2(qlora_runs, kind):
    _, summaries, _ = qlora_runs
    z2, z3 = summaries[kind, 2], summaries[kind, 3]
    per_rank = {k: s["quantization"].pop("base_bytes_per_rank") for k, s in (("z2", z2), ("z3", z3))}
    assert z3["quantization"] == z2["quantization"]
    assert per_rank["z3"] < per_rank["z2"]  # ZeRO-3 partitions the 4-bit base; ZeRO-2 keeps it whole
    assert (z3["total_params"], z3["trainable_params"]) == (z2["total_params"], z2["trainable_params"])


def _eval_loss(model, kind: str, eval_ds) -> float:
    from lorakit.data.collate import CausalCollator, Seq2SeqCollator
    from lorakit.model.loss import token_loss_sum

    if kind == "t5":
        collate = Seq2SeqCollator(0, model.config.decoder_start_token_id)
        keys = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")
    else:
        collate, keys = CausalCollator(0), ("input_ids", "attention_mask")
    loss = tokens = 0.0
    with torch.no_grad():
        for start in range(0, len(eval_ds), 8):
            batch = collate([eval_ds[i] for i in range(start, min(start + 8, len(eval_ds)))])
            logits = model(**{k: batch[k] for k in keys}).logits
            loss += float(token_loss_sum(logits, batch["labels"]))
            tokens += batch["num_target_tokens"]
    return loss / tokens


@pytest.fixture(scope="module")
def four_bit_bases() -> dict:
    """kind -> (its 4-bit base, that base's eval loss): loaded once for both stages' adapters."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("kind, stage", RUNS)
def test_adapter_loads_onto_the_4bit_base(qlora_runs, four_bit_bases, kind, stage):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from lorakit.data.cache import load_cached
    from lorakit.model.quantize import bnb_config

    _, summaries, _ = qlora_runs
    s = summaries[kind, stage]
    adapter = Path(s["adapter_dir"])
    weights = load_file(adapter / "adapter_model.safetensors")
    assert all(t.numel() > 0 for t in weights.values())  # whole, not empty ZeRO-3 shells
    if kind == "t5":
        assert any(".wo.lora_A" in k for k in weights)  # the unquantized wo gets LoRA too
    splits, _ = load_cached(Path(s["data"]["cache_dir"]))
    if kind not in four_bit_bases:
        cls = AutoModelForSeq2SeqLM if kind == "t5" else AutoModelForCausalLM
        loaded = cls.from_pretrained(
            s["model_source"], dtype=torch.bfloat16, quantization_config=bnb_config("nf4", torch.bfloat16)
        ).eval()
        assert loaded.is_loaded_in_4bit
        four_bit_bases[kind] = loaded, _eval_loss(loaded, kind, splits["eval"])
    base, base_loss = four_bit_bases[kind]
    model = PeftModel.from_pretrained(base, adapter).eval()
    try:
        loss = _eval_loss(model, kind, splits["eval"])
    finally:
        model.unload()  # the base as loaded again, for the other stage's adapter
    assert loss == pytest.approx(s["eval"]["loss"], rel=0.02)
    assert base_loss - loss > 0.05 * base_loss  # the adapter changes (improves) the 4-bit model
