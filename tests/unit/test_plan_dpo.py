"""lorakit.plan counts DPO: two sequences per pair in a micro-batch and the no-grad reference forward."""

from __future__ import annotations

import pytest

from lorakit.objectives.dpo_settings import DpoSection
from lorakit.planner import plan
from lorakit.recipe import load_recipe
from tests.conftest import RECIPES


def _as_sft(recipe):
    return recipe.model_copy(
        update={"train": recipe.train.model_copy(update={"objective": "sft"}), "dpo": DpoSection()}
    )


def _with(recipe, section: str, **values):
    return recipe.model_copy(update={section: getattr(recipe, section).model_copy(update=values)})


@pytest.mark.parametrize("packing", [False, True])
def test_causal_dpo_plans_two_sequences_per_pair(cache_dir, packing):
    quickstart = load_recipe(RECIPES / "quickstart_dpo.yaml")
    dpo = _with(quickstart, "data", packing=packing, max_length=256, cache_dir=str(cache_dir))
    sft, ours = plan(_as_sft(dpo), gpu_memory="80GB"), plan(dpo, gpu_memory="80GB")
    a, b = sft.estimate.activations, ours.estimate.activations
    # Padded: 2 x micro_batch_size rows; packed: a row of micro_batch_size x 2 x max_length by default.
    assert (
        ours.estimate.shape.rows * ours.estimate.shape.seq_len
        == 2 * sft.estimate.shape.rows * sft.estimate.shape.seq_len
    )
    assert b.logits == 2 * a.logits and b.kept > a.kept
    if not packing:
        assert b.kept == 2 * a.kept and b.peak == 2 * a.peak
    # The reference forward is counted, below the training peak (nothing of it is kept).
    assert 0 < b.no_grad_forward < b.peak
    assert ours.per_gpu_bytes > sft.per_gpu_bytes
    text = ours.describe()
    assert "the no-grad reference forward" in text and "two sequences per pair" in text
    assert "adapter turned off" in text and ours.to_dict()["objective"] == "dpo"
    assert "reference forward" not in sft.describe()


def test_flan_t5_dpo_encodes_once_and_decodes_twice_and_full_fine_tuning_is_planned():
    dpo = _with(load_recipe(RECIPES / "flan_t5_xl_dpo.yaml"), "data", packing=False)
    sft, ours = plan(_as_sft(dpo), gpu_memory="80GB"), plan(dpo, gpu_memory="80GB")
    a, b = sft.estimate.activations, ours.estimate.activations
    assert ours.estimate.shape.decoder_passes == 2 and ours.estimate.shape.rows == sft.estimate.shape.rows
    # The decoder's logits twice; the encoder's activations once: less than two SFT micro-batches.
    assert b.logits == 2 * a.logits and a.kept < b.kept < 2 * a.kept
    assert 0 < b.no_grad_forward < b.peak
    assert "2 decoder passes" in ours.describe()
    full = plan(_with(dpo, "method", kind="full"), gpu_memory="80GB")
    assert full.fits is not None and "computed by a no-grad pass before training" in full.describe()
