"""QLoRA on an MoE end to end: the shipped causal quickstart recipe with only the model changed (tiny Mixtral,
Qwen3-MoE and OLMoE, method.kind qlora, so the attention layers and the fused experts are 4-bit), 2 processes
under its ZeRO-3, the recipe's dropout 0.05; then merged into the unquantized base, verified, and compared with
the adapter on the 4-bit base.

The launches are forked from a fork server of this module's whose processes have bitsandbytes' AVX512-BF16
answer forced (forced_bnb.py): as a fresh interpreter with the same environment would, without paying each
process's imports (3 processes and the launcher, per family)."""

import json
import math

import pytest
import torch
import yaml

from tests.conftest import RECIPES
from tests.integration.forced_bnb import forced_server, launch

STEPS = 4


def _expert_stacks(kind: str) -> tuple[int, int]:
    """(fused expert stacks, expert adapters) of the tiny model `kind`, read from the model itself (built on
    the meta device): the gradient line must count exactly these."""
    from transformers import AutoModelForCausalLM

    from lorakit.model.families.moe import EXPERT_PARAMETERS
    from lorakit.model.families.tiny import tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(kind))
    stacks = [p.shape[0] for n, p in model.named_parameters() if n.endswith(EXPERT_PARAMETERS)]
    return len(stacks), sum(stacks)


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    """Every launched process told its CPU has AVX512-BF16, whatever this one has."""
    with forced_server(tmp_path_factory.mktemp("forced-bnb"), "1") as server:
        yield server


@pytest.mark.slow
@pytest.mark.parametrize("kind", ("mixtral", "qwen3_moe", "olmoe"))
def test_the_causal_quickstart_as_qlora_on_each_tiny_moe_trains_on_two_ranks_and_merges_verified(
    kind, cache_dir, tmp_path, forced
):
    import lorakit

    raw = yaml.safe_load((RECIPES / "quickstart_causal.yaml").read_text())
    raw["model"]["name_or_path"] = f"tiny:{kind}"
    raw["method"]["kind"] = "qlora"
    # Small: a few steps, an evaluation between them (where bitsandbytes' AVX512-BF16 CPU branch would switch
    # its 4-bit linear layers' layout; forced on below), no generation.
    raw["data"].update({"cache_dir": str(cache_dir), "max_samples": 64, "max_eval_samples": 8})
    raw["train"].update({"max_steps": STEPS, "epochs": 1})
    raw["eval"] = {"generate": False, "every": STEPS // 2}
    raw["output"]["dir"] = str(tmp_path / "run")
    assert raw["method"]["dropout"] == 0.05 and raw["distributed"] == {"num_processes": 2, "zero_stage": 3}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))

    proc = launch(forced, path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("none on the fused experts") == 1
    stacks, adapters = _expert_stacks(kind)
    assert stacks > 0
    line = f"of {adapters:,} expert adapters ({stacks} fused stacks) received gradients in the first step"
    assert line in proc.stdout, proc.stdout[-3000:]
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    q = summary["quantization"]
    assert 0 < q["quantized_expert_params"] < q["quantized_params"]
    losses = [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if r.get("kind") == "train"]  # fmt: skip
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert sum(losses[-2:]) < sum(losses[:2])

    result = lorakit.merge(run_dir, tmp_path / "merged", compare_quantized=True)
    assert result.strategy == "memory" and all(c.passed for c in result.checks), result
    assert result.checks[0].effect_visible


@pytest.mark.slow
def test_a_qlora_moe_run_resumed_from_its_checkpoint_ends_with_the_uninterrupted_runs_adapter(
    cache_dir, tmp_path
):
    """One process, ZeRO-2 (the 4-bit base and its expert stacks reloaded from the model source, the adapter and
    optimizer from the checkpoint), dropout 0.05 drawing the same masks after the resume, which runs in a fresh
    process (`python -m lorakit.run` on the run's recipe.yaml: nothing of this process's state carries over)."""
    from safetensors.torch import load_file

    import lorakit
    from lorakit import rundir
    from tests.conftest import run_cli, tiny_recipe

    def recipe(out):
        return tiny_recipe(
            cache_dir, out, model={"name_or_path": "tiny:mixtral", "dtype": "bfloat16"},
            data={"format": "instruction", "max_length": "auto", "max_samples": 32, "max_eval_samples": 4},
            method={"kind": "qlora", "dropout": 0.05, "r": 4, "alpha": 8},
            train={"max_steps": 4, "lr": 1e-2}, eval={"generate": False}, checkpoint={"every": 2},
            distributed={"num_processes": 1, "zero_stage": 2},
        )  # fmt: skip

    full = lorakit.train(recipe(tmp_path / "full")).run_dir
    resumed = tmp_path / "resumed"
    step2 = full / "checkpoints" / "step-00000002"
    proc = run_cli("lorakit.run", full / rundir.RECIPE, f"output.dir={resumed}", f"train.resume={step2}")
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert rundir.read_summary(resumed)["resumed_from"]["step"] == 2
    a = load_file(str(full / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(resumed / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any(".experts.base_layer.lora_B" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(a[k].abs().sum() > 0 for k in a if ".experts.lora_B" in k)  # the experts trained
