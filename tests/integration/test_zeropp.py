"""ZeRO++ on 2 CPU processes (DeepSpeed's CPU accelerator, gloo): quantized communication (qwZ, qgZ), which
needs DeepSpeed's CUDA quantizer kernels, is refused before any work. Hierarchical partitioning (hpZ)
training exactly as plain ZeRO-3 does is test_methods.py's test_hpz_trains_as_plain_zero3 (its runs join
that file's 2-process launch). See docs/multinode.md#zero.
"""

import pytest

import lorakit
from lorakit import rundir
from lorakit.errors import RecipeError
from lorakit.recipe import recipe_from_dict
from tests.conftest import tiny_recipe_dict

pytestmark = pytest.mark.slow


def zeropp_recipe(cache_dir, out, **distributed) -> dict:
    """4 steps of LoRA on the tiny T5, ZeRO-3 on 2 processes, `distributed` added (test_methods.py's hpZ
    runs too)."""
    return tiny_recipe_dict(
        cache_dir,
        out,
        train={"max_steps": 4, "lr": 2e-2},
        distributed={"num_processes": 2, "zero_stage": 3, **distributed},
        eval={"enabled": False},
    )


@pytest.mark.parametrize("key", ["quantized_weights", "quantized_gradients"])
def test_quantized_communication_is_refused_on_cpu_before_any_work(cache_dir, tmp_path, key):
    # Left to DeepSpeed: "This op had not been implemented on CPU backend" from every rank, while loading
    # the model (qwZ) or at the first backward (qgZ).
    out = tmp_path / "run"
    with pytest.raises(RecipeError, match=rf"distributed.{key} .* needs GPUs"):
        lorakit.train(recipe_from_dict(zeropp_recipe(cache_dir, out, **{key: True})))
    assert not (out / rundir.DS_CONFIG).exists()
