"""ZeRO++ on 2 CPU processes (DeepSpeed's CPU accelerator, gloo): hierarchical partitioning (hpZ) trains
exactly as plain ZeRO-3 does, and quantized communication (qwZ, qgZ), which needs DeepSpeed's CUDA quantizer
kernels, is refused before any work. See docs/multinode.md#zero.

hpz_partition_size 2 on 2 processes makes one secondary group of the whole world: the degenerate case, but
DeepSpeed builds and all-gathers the secondary partition all the same. The tiny T5 has a separate output
head, which lorakit restores under a second zero.Init (model/untie.py): without passing that init the hpZ
group the first one made, DeepSpeed fails (issues #4901, #7066), so this test also guards that workaround.
The plain run and then the hpZ run train in one 2-process launch (qlora_worker.py trains recipes in order).
"""

import json

import pytest
from safetensors.torch import load_file

import lorakit
from lorakit import rundir
from lorakit.errors import RecipeError
from lorakit.recipe import recipe_from_dict
from tests.conftest import ROOT, tiny_recipe_dict
from tests.integration.qlora_worker import train_in_one_launch

pytestmark = pytest.mark.slow


def _recipe(cache_dir, out, **distributed) -> dict:
    return tiny_recipe_dict(
        cache_dir,
        out,
        train={"max_steps": 4, "lr": 2e-2},
        distributed={"num_processes": 2, "zero_stage": 3, **distributed},
        eval={"enabled": False},
    )


def _losses(run_dir):
    return [
        (r["step"], r["loss"], r["grad_norm"]) for r in rundir.read_metrics(run_dir) if r["kind"] == "train"
    ]


def test_hpz_trains_as_plain_zero3(cache_dir, tmp_path):
    hpz, plain = tmp_path / "hpz", tmp_path / "plain"
    train_in_one_launch(
        {
            tmp_path / "plain.yaml": _recipe(cache_dir, plain),
            tmp_path / "hpz.yaml": _recipe(cache_dir, hpz, hpz_partition_size=2),
        },
        {"PYTHONPATH": str(ROOT)},
    )
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


@pytest.mark.parametrize("key", ["quantized_weights", "quantized_gradients"])
def test_quantized_communication_is_refused_on_cpu_before_any_work(cache_dir, tmp_path, key):
    # Left to DeepSpeed: "This op had not been implemented on CPU backend" from every rank, while loading
    # the model (qwZ) or at the first backward (qgZ).
    out = tmp_path / "run"
    with pytest.raises(RecipeError, match=rf"distributed.{key} .* needs GPUs"):
        lorakit.train(recipe_from_dict(_recipe(cache_dir, out, **{key: True})))
    assert not (out / rundir.DS_CONFIG).exists()
