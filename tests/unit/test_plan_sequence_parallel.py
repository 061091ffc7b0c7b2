"""The planner under sequence parallelism: activations per rank scale with 1/N, and the longest row the
recipe trains rises with N."""

from __future__ import annotations

import pytest

from lorakit.planner import plan
from lorakit.planner.search import longest_row
from lorakit.recipe import recipe_from_dict
from lorakit.testing import tiny_config
from tests.conftest import tiny_recipe_dict

# The tiny Llama with 8 query and key/value heads, so that N up to 8 divides them.
CONFIG = tiny_config("llama")
CONFIG.num_attention_heads = CONFIG.num_key_value_heads = 8


def _recipe(tmp_path, sp: int, tiled_mlp="auto"):
    raw = tiny_recipe_dict(
        tmp_path,
        tmp_path / "run",
        model={
            "name_or_path": "tiny:llama",
            "dtype": "bfloat16",
            "gradient_checkpointing": True,
            "tiled_mlp": tiled_mlp,
            # The whole row's logits scale with 1/N too; the tiled loss (auto-on with N > 1) is one tile's.
            "tiled_loss": False,
        },
        data={"format": "instruction", "max_length": 512},
        train={"max_tokens": 8192},
        distributed={"num_processes": 8, "zero_stage": 3, "sequence_parallel": sp},
    )
    return recipe_from_dict(raw)


def test_activations_per_rank_scale_with_one_over_n(tmp_path):
    def peak(sp: int) -> int:
        return plan(_recipe(tmp_path, sp, tiled_mlp=False), config=CONFIG).estimate.activations.peak

    peaks = {sp: peak(sp) for sp in (1, 2, 8)}
    assert peaks[2] == pytest.approx(peaks[1] / 2, rel=1e-6)
    assert peaks[8] == pytest.approx(peaks[1] / 8, rel=1e-6)


def test_a_tiled_mlp_lowers_the_activation_estimate(tmp_path):
    """model.tiled_mlp (auto-on with sequence parallelism): the recomputed layer keeps one tile's MLP
    activations instead of the whole shard's, so the peak falls and the longest row rises."""

    # A wide MLP, so that the layers (not the output head) set the peak.
    wide = tiny_config("llama")
    wide.num_attention_heads = wide.num_key_value_heads = 8
    wide.intermediate_size = 16384

    def estimate(tiled):
        return plan(_recipe(tmp_path, 2, tiled_mlp=tiled), gpu_memory="3GB", config=wide)

    auto, tiled, untiled = estimate("auto"), estimate(True), estimate(False)
    assert auto.estimate.activations == tiled.estimate.activations
    t, u = tiled.estimate.activations, untiled.estimate.activations
    assert t.kept == u.kept and t.head == u.head  # checkpointing keeps layer inputs only, tiled or not
    assert t.recompute < u.recompute / 4 and t.peak < u.peak
    assert tiled.longest_row > 2 * untiled.longest_row


def test_the_longest_row_rises_with_n(tmp_path):
    rows = {sp: plan(_recipe(tmp_path, sp), gpu_memory="3GB", config=CONFIG).longest_row for sp in (1, 2, 4)}
    assert rows[1] and rows[2] > 1.9 * rows[1] and rows[4] > 1.9 * rows[2]
    report = plan(_recipe(tmp_path, 2), gpu_memory="3GB", config=CONFIG)
    assert f"the longest row this recipe trains on these GPUs: {rows[2]:,} tokens" in report.describe()
    assert report.to_dict()["longest_row"] == rows[2] and report.to_dict()["sequence_parallel"] == 2
    # Without a memory size there is no answer.
    assert plan(_recipe(tmp_path, 2), config=CONFIG).longest_row is None


def test_the_planner_refuses_an_n_the_heads_do_not_allow(tmp_path):
    from lorakit.errors import RecipeError

    with pytest.raises(RecipeError, match="key/value heads"):
        plan(_recipe(tmp_path, 4))  # the tiny Llama's own config: 4 heads, 2 key/value heads


def test_longest_row_search():
    assert longest_row(lambda t: t <= 5000, step=1024) == 4096
    assert longest_row(lambda t: t <= 100_000, step=1024) == 97 * 1024
    assert longest_row(lambda t: False, step=1024) is None
    assert longest_row(lambda t: True, step=1024, limit=8192) == 8192
