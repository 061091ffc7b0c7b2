"""distributed.strategy fsdp in the recipe schema: its section, and what it refuses, naming the alternative."""

from pathlib import Path

import pytest

from lorakit.errors import RecipeError
from lorakit.recipe import load_recipe

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"


def test_defaults_and_an_fsdp_recipe():
    base = load_recipe(QUICKSTART, [])
    assert base.distributed.strategy == "deepspeed"
    fsdp = load_recipe(
        QUICKSTART,
        [
            "distributed.strategy=fsdp",
            "distributed.zero_stage=3",
            "distributed.num_processes=4",
            "distributed.fsdp.sharding=hybrid",
            "distributed.fsdp.shard_size=2",
            "distributed.fsdp.cpu_offload=true",
        ],
    )
    assert (fsdp.distributed.fsdp.sharding, fsdp.distributed.fsdp.shard_size) == ("hybrid", 2)
    assert fsdp.distributed.fsdp.cpu_offload


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["distributed.fsdp.sharding=hybrid"],
            r"distributed\.fsdp is read only with distributed\.strategy: fsdp",
        ),
        (["distributed.zero_stage=2"], r"zero_stage 2 is a DeepSpeed setting.*strategy deepspeed"),
        (["distributed.offload_optimizer=cpu"], r"distributed\.offload_optimizer.*fsdp\.cpu_offload: true"),
        (["distributed.offload_params=cpu"], r"distributed\.offload_params.*fsdp\.cpu_offload: true"),
        (["distributed.hpz_partition_size=2"], r"hpz_partition_size.*fsdp\.sharding: hybrid"),
        (["distributed.quantized_weights=true"], r"quantized_weights.*strategy deepspeed"),
        (["distributed.fsdp.shard_size=2"], r"shard_size applies to sharding: hybrid"),
        (
            [
                "distributed.num_processes=4",
                "distributed.fsdp.sharding=hybrid",
                "distributed.fsdp.shard_size=3",
            ],
            r"shard_size 3 must divide the processes per node",
        ),
        (["method.kind=qlora"], r"qlora is not supported on strategy fsdp.*strategy deepspeed"),
    ],
)
def test_what_fsdp_cannot_do_is_refused_with_the_alternative(overrides, message):
    # The ZeRO-only overrides alone are valid for the default stage 3 except where the override says.
    if overrides[0].startswith("distributed.fsdp"):
        strategy = [] if overrides == ["distributed.fsdp.sharding=hybrid"] else ["distributed.strategy=fsdp"]
    else:
        strategy = ["distributed.strategy=fsdp"]
    with pytest.raises(RecipeError, match=message) as err:
        load_recipe(QUICKSTART, ["distributed.zero_stage=3", *strategy, *overrides])
    assert err.value.exit_code == 2


def test_doctor_line_names_the_mesh_and_skips_deepspeed_recipes():
    from lorakit.doctor.backend import fsdp_backend

    assert fsdp_backend(load_recipe(QUICKSTART, [])).status == "skip"
    hybrid = load_recipe(
        QUICKSTART,
        [
            "distributed.strategy=fsdp",
            "distributed.num_processes=4",
            "distributed.fsdp.sharding=hybrid",
            "distributed.fsdp.shard_size=2",
        ],
    )
    check = fsdp_backend(hybrid)
    assert check.passed and "shard groups of 2, replicated 2x" in check.detail
    assert (
        "full sharding over 2" in fsdp_backend(load_recipe(QUICKSTART, ["distributed.strategy=fsdp"])).detail
    )


def test_plan_shards_states_over_the_mesh_and_recommends_only_fsdp_keys():
    from lorakit.planner import plan

    xxl = Path(__file__).resolve().parents[2] / "recipes" / "flan_t5_xxl_lora.yaml"
    fsdp = ["distributed.strategy=fsdp", "distributed.zero_stage=3", "method.kind=full"]

    def states(*overrides, **kw):
        p = plan(load_recipe(xxl, [*fsdp, *overrides]), gpus=8, nodes=2, **kw)
        return p, {i.name: i for i in p.estimate.items}

    full, f = states()
    hybrid, h = states("distributed.fsdp.sharding=hybrid", "distributed.num_processes=8")
    # Full sharding over all 16 GPUs; hybrid over the 8 of a node (replicated across the 2 nodes).
    assert h["Adam states (fp32)"].bytes == 2 * f["Adam states (fp32)"].bytes
    # Each process loads the whole model before sharding it: no zero.Init.
    assert "whole model in each process's CPU RAM while loading" in f
    offload, o = states("distributed.fsdp.cpu_offload=true")
    assert o["Adam states (fp32)"].where == "cpu" and o["trainable weights"].where == "cpu"
    tight = plan(load_recipe(xxl, fsdp), gpus=8, nodes=2, gpu_memory="40GB", cpu_memory="2000GB")
    assert not any(
        k.startswith(("distributed.zero_stage", "distributed.offload")) for k in tight.recommended_overrides
    )


def test_packed_t5_with_explicit_masks_is_refused_on_fsdp():
    from types import SimpleNamespace

    from lorakit.backends.fsdp_shard import check_built
    from lorakit.model.varlen import VARLEN_SDPA

    def built(attention, packing=True, enc_dec=True):
        return SimpleNamespace(is_encoder_decoder=enc_dec, packing=packing, attention=attention)

    with pytest.raises(
        RecipeError, match=r"attention eager run the encoder outside.*model\.attention sdpa"
    ) as err:
        check_built(built("eager"))
    assert err.value.exit_code == 2
    # Per-example SDPA (the default for packed T5), unpacked rows and causal models train.
    for ok in (built(VARLEN_SDPA), built("eager", packing=False), built("eager", enc_dec=False)):
        check_built(ok)
