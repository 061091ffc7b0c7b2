"""ZeRO++ (distributed.hpz_partition_size, quantized_weights, quantized_gradients): the schema's checks, the
keys in ds_config.json, the checks against the process group and accelerator, and hpZ's memory in the plan.
tests/integration/test_methods.py trains with hpZ on 2 CPU processes. See docs/multinode.md#zero."""

import pytest

from lorakit.backends.deepspeed_config import build_ds_config, check_zero_plus_plus
from lorakit.errors import RecipeError
from lorakit.planner import plan
from lorakit.recipe import load_recipe
from tests.conftest import RECIPES, tiny_recipe


def _recipe(tmp_path, **distributed):
    return tiny_recipe(tmp_path, tmp_path / "o", distributed={"zero_stage": 3, **distributed})


def test_off_by_default_and_nothing_written(tmp_path):
    r = _recipe(tmp_path)
    d = r.distributed
    assert (d.hpz_partition_size, d.quantized_weights, d.quantized_gradients) == (1, False, False)
    zero = build_ds_config(r, world_size=2, accelerator="cuda")["zero_optimization"]
    assert not {k for k in zero if k.startswith("zero_")}


def test_the_keys_go_into_the_zero_section(tmp_path):
    r = _recipe(
        tmp_path, num_processes=8, hpz_partition_size=8, quantized_weights=True, quantized_gradients=True
    )
    zero = build_ds_config(r, world_size=16, accelerator="cuda", hidden_size=64)["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["zero_hpz_partition_size"] == 8
    assert zero["zero_quantized_weights"] is True and zero["zero_quantized_gradients"] is True
    # qwZ of the frozen weights' storage is another DeepSpeed option, not asked for.
    assert "zero_quantized_nontrainable_weights" not in zero


@pytest.mark.parametrize(
    "key, value", [("hpz_partition_size", 2), ("quantized_weights", True), ("quantized_gradients", True)]
)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_only_zero_stage_3(tmp_path, key, value, stage):
    with pytest.raises(
        Exception, match=rf"distributed.{key} is a ZeRO\+\+ option of ZeRO stage 3.*zero_stage: 3"
    ):
        _recipe(tmp_path, zero_stage=stage, **{key: value})


def test_hpz_must_divide_the_processes_per_node(tmp_path):
    with pytest.raises(Exception, match=r"hpz_partition_size 3 must divide .*num_processes 4.*set it to 4"):
        _recipe(tmp_path, num_processes=4, hpz_partition_size=3)
    with pytest.raises(Exception, match=r"greater than or equal to 1"):
        _recipe(tmp_path, hpz_partition_size=0)
    assert _recipe(tmp_path, num_processes=8, hpz_partition_size=4).distributed.hpz_partition_size == 4
    # num_processes is not used under a launcher (default 1): the group is checked when the job starts.
    assert _recipe(tmp_path, hpz_partition_size=8).distributed.hpz_partition_size == 8


def test_hpz_and_parameter_offload(tmp_path):
    # Run on CPU: hpZ with offload_params cpu trains as plain ZeRO-3 does. nvme is refused: DeepSpeed
    # allocates the secondary partition on the offload device, and torch has no "nvme" device.
    assert _recipe(tmp_path, hpz_partition_size=2, offload_params="cpu").distributed.offload_params == "cpu"
    with pytest.raises(
        Exception, match=r"cannot be combined with offload_params: nvme.*offload_params to cpu"
    ):
        _recipe(tmp_path, hpz_partition_size=2, offload_params="nvme", nvme_path=str(tmp_path))


def test_the_group_is_checked_at_start(tmp_path):
    r = _recipe(tmp_path, hpz_partition_size=4)
    for world, per_node in [(8, 4), (16, 8), (4, 4), (8, None)]:
        check_zero_plus_plus(r, world, per_node, "cuda")
    # 2 nodes of 2 GPUs: groups of 4 would span both nodes, the traffic hpZ keeps off the network.
    with pytest.raises(
        RecipeError, match=r"must divide the processes per node \(2 per node, 4 in all\).*set it to 2"
    ) as e:
        check_zero_plus_plus(r, 4, 2, "cuda")
    assert e.value.doc_link() == "docs/multinode.md#zero"
    with pytest.raises(RecipeError, match=r"\(6 in all\).*set it to 6"):
        check_zero_plus_plus(r, 6, None, "cuda")
    with pytest.raises(RecipeError, match=r"\(1 per node, 1 in all\)"):
        check_zero_plus_plus(r, 1, 1, "cpu")


@pytest.mark.parametrize("key, name", [("quantized_weights", "qwZ"), ("quantized_gradients", "qgZ")])
def test_quantized_communication_needs_gpus(tmp_path, key, name):
    r = _recipe(tmp_path, num_processes=2, **{key: True})
    check_zero_plus_plus(r, 2, 2, "cuda")
    with pytest.raises(RecipeError, match=rf"distributed.{key} \(ZeRO\+\+ {name}\) needs GPUs.*{key}: false"):
        check_zero_plus_plus(r, 2, 2, "cpu")


def test_hpz_secondary_partition_in_the_plan():
    """hpZ keeps every weight a second time, split over the hpz_partition_size ranks of a node instead of all
    ranks: 2 x 11.1B / 8 bytes more per GPU for FLAN-T5 XXL in bf16 on 2 nodes of 8 GPUs."""
    base = ["data.max_target_length=128", "distributed.num_processes=8"]
    plain = plan(load_recipe(RECIPES / "flan_t5_xxl_lora.yaml", base), gpus=8, nodes=2, gpu_memory="80GB")
    hpz = plan(
        load_recipe(RECIPES / "flan_t5_xxl_lora.yaml", [*base, "distributed.hpz_partition_size=8"]),
        gpus=8,
        nodes=2,
        gpu_memory="80GB",
    )
    items = {i.name: i for i in hpz.estimate.items}
    extra = items["hpZ secondary weight partition"]
    assert extra.where == "gpu" and extra.when == "resident"
    assert extra.bytes == pytest.approx(2 * (11_135_332_352 + hpz.trainable_params) / 8, rel=1e-6)
    assert "hpZ secondary weight partition" not in {i.name for i in plain.estimate.items}
    # The resident weights raise the peak by their bytes, plus the 5% the plan adds for fragmentation.
    assert hpz.per_gpu_bytes - plain.per_gpu_bytes == pytest.approx(1.05 * extra.bytes, rel=0.001)
