"""distributed.strategy fsdp end to end, one 2-process launch (FSDP2 full sharding, gloo) of several runs on
the tiny Llama (tests/integration/qlora_worker.py), bitsandbytes' AVX512-BF16 branch forced
(tests/bnb_layout.py; tests/unit/test_fsdp_qlora.py runs the other):

- QLoRA on FSDP2 against the same recipe on DeepSpeed ZeRO-3 (LoRA dropout on; LoRA's B starts at zero, so
  the first step is dropout's whatever the masks): the same first-step loss; the 4-bit weights stay packed
  after sharding, each rank holding half of them (bytes per rank in summary.json); the adapter saved whole,
  merged into the dequantized base and verified; evaluations between steps;
- the same run resumed from its step-2 checkpoint in a second launch (fresh processes: only the checkpoint
  carries the sharded optimizer state and each rank's RNG over, and dropout draws from it) ends exactly as
  the uninterrupted one; so does the ZeRO-3 run (3 steps), resumed after the evaluation that precedes its
  step-2 checkpoint (where bitsandbytes' CPU inference layout broke ZeRO-3) in the same second launch;
- QLoRA on a tiny Mixtral on FSDP2 (its fused experts 4-bit too, lorakit/model/quant_experts.py), in the
  second launch (keep-going: its failure hides no other check): losses finite and falling, the experts'
  adapters trained, the adapter saved whole and merged verified;
- DPO on FSDP2 with LoRA and with QLoRA learns the quickstart preference pairs as on ZeRO-3 (held-out
  accuracy above 90%, as tests/integration/test_dpo.py holds ZeRO-3 to).

The step-level equivalence with DeepSpeed, one process and hybrid sharding, and one gradient reduction per
accumulation window, are in test_token_weighting.py; sequence parallelism on FSDP2 in
test_sequence_parallel.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from lorakit import rundir
from tests.integration.forced_bnb import FORCED_ENV
from tests.integration.qlora_worker import finished, train_in_one_launch
from tests.integration.test_dpo import _recipe as dpo_recipe
from tests.integration.test_qlora import qlora_recipe

STEPS = 4
# The ZeRO-3 run: step 1 for the comparison with FSDP2, an evaluation and a checkpoint at 2, one step resumed.
ZERO3_STEPS = 3


def _qlora(cache_dir: Path, out: Path, strategy: str, **train) -> dict:
    raw = qlora_recipe(cache_dir, out, "llama", 3)
    raw["method"]["dropout"] = 0.1
    raw["train"].update({"max_steps": STEPS, "epochs": 1, **train})
    raw["distributed"]["strategy"] = strategy
    raw["eval"].update({"every": 2, "generate": False})
    raw["output"]["merge"] = strategy == "fsdp" and "resume" not in train
    return raw


def _moe(cache_dir: Path, out: Path) -> dict:
    raw = qlora_recipe(cache_dir, out, "mixtral", 3)
    raw["method"]["dropout"] = 0.05
    raw["train"].update({"max_steps": STEPS, "epochs": 1})
    raw["distributed"]["strategy"] = "fsdp"
    raw["eval"].update({"enabled": False, "generate": False})
    raw["checkpoint"] = {"every": STEPS}
    return raw


def _dpo(cache_dir: Path, out: Path, kind: str) -> dict:
    recipe = dpo_recipe(
        cache_dir,
        out,
        "llama",
        model={"dtype": "bfloat16"},
        method={"kind": kind},
        distributed={"num_processes": 2, "zero_stage": 3, "strategy": "fsdp"},
        train={"max_steps": 6},
        eval={"every": 6},
    )
    return recipe.model_dump(mode="json")


# Each backend's resumed QLoRA run: the run it resumes from its step-2 checkpoint, its strategy, its steps.
RESUMED = {
    "resumed": ("fsdp", "fsdp", {}),
    "zero3-resumed": ("zero3", "deepspeed", {"max_steps": ZERO3_STEPS}),
}


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("fsdp")
    names = ("fsdp", "zero3", "resumed", "zero3-resumed", "dpo-lora", "dpo-qlora", "moe")
    dirs = {name: base / name for name in names}
    recipes = {
        base / "fsdp.yaml": _qlora(cache_dir, dirs["fsdp"], "fsdp"),
        base / "zero3.yaml": _qlora(cache_dir, dirs["zero3"], "deepspeed", max_steps=ZERO3_STEPS),
        base / "dpo-lora.yaml": _dpo(cache_dir, dirs["dpo-lora"], "lora"),
        base / "dpo-qlora.yaml": _dpo(cache_dir, dirs["dpo-qlora"], "qlora"),
    }
    proc = train_in_one_launch(recipes, FORCED_ENV)
    print(proc.stdout[-2000:])
    second = {
        base / f"{resumed}.yaml": _qlora(
            cache_dir,
            dirs[resumed],
            strategy,
            resume=str(dirs[whole] / "checkpoints" / "step-00000002"),
            **train,
        )
        for resumed, (whole, strategy, train) in RESUMED.items()
    }
    second[base / "moe.yaml"] = _moe(cache_dir, dirs["moe"])
    dirs["resumed-launch"] = train_in_one_launch(second, FORCED_ENV, keep_going=True)
    return dirs


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rundir.read_metrics(run) if r["kind"] == "train"}


@pytest.mark.slow
def test_qlora_on_fsdp_keeps_4bit_shards_matches_zero3_and_merges(runs):
    fsdp, zero3 = rundir.read_summary(runs["fsdp"]), rundir.read_summary(runs["zero3"])
    assert json.loads((runs["fsdp"] / "fsdp_config.json").read_text())["mesh"] == {"shard": 2}
    assert fsdp["strategy"] == "fsdp" and fsdp["method"] == "qlora" and fsdp["steps"] == STEPS
    # The same 4-bit base, the same first step (bf16 on both backends).
    assert _losses(runs["fsdp"])[1] == pytest.approx(_losses(runs["zero3"])[1], rel=1e-3)
    assert fsdp["loss"]["last"] < fsdp["loss"]["first"]
    # Still 4-bit after sharding: the same packed bytes as ZeRO-3 counts, each rank holding about half.
    q, z = fsdp["quantization"], zero3["quantization"]
    assert q["quantized_params"] == z["quantized_params"] > 0 and q["base_bytes"] == z["base_bytes"]
    b = q["base_bytes"]
    per_rank = q["base_bytes_per_rank"]
    print(f"4-bit base: {b['after']} bytes whole, {per_rank} on rank 0 (of {b['before']} in bf16)")
    # 4 bits per quantized weight, not 16 (the embeddings and head stay bf16).
    unquantized = b["before"] - 2 * q["quantized_params"]
    assert b["after"] - b["quant_constants"] - unquantized == q["quantized_params"] // 2
    shards = b["after"] - b["quant_constants"]
    assert 0.45 * shards < per_rank - b["quant_constants"] < 0.55 * shards
    # Saved whole (lora_B 64 x 8 on every projection of that width), merged and verified, evaluated.
    adapter = load_file(str(runs["fsdp"] / "adapter" / "adapter_model.safetensors"))
    b_weights = [t for k, t in adapter.items() if "lora_B" in k]
    assert b_weights and all(t.shape[1] == 8 and t.abs().sum() > 0 for t in b_weights)
    assert fsdp["merged_dir"] and (Path(fsdp["merged_dir"]) / "config.json").is_file()
    assert "loss" in fsdp["eval"]


@pytest.mark.slow
@pytest.mark.parametrize("resumed", list(RESUMED))
def test_qlora_resumed_in_a_fresh_process_with_dropout_on_repeats_the_run(runs, resumed):
    """Each backend's QLoRA run resumed from its step-2 checkpoint (written after an evaluation) in the second
    launch repeats every later record of the uninterrupted run, training and evaluation, and its adapter."""
    whole = runs[RESUMED[resumed][0]]
    finished(runs["resumed-launch"], runs[resumed])
    assert rundir.read_summary(runs[resumed])["resumed_from"]["step"] == 2

    def later(run: Path) -> dict:
        return {(r["kind"], r["step"]): r["loss"] for r in rundir.read_metrics(run) if r["step"] > 2}

    steps = rundir.read_summary(whole)["steps"]
    assert ("train", steps) in later(whole) and ("eval", steps) in later(whole)
    assert later(runs[resumed]) == pytest.approx(later(whole), abs=1e-6)
    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (runs[resumed], whole))
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


@pytest.mark.slow
def test_qlora_on_fsdp_with_4bit_experts_trains_the_expert_adapters_and_merges_verified(runs, tmp_path):
    import lorakit

    run = runs["moe"]
    finished(runs["resumed-launch"], run)
    # The first step's count of expert adapters that received a gradient (read from FSDP2's sharded .grad).
    launch = runs["resumed-launch"].stdout
    assert launch.count("expert adapters (4 fused stacks) received gradients in the first step") == 1
    summary = rundir.read_summary(run)
    assert summary["strategy"] == "fsdp" and summary["method"] == "qlora" and summary["steps"] == STEPS
    q = summary["quantization"]
    assert 0 < q["quantized_expert_params"] < q["quantized_params"]
    losses = list(_losses(run).values())
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    # lora_B starts at zero: a non-zero expert B got gradients.
    adapter = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    experts = [t for k, t in adapter.items() if ".experts." in k and "lora_B" in k]
    assert experts and all(t.abs().sum() > 0 for t in experts)
    result = lorakit.merge(run, tmp_path / "merged", compare_quantized=True)
    assert all(c.passed for c in result.checks) and result.checks[0].effect_visible, result


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_dpo_on_fsdp_learns_the_preference_pairs(runs, kind):
    summary = rundir.read_summary(runs[f"dpo-{kind}"])
    train = [r for r in rundir.read_metrics(runs[f"dpo-{kind}"]) if r["kind"] == "train"]
    # Before the first update the policy is its reference: log 2, 50%.
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-3) and train[0]["accuracy"] == 50.0
    assert summary["strategy"] == "fsdp" and summary["eval"]["accuracy"] > 90
    assert summary["eval"]["loss"] < math.log(2)


@pytest.mark.slow
def test_fp32_checkpoint_loads_sharded_within_one_and_a_half_bf16_models(cache_dir, tmp_path):
    """A Llama of 38M parameters stored in fp32 (as FLAN-T5's checkpoints are), trained in bf16 on 2 processes:
    each rank reads only its rows of the checkpoint, so the ranks together hold about one bf16 model while
    loading (whole loading in each process would hold two), and the planner plans it so."""
    import yaml

    from lorakit.engine.launch import torchrun_command
    from lorakit.model.families.tiny import build_tiny_model
    from lorakit.planner import plan
    from lorakit.recipe import load_recipe
    from tests.conftest import ROOT, tiny_recipe_dict
    from tests.integration.test_token_weighting import _run

    source = tmp_path / "llama-fp32"
    shape = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 12}
    model = build_tiny_model("llama", source, num_attention_heads=8, num_key_value_heads=8, **shape)
    assert {p.dtype for p in model.parameters()} == {__import__("torch").float32}
    bf16 = 2 * sum(p.numel() for p in model.parameters())
    del model
    raw = tiny_recipe_dict(
        cache_dir,
        tmp_path / "run",
        model={"name_or_path": str(source), "dtype": "bfloat16", "gradient_checkpointing": True},
        data={"format": "instruction", "max_length": 64, "max_samples": 8},
        train={"max_steps": 1, "micro_batch_size": 1},  # the worker loads, it does not train
        distributed={"num_processes": 2, "zero_stage": 3, "strategy": "fsdp"},
        eval={"enabled": False},
    )
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "memory.json"
    _run(torchrun_command(2, "tests.integration.fsdp_memory_worker", [str(path), str(out)]), ROOT)
    m = json.loads(out.read_text())
    added = m["added"]
    print(
        f"bf16 model {bf16 / 2**20:.0f} MiB; private memory added while loading, per rank (MiB): "
        f"sharded {[a // 2**20 for a in added['sharded']]}, whole {[a // 2**20 for a in added['whole']]}"
    )
    # The sharded load read exactly the weights the whole load did (gathered on rank 0), same loss.
    assert m["meta_load"] and m["same_weights"] and m["weights"] > 100
    assert m["loss"]["sharded"] == m["loss"]["whole"]
    assert sum(added["sharded"]) < 1.5 * bf16
    assert all(a < 0.9 * bf16 for a in added["sharded"])  # no rank ever held the whole model
    assert sum(added["whole"]) > 1.5 * bf16  # what it replaces: one whole model per process
    items = {i.name for i in plan(load_recipe(path), gpus=2).estimate.items}
    assert "one tensor's rows per rank while loading" in items
    assert "whole model in each process's CPU RAM while loading" not in items
