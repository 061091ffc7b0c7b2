"""python -m lorakit.run recipes/quickstart_causal.yaml: a packed causal-LM run on 2 processes, ZeRO-3; and
the same with a 4-bit base (method.kind=qlora)."""

import os

import pytest
import torch

from lorakit import rundir
from lorakit.model.cpu_products import FORCE
from tests.bnb_layout import ENV as AVX512BF16_ENV
from tests.conftest import ROOT
from tests.e2e.test_quickstart import machine_matmul, noise_lines, quiet_zero3_summary, recipe_run, run_recipe
from tests.integration.test_resume import FAULTS

quickstart_causal = recipe_run("quickstart_causal.yaml")


@pytest.mark.slow
def test_packed_causal_run_trains_and_reports_packing(quickstart_causal):
    summary = quiet_zero3_summary(quickstart_causal)
    proc = quickstart_causal[0]
    assert summary["attention"] == "lorakit_varlen_sdpa"
    assert summary["loss"]["last"] < 0.8 * summary["loss"]["first"]
    assert summary["packing_efficiency"] >= 0.95
    batching = summary["batching"]
    assert batching["packing"] is True and batching["max_tokens"] == 1024
    assert batching["sampler_efficiency_epoch0"] >= 0.95
    # Every example trained once per epoch, on both ranks together.
    assert summary["train_samples"] == 512 * summary["epochs"]
    assert summary["steps"] == 2 * batching["steps_per_epoch"]
    assert {"loss", "rouge1", "rougeL"} <= set(summary["eval"])
    overlong = summary["data"]["overlong"]
    assert overlong["policy"] == "truncate" and overlong["dropped"] == 0
    # Printed at start: micro-batches, steps, packing, and what the overlong policy did.
    assert "batching:" in proc.stdout and "packed rows of <= 1024 tokens" in proc.stdout
    assert "truncated" in proc.stdout


@pytest.mark.slow
def test_causal_adapter_loads_with_peft_and_matches_eval_loss(quickstart_causal):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lorakit.data.cache import load_cached
    from lorakit.data.collate import CausalCollator
    from lorakit.model.loss import token_loss_sum

    _, _, run_dir = quickstart_causal
    summary = rundir.read_summary(run_dir)
    adapter = run_dir / "adapter"
    splits, _ = load_cached(__import__("pathlib").Path(summary["data"]["cache_dir"]))
    eval_ds = splits["eval"]
    base = AutoModelForCausalLM.from_pretrained(summary["model_source"], dtype=torch.bfloat16).eval()
    model = PeftModel.from_pretrained(base, adapter).eval()
    collate = CausalCollator(0)
    loss = tokens = 0.0
    with torch.no_grad():
        for start in range(0, len(eval_ds), 8):
            batch = collate([eval_ds[i] for i in range(start, min(start + 8, len(eval_ds)))])
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss += float(token_loss_sum(logits, batch["labels"]))
            tokens += batch["num_target_tokens"]
    assert loss / tokens == pytest.approx(summary["eval"]["loss"], rel=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("verbose", ["0", "1"], ids=["quiet", "LORAKIT_VERBOSE"])
def test_qlora_quickstart_on_zero3_with_a_quiet_console(tmp_path, verbose):
    """The causal quickstart with a 4-bit base, bitsandbytes' AVX512-BF16 branch forced on (its CPU inference
    layout once broke this) and the bf16 products this CPU would not choose (lorakit.model.cpu_products; the
    T5 quickstart takes the CPU's own choice): trains, evaluates (generating) and saves on 2 processes with
    ZeRO-3, and the console holds no other library's chatter unless LORAKIT_VERBOSE=1 asks for it. A quarter
    of the data and shorter generations: the quickstart's own size is
    test_packed_causal_run_trains_and_reports_packing's."""
    env = {
        **os.environ,
        AVX512BF16_ENV: "1",
        "LORAKIT_VERBOSE": verbose,
        FORCE: {"fp32": "native", "native": "fp32"}[machine_matmul()],
        "PYTHONPATH": os.pathsep.join([str(FAULTS), str(ROOT)]),
    }
    env.pop("OMP_NUM_THREADS", None)  # torchrun's banner about it is part of what is checked
    overrides = ["method.kind=qlora"] + (
        ["train.max_steps=2", "eval.generate=false"]
        if verbose == "1"
        else ["data.max_samples=128", "data.max_eval_samples=16", "eval.max_new_tokens=8"]
    )
    run = run_recipe(tmp_path, "quickstart_causal.yaml", *overrides, env=env)
    proc, _, run_dir = run
    if verbose == "1":
        noise = "\n".join(noise_lines(proc))
        assert "Setting accelerator to CPU" in noise and "OMP_NUM_THREADS" not in noise  # lorakit sets it
        return
    summary = quiet_zero3_summary(run)
    assert summary["method"] == "qlora"
    assert summary["matmul"] == env[FORCE]
    assert summary["loss"]["last"] < 0.8 * summary["loss"]["first"]
    assert {"loss", "rouge1"} <= set(summary["eval"]) and (run_dir / "adapter").is_dir()
    assert "quantization: bitsandbytes-nf4" in proc.stdout
