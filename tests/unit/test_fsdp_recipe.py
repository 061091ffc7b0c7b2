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


def test_qlora_dora_sequence_parallel_and_dpo_validate_on_fsdp():
    fsdp = ["distributed.strategy=fsdp", "distributed.zero_stage=3"]
    for extra in (
        ["method.kind=qlora", "model.dtype=bfloat16"],
        ["method.kind=qlora", "model.dtype=bfloat16", "method.use_dora=true"],
    ):
        recipe = load_recipe(QUICKSTART, [*fsdp, *extra])
        assert recipe.distributed.strategy == "fsdp" and recipe.method.kind == "qlora"
    causal = QUICKSTART.with_name("quickstart_causal.yaml")
    sp = load_recipe(causal, [*fsdp, "distributed.sequence_parallel=2"])
    assert sp.distributed.sequence_parallel == 2
    for kind in ("lora", "qlora"):
        dpo = load_recipe(QUICKSTART.with_name("quickstart_dpo.yaml"), [*fsdp, f"method.kind={kind}"])
        assert dpo.distributed.strategy == "fsdp"
    # DoRA on a 4-bit base stays refused on ZeRO-3 (DeepSpeed never partitioned the weight DoRA reads).
    with pytest.raises(RecipeError, match="use_dora"):
        load_recipe(QUICKSTART, ["distributed.zero_stage=3", "method.kind=qlora", "method.use_dora=true"])


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
    # Full fine-tuning (as LoRA) loads sharded: each rank reads its rows, one tensor at a time.
    assert "one tensor's rows per rank while loading" in f
    assert "whole model in each process's CPU RAM while loading" not in f

    # QLoRA on FSDP2: the 4-bit base sharded over the 16 GPUs (half a byte per quantized weight), its
    # quantization constants whole on each; it loads whole (4-bit) in each process.
    def frozen(kind):
        p = plan(load_recipe(xxl, [*fsdp[:2], f"method.kind={kind}"]), gpus=8, nodes=2)
        return {i.name: i for i in p.estimate.items}

    q, lora = frozen("qlora"), frozen("lora")
    # T5 keeps its embeddings, head and `wo` in bf16: 40% of the bf16 base, split 16 ways.
    assert q["frozen base weights"].bytes < 0.45 * lora["frozen base weights"].bytes
    whole = q["whole 4-bit model on each GPU while loading"].bytes
    assert 15 * q["frozen base weights"].bytes < whole < 17 * q["frozen base weights"].bytes
    assert q["frozen base weights"].note == "4-bit linear layers" and "4-bit quantization constants" in q
    assert "whole 4-bit model on each GPU while loading" in q
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
