"""DoRA, rsLoRA, PiSSA, LoRA+ and IA3 under 2-process ZeRO-3 on CPU, on tiny T5 and tiny Llama.

One torchrun launch trains three runs per model family (qlora_worker.py trains recipes in order): LoRA
with DoRA + rsLoRA + LoRA+, LoRA with PiSSA init (Llama: and modules_to_save), and IA3. Each run's loss
falls; its adapter, saved under ZeRO-3, loads with PeftModel.from_pretrained on the ORIGINAL base (for
PiSSA: the converted adapter) and reproduces the run's eval loss; lorakit.merge verifies the merged model
against it; the planner counts the run's trainable parameters; LoRA+'s groups are read back from the
engine's optimizer. About 2 minutes on 2 CPU cores.

The same launch then trains test_zeropp.py's ZeRO++ hpZ check: a plain ZeRO-3 run of the tiny T5 and the
same run with hpz_partition_size 2, last (hpZ leaves its group in DeepSpeed's globals for the process).
hpZ on 2 processes makes one secondary group of the whole world: the degenerate case, but DeepSpeed builds
and all-gathers the secondary partition all the same. The tiny T5 has a separate output head, which lorakit
restores under a second zero.Init (model/untie.py): without passing that init the hpZ group the first one
made, DeepSpeed fails (issues #4901, #7066), so the check also guards that workaround. See
docs/multinode.md#zero.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lorakit
from lorakit import rundir
from lorakit.data.cache import load_cached
from lorakit.engine.checkpoint import complete_checkpoints
from tests.conftest import ROOT, run_cli, tiny_recipe, tiny_recipe_dict
from tests.integration.qlora_worker import train_in_one_launch
from tests.integration.test_qlora import _eval_loss
from tests.integration.test_zeropp import zeropp_recipe

LR, RATIO = 1e-2, 8
# name -> method section; each named method runs on both families.
METHODS = {
    "dora-rslora-loraplus": {"use_dora": True, "use_rslora": True, "lr_ratio_b": RATIO},
    "pissa": {"init": "pissa"},
    "ia3": {"kind": "ia3"},
}
RUNS = [(family, name) for family in ("t5", "llama") for name in METHODS]
# The ZeRO++ hpZ check's two runs (after RUNS, in this order): plain ZeRO-3 and with hpZ.
HPZ = {"plain": {}, "hpz": {"hpz_partition_size": 2}}


def methods_recipe(cache: Path, out: Path, family: str, name: str) -> dict:
    method = {"r": 4, "alpha": 8, **METHODS[name]}
    if family == "llama" and name == "pissa":
        method["modules_to_save"] = ["embed_tokens"]
    data = {"max_samples": 16, "max_eval_samples": 8}
    if family == "llama":
        data.update({"format": "instruction", "packing": True, "max_length": "auto"})
    return tiny_recipe_dict(
        cache,
        out,
        model={"name_or_path": f"tiny:{family}", "dtype": "float32"},
        method=method,
        data=data,
        # IA3 trains a few vectors from ones: it needs a larger step to move in a few steps.
        train={"max_steps": 4, "lr": 0.1 if name == "ia3" else LR, "micro_batch_size": 2},
        distributed={"num_processes": 2, "zero_stage": 3},
        eval={"generate": False},
    )


@pytest.fixture(scope="module")
def method_runs(tmp_path_factory, cache_dir) -> dict[tuple[str, str], Path]:
    base = tmp_path_factory.mktemp("methods")
    run_dirs = {(family, name): base / f"{family}-{name}" for family, name in RUNS}
    recipes = {
        base / f"{d.name}.yaml": methods_recipe(cache_dir, d, family, name)
        for (family, name), d in run_dirs.items()
    }
    for name, distributed in HPZ.items():
        run_dirs[name] = base / name
        recipes[base / f"{name}.yaml"] = zeropp_recipe(cache_dir, run_dirs[name], **distributed)
    train_in_one_launch(recipes, {"PYTHONPATH": str(ROOT)})
    return run_dirs


def _base(summary: dict):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    cls = AutoModelForSeq2SeqLM if summary["model"] == "tiny:t5" else AutoModelForCausalLM
    return cls.from_pretrained(summary["model_source"], dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("family, name", RUNS)
def test_method_trains_saves_whole_and_reloads_on_the_original_base(method_runs, family, name):
    from peft import PeftModel

    run_dir = method_runs[family, name]
    s = rundir.read_summary(run_dir)
    assert s["world_size"] == 2 and s["zero_stage"] == 3
    assert s["method"] == METHODS[name].get("kind", "lora")
    assert s["loss"]["last"] < s["loss"]["first"], s["loss"]
    adapter = Path(s["adapter_dir"])
    weights = load_file(adapter / "adapter_model.safetensors")
    assert weights and all(t.numel() > 0 for t in weights.values())  # whole, not empty ZeRO-3 shells
    config = json.loads((adapter / "adapter_config.json").read_text())
    if name == "ia3":
        assert config["peft_type"] == "IA3" and all(k.endswith(".ia3_l") for k in weights)
    elif name == "pissa":
        # Converted to plain LoRA on the original base: rank 2r, same scaling, plain init.
        assert (config["r"], config["lora_alpha"], config["init_lora_weights"]) == (8, 16, True)
        assert all(t.shape[0] == 8 for k, t in weights.items() if k.endswith("lora_A.weight"))
        assert (family == "llama") == any(k.endswith("embed_tokens.weight") for k in weights)
    else:
        assert config["use_dora"] and config["use_rslora"]
        assert any(k.endswith("lora_magnitude_vector") for k in weights)

    base = _base(s)
    splits, _ = load_cached(Path(s["data"]["cache_dir"]))
    base_loss = _eval_loss(base, family, splits["eval"])
    model = PeftModel.from_pretrained(base, adapter).eval()
    loss = _eval_loss(model, family, splits["eval"])
    assert loss == pytest.approx(s["eval"]["loss"], rel=1e-4)
    assert abs(base_loss - loss) > 1e-3  # the adapter changes the model

    # The planner counts what peft created (DoRA magnitudes, IA3 vectors, modules_to_save copies).
    plan = lorakit.plan(lorakit.load_recipe(str(run_dir / rundir.RECIPE)), gpus=1, gpu_memory="40GB")
    assert plan.trainable_params == s["trainable_params"]


@pytest.mark.slow
@pytest.mark.parametrize("family, name", RUNS)
def test_merge_verifies_each_method(method_runs, family, name, tmp_path):
    result = lorakit.merge(method_runs[family, name], tmp_path / "merged", dtype="float32")
    check = result.checks[0]
    assert all(c.passed for c in result.checks) and check.max_logit_diff < 1e-4
    assert check.effect_visible, check


@pytest.mark.slow
@pytest.mark.parametrize("family", ["t5", "llama"])
def test_loraplus_gives_b_its_own_learning_rate(method_runs, family):
    s = rundir.read_summary(method_runs[family, "dora-rslora-loraplus"])
    groups = s["optimizer_groups"]  # read back from engine.optimizer.param_groups (ZeRO-3's optimizer)
    assert [g["peak_lr"] for g in groups] == pytest.approx([LR, LR * RATIO])
    # The schedule scales every group, B's too: linear decay reaches 0 after the last step.
    assert [g["last_lr"] for g in groups] == [0.0, 0.0]
    assert s["method_options"] == ["dora", "rslora", f"lora+ x{RATIO}"]


@pytest.mark.slow
def test_a_pissa_run_resumed_in_a_fresh_process_with_dropout_on_repeats_the_run(cache_dir, tmp_path):
    """Checkpoints hold A and B but not the base PiSSA rewrote: the run resumed from its step-2 checkpoint in a
    fresh process (`python -m lorakit.run` on its recipe.yaml) rebuilds W_res and the initial adapter from the
    base (the init is a pure function of it) and restores the RNG (LoRA dropout on: the masks of step 3 are
    the uninterrupted run's), so step 3's loss and the saved adapter are exactly the uninterrupted run's."""
    sections = dict(
        method={"init": "pissa", "r": 4, "alpha": 8, "dropout": 0.1},
        train={"max_steps": 3, "lr": LR},
        distributed={"zero_stage": 3},
        eval={"enabled": False},
        checkpoint={"every": 2, "keep": 2},
    )
    whole = lorakit.train(tiny_recipe(cache_dir, tmp_path / "whole", **sections)).run_dir
    step2 = next(c.path for c in complete_checkpoints(whole) if c.step == 2)
    resumed = tmp_path / "resumed"
    proc = run_cli("lorakit.run", whole / rundir.RECIPE, f"output.dir={resumed}", f"train.resume={step2}")
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert rundir.read_summary(resumed)["resumed_from"]["step"] == 2
    assert _losses(resumed) == [r for r in _losses(whole) if r[0] == 3]
    a, b = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (whole, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _losses(run_dir):
    return [
        (r["step"], r["loss"], r["grad_norm"]) for r in rundir.read_metrics(run_dir) if r["kind"] == "train"
    ]


@pytest.mark.slow
def test_hpz_trains_as_plain_zero3(method_runs):
    hpz, plain = method_runs["hpz"], method_runs["plain"]
    zero = json.loads((hpz / rundir.DS_CONFIG).read_text())["zero_optimization"]
    assert zero["stage"] == 3 and zero["zero_hpz_partition_size"] == 2
    assert (
        "zero_hpz_partition_size"
        not in json.loads((plain / rundir.DS_CONFIG).read_text())["zero_optimization"]
    )
    ours, theirs = _losses(hpz), _losses(plain)
    assert [s for s, *_ in ours] == [1, 2, 3, 4]
    assert ours[-1][1] < ours[0][1]
    # hpZ changes where the weights are gathered from, not the arithmetic.
    for a, b in zip(ours, theirs, strict=True):
        assert a == pytest.approx(b, abs=1e-6)
    adapter, expected = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (hpz, plain))
    assert adapter.keys() == expected.keys() and adapter
    assert max(float((adapter[k] - expected[k]).abs().max()) for k in adapter) <= 1e-6
    assert rundir.read_summary(hpz)["world_size"] == 2
