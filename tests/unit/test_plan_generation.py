"""lorakit.plan counts how generation uses sharded weights (distributed.gather_for_generation,
lorakit.planner.generation): gathered whole once per generate call (the whole model beside the resident
states) or layer by layer (the forward's gathered weights), on ZeRO-3 and FSDP2 alike, and says which."""

from __future__ import annotations

import json

import pytest

from lorakit.backends.base import GATHER_SHARE
from lorakit.planner import plan
from lorakit.planner.core import CUDA_CONTEXT_BYTES
from lorakit.recipe import load_recipe
from tests.conftest import RECIPES

XL = RECIPES / "flan_t5_xl_lora.yaml"  # ZeRO-3 on 8 GPUs, eval.generate on


def _gpu(p, when: str) -> int:
    return sum(i.bytes for i in p.estimate.items if i.where == "gpu" and i.when == when)


def _plan(*overrides: str, path=XL, **kw):
    return plan(load_recipe(path, list(overrides)), **kw)


def test_gathering_adds_the_whole_model_to_the_eval_generation_peak():
    on = _plan("distributed.gather_for_generation=true", gpu_memory="80GB")
    off = _plan("distributed.gather_for_generation=false", gpu_memory="80GB")
    none = _plan("eval.generate=false", gpu_memory="80GB")
    g = on.estimate.generation
    # Every weight whole in bf16 (LoRA: the base and the adapter), once per generate call.
    assert g.mode == "gathered" and g.whole_bytes == 2 * on.total_params
    assert _gpu(on, "generate") == g.whole_bytes and _gpu(off, "generate") == 0
    # While generating: the resident states and the whole model in place of the forward's gathered layers.
    resident, forward = _gpu(on, "resident"), _gpu(on, "forward")
    assert g.peak_bytes == resident + g.whole_bytes
    assert g.peak_bytes - off.estimate.generation.peak_bytes == g.whole_bytes - forward
    # Here it is the run's peak; layer by layer the peak is training's, as without eval predictions.
    assert on.estimate.gpu_allocated == g.peak_bytes > off.estimate.gpu_allocated
    assert off.estimate.gpu_allocated == none.estimate.gpu_allocated and none.estimate.generation is None
    assert off.estimate.generation.mode == "layer_by_layer"


def test_auto_gathers_what_fits_in_half_the_free_memory_as_the_runtime_does():
    # A 3B model on 80GB GPUs: gathering adds its 5.4 GiB, far under half of what is free.
    small = _plan(gpu_memory="80GB").estimate.generation
    assert small.setting == "auto" and small.mode == "gathered"
    # An 11B model on 40GB GPUs: gathered whole (20.9 GiB, a new buffer beside each rank's share) it exceeds
    # half of the ~33 GiB free.
    big = _plan(path=RECIPES / "flan_t5_xxl_lora.yaml", gpu_memory="40GB", target_len=128)
    g = big.estimate.generation
    assert g.mode == "layer_by_layer" and g.adds_bytes > GATHER_SHARE * g.free_bytes
    assert g.adds_bytes == g.whole_bytes
    assert not any(i.when == "generate" for i in big.estimate.items)
    # Free is the capacity less the CUDA context and the resident states; the rule's edge is exact.
    p = _plan(gpu_memory="80GB")
    e = p.estimate
    assert e.generation.free_bytes == 80 * 10**9 - CUDA_CONTEXT_BYTES - _gpu(p, "resident")
    need = CUDA_CONTEXT_BYTES + _gpu(p, "resident") + int(e.generation.adds_bytes / GATHER_SHARE)
    assert _plan(gpu_memory=need + 1).estimate.generation.mode == "gathered"
    assert _plan(gpu_memory=need - 2).estimate.generation.mode == "layer_by_layer"


def test_without_a_capacity_auto_is_counted_as_gathering_and_the_plan_says_so():
    p = _plan()
    g = p.estimate.generation
    assert g.free_bytes is None and g.mode == "gathered" and p.estimate.gpu_allocated >= g.peak_bytes
    note = next(n for n in p.assumptions if n.startswith("generation (eval predictions)"))
    assert "gathers the whole model" in note and "conservative" in note and "--gpu-memory" in note


def test_the_plan_says_which_way_generation_goes_in_its_notes_json_and_table():
    on = _plan(gpu_memory="80GB")
    d = json.loads(json.dumps(on.to_dict()))["recipe"]["generation"]
    assert d["mode"] == "gathered" and d["gathered_bytes"] == d["whole_bytes"] > 0
    assert d["moments"] == ["eval predictions"] and d["peak_bytes"] == on.estimate.generation.peak_bytes
    assert "whole model gathered for generation" in on.describe() and "while generating" in on.describe()
    off = _plan("distributed.gather_for_generation=false", gpu_memory="80GB")
    assert off.to_dict()["recipe"]["generation"]["mode"] == "layer_by_layer"
    assert any("goes layer by layer" in n for n in off.assumptions)
    # ZeRO-2: the weights are whole on every rank, nothing to gather and nothing to say.
    z2 = _plan("distributed.zero_stage=2", gpu_memory="80GB")
    assert z2.to_dict()["recipe"]["generation"]["mode"] == "whole"
    assert not any(n.startswith("generation (") for n in z2.assumptions)


@pytest.mark.parametrize("setting", [True, False])
def test_fsdp2_generates_as_zero3_does(setting):
    """Both sharded backends gather the same whole model under the same rule (FSDP2 gathers its fp32
    trainable shards in model.dtype, as ZeRO-3's bf16 weights)."""
    fsdp = ["distributed.strategy=fsdp", f"distributed.gather_for_generation={str(setting).lower()}"]
    f = _plan(*fsdp, gpu_memory="80GB").estimate.generation
    z = _plan(fsdp[1], gpu_memory="80GB").estimate.generation
    assert f.mode == z.mode == ("gathered" if setting else "layer_by_layer")
    assert f.whole_bytes == z.whole_bytes and f.sharded_over == z.sharded_over == 8


def test_when_nothing_fits_gathered_the_recommendation_generates_layer_by_layer():
    """FLAN-T5-XXL LoRA on one 24GB GPU fits only with the parameters offloaded; gathering the whole model
    (22 GB) onto the GPU for eval predictions does not fit beside them. auto sees it (the whole model is
    what gathering adds, even on one rank: the offloaded share stays on the CPU) and goes layer by layer;
    with gather_for_generation true the recommendation adds distributed.gather_for_generation=false, and its
    overrides reproduce it."""
    xxl = RECIPES / "flan_t5_xxl_lora.yaml"
    auto = _plan(path=xxl, gpus=1, gpu_memory="24GB").recommendation
    assert auto.fits and auto.setup.offload_params == "cpu" and auto.generation.mode == "layer_by_layer"
    p = _plan("distributed.gather_for_generation=true", path=xxl, gpus=1, gpu_memory="24GB")
    rec = p.recommendation
    assert not p.fits and rec is not None and rec.fits and rec.setup.offload_params == "cpu"
    assert p.recommended_overrides[-1] == "distributed.gather_for_generation=false"
    assert rec.generation.mode == "layer_by_layer"
    again = _plan("distributed.gather_for_generation=true", *p.recommended_overrides, path=xxl, gpus=1,
                  gpu_memory="24GB")  # fmt: skip
    assert again.fits and again.per_gpu_bytes == rec.per_gpu_bytes
    # Where a setup fits with the model gathered, generation keeps gathering.
    fits = _plan(gpu_memory="24GB")
    assert fits.recommendation is not None
    assert "distributed.gather_for_generation=false" not in fits.recommended_overrides


@pytest.mark.parametrize("slack", [0, -2])
def test_the_plan_decides_as_the_runtime_rule_does(monkeypatch, slack):
    """lorakit.backends.base.gathers_for_generation (one process: no other rank to agree with) and the
    planner take the same branch for the same bytes gathering adds and the same memory free."""
    import psutil
    import torch

    from lorakit.backends.base import gathers_for_generation
    from lorakit.planner.arch import arch_from_config, known_config
    from lorakit.planner.generation import planned_generation

    recipe = load_recipe(XL)
    setup = _plan(gpu_memory="80GB").estimate.setup
    arch = arch_from_config(known_config("google/flan-t5-xl"))
    adds = planned_generation(recipe, arch, 2, setup, 8, None).adds_bytes
    free = int(adds / GATHER_SHARE) + slack
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"available": free})())
    runtime = gathers_for_generation("auto", adds, torch.device("cpu"))
    assert planned_generation(recipe, arch, 2, setup, 8, free).gathers == runtime == (slack == 0)
