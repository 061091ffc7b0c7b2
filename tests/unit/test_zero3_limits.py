"""ZeRO-3's buckets and live-parameter limits sized from the model, the planner's gathered-weights term that
follows them, and the planned memory of each phase of a CPU run (benchmarks/rehearsal.py)."""

from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from lorakit.backends.deepspeed_config import build_ds_config, zero3_limits
from lorakit.planner import plan
from lorakit.planner.arch import arch_from_config, known_config
from lorakit.planner.core import CPU_RUN_PROCESS_BYTES
from lorakit.planner.phases import MERGE_PROCESS_BYTES, cpu_phases
from lorakit.planner.states import zero3_gathered
from lorakit.recipe import load_recipe
from tests.conftest import RECIPES

XL = ["data.max_source_length=128", "data.max_target_length=32", "distributed.num_processes=2"]


def test_limits_scale_with_the_hidden_size_and_deepspeed_reads_them():
    h = 2048
    limits = zero3_limits(h)
    assert limits["reduce_bucket_size"] == h * h
    assert limits["stage3_prefetch_bucket_size"] == int(0.9 * h * h)
    assert limits["stage3_param_persistence_threshold"] == 10 * h
    # About one block: far below DeepSpeed's 1e9 at XL (50M) and 8B (201M) width, so the forward's
    # parameters are released before the backward.
    assert limits["stage3_max_reuse_distance"] == limits["stage3_max_live_parameters"] == 12 * h * h
    assert zero3_limits(4096)["stage3_max_reuse_distance"] == 4 * limits["stage3_max_reuse_distance"] < 1e9
    parsed = DeepSpeedZeroConfig(stage=3, **limits)
    assert (parsed.max_reuse_distance, parsed.max_live_parameters) == (12 * h * h, 12 * h * h)
    assert parsed.prefetch_bucket_size == int(0.9 * h * h)


def test_the_config_carries_the_limits_on_zero3_only():
    recipe = load_recipe(RECIPES / "flan_t5_xl_lora.yaml", XL)
    zero = build_ds_config(recipe, 2, accelerator="cpu", hidden_size=2048)["zero_optimization"]
    assert {k: zero[k] for k in zero3_limits(2048)} == zero3_limits(2048)
    # Without a hidden size DeepSpeed's defaults stay (nothing written).
    bare = build_ds_config(recipe, 2, accelerator="cpu")["zero_optimization"]
    assert not set(zero3_limits(2048)) & set(bare)
    zero2 = load_recipe(RECIPES / "flan_t5_xl_lora.yaml", [*XL, "distributed.zero_stage=2"])
    z2 = build_ds_config(zero2, 2, accelerator="cpu", hidden_size=2048)["zero_optimization"]
    assert "stage3_max_reuse_distance" not in z2 and z2["reduce_bucket_size"] == 2048 * 2048


def test_gathered_weights_follow_the_reuse_window_and_never_exceed_the_model():
    # DeepSpeed's defaults keep a model under a billion parameters whole.
    assert zero3_gathered(66_000_000, 361_000_000, {}) == 361_000_000
    assert zero3_gathered(66_000_000, 2_850_000_000, {}) == 66_000_000 + 50_000_000 + 1_000_000_000
    sized = zero3_limits(2048)
    expected = 66_000_000 + int(0.9 * 2048**2) + 12 * 2048**2
    assert zero3_gathered(66_000_000, 2_850_000_000, sized) == expected
    assert zero3_gathered(66_000_000, 100_000_000, sized) == 100_000_000
    # The prefetch never runs past the live-parameter limit.
    assert zero3_gathered(10, 10**9, {"stage3_prefetch_bucket_size": 500, "stage3_max_live_parameters": 100,
                                      "stage3_max_reuse_distance": 0}) == 110  # fmt: skip


def test_the_plan_counts_the_gathered_layer_prefetch_and_reuse_window():
    recipe = load_recipe(RECIPES / "flan_t5_xl_lora.yaml", XL)
    arch = arch_from_config(known_config("google/flan-t5-xl"))
    e = plan(recipe, device="cpu").estimate
    gathered = next(i for i in e.items if i.name == "ZeRO-3 gathered weights")
    assert gathered.bytes == 2 * (arch.largest_module_params + int(0.9 * 2048**2) + 12 * 2048**2)


def test_cpu_phases_of_a_lora_run():
    recipe = load_recipe(RECIPES / "flan_t5_xl_lora.yaml", XL)
    phases = cpu_phases(recipe)
    p = plan(recipe, device="cpu")
    e = p.estimate
    # A step: the runtime and the training peak (no CPU-side states without offload), not what loading held.
    assert phases["first_step"] == phases["steady"] == CPU_RUN_PROCESS_BYTES + e.gpu_allocated
    assert phases["steady"] <= p.per_node_cpu_bytes // 2
    resident = sum(i.bytes for i in e.items if i.when == "resident")
    loading = sum(i.bytes for i in e.items if i.when == "load")
    assert phases["load"] == CPU_RUN_PROCESS_BYTES + resident + loading
    assert phases["save"] == CPU_RUN_PROCESS_BYTES + resident + 2 * p.trainable_params
    # The largest adapted matrix is the MLP's 2048 x 5120, read in bf16 and held twice in fp32.
    assert phases["merge"] == MERGE_PROCESS_BYTES + 2048 * 5120 * (2 + 8) + 4 * p.trainable_params
    assert phases["load"] < phases["steady"] and phases["merge"] < phases["steady"]


def test_full_fine_tuning_has_no_merge_phase():
    recipe = load_recipe(RECIPES / "flan_t5_xl_lora.yaml", [*XL, "method.kind=full"])
    assert "merge" not in cpu_phases(recipe)
