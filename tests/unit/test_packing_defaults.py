"""Which recipes pack by default, and the encoder-row budget packed T5 derives when only
train.max_target_tokens is set."""

from types import SimpleNamespace

import numpy as np
import pytest

from lorakit.data.batching import seq2seq_packing_max_tokens
from lorakit.errors import RecipeError
from lorakit.model.attention import packing_enabled
from tests.conftest import tiny_recipe


@pytest.mark.parametrize("attention", ["sdpa", "eager", "flash_attention_2"])
def test_auto_packs_causal_lms_on_every_backend(attention):
    assert packing_enabled("auto", attention, False, "llama") is True


@pytest.mark.parametrize("model_type", ["t5", "mt5"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_auto_packs_t5_where_the_backend_takes_masks(model_type, attention):
    assert packing_enabled("auto", attention, True, model_type) is True


@pytest.mark.parametrize(("model_type", "attention"), [("bart", "sdpa"), ("t5", "flash_attention_2")])
def test_auto_leaves_other_encoder_decoders_padded(model_type, attention):
    assert packing_enabled("auto", attention, True, model_type) is False
    assert packing_enabled(False, attention, True, model_type) is False


def test_forcing_packing_where_it_is_not_exact_is_a_recipe_error():
    # BART's absolute position embeddings would run across the packed row: refused, with the way out.
    with pytest.raises(RecipeError, match="T5 family.*'bart'.*data.packing: auto") as e:
        packing_enabled(True, "sdpa", True, "bart")
    assert e.value.doc_link().startswith("docs/packing.md")
    with pytest.raises(RecipeError, match="flash_attention_2 backend"):
        packing_enabled(True, "flash_attention_2", True, "t5")


def _recipe(tmp_path, **train):
    return tiny_recipe(tmp_path, tmp_path / "run", train=train)


def test_budget_from_max_target_tokens_alone_holds_micro_batch_size_examples_on_average(tmp_path):
    # Budget-filled rows (train.max_target_tokens set, max_tokens not): the encoder budget is derived.
    recipe = _recipe(tmp_path, micro_batch_size=8, max_target_tokens=256)
    sources = [100, 120, 80, 140] * 25  # mean 110
    budget = seq2seq_packing_max_tokens(recipe, sources, max_source_length=140)
    # 8 x 110 / 0.95 = 926.3, rounded up to a multiple of 8: rows of ~8 examples at the packer's fill.
    assert budget == 928
    assert 7.5 <= budget * 0.95 / 110 <= 8.5


def test_derived_budget_bounds(tmp_path):
    recipe = _recipe(tmp_path, micro_batch_size=2, max_target_tokens=64)
    # Never below the longest source (a row must hold any one example) ...
    assert seq2seq_packing_max_tokens(recipe, [10, 10, 10, 300], max_source_length=300) == 300
    # ... never above what a padded micro-batch of the same recipe holds.
    assert seq2seq_packing_max_tokens(recipe, [100] * 10, max_source_length=100) == 200


def test_explicit_max_tokens_wins(tmp_path):
    recipe = _recipe(tmp_path, micro_batch_size=8, max_tokens=4096)
    assert seq2seq_packing_max_tokens(recipe, [100] * 10, max_source_length=100) == 4096


def _batching(recipe, world=1, rank=0):
    from lorakit.data.batching import make_batching

    rng = np.random.default_rng(0)
    src, tgt = rng.integers(20, 140, 256), rng.integers(5, 30, 256)
    data = SimpleNamespace(
        train={"input_ids": [[7] * int(n) for n in src], "labels": [[9] * int(n) for n in tgt]},
        lengths=SimpleNamespace(max_source_length=140),
    )
    config = SimpleNamespace(is_encoder_decoder=True, decoder_start_token_id=0)
    return make_batching(
        recipe, data, SimpleNamespace(pad_token_id=0), config, packing=True, world=world, rank=rank
    )


def test_packed_t5_rows_hold_micro_batch_size_random_examples_by_default(tmp_path):
    from lorakit.data.balanced import BalancedRandomBatchSampler

    b = _batching(_recipe(tmp_path, micro_batch_size=8, gradient_accumulation_steps=2), world=2)
    assert isinstance(b.sampler, BalancedRandomBatchSampler)
    assert b.sampler.accumulation == 2 and b.sampler.num_replicas == 2
    assert len(b.sampler) == 256 // 16 and all(len(x) == 8 for x in b.sampler)
    summary = b.summary(SimpleNamespace(micro_batches_per_epoch=16, steps_per_epoch=8))
    assert summary["row_examples"] == 8 and summary["max_tokens"] is None
    assert 0.9 <= summary["source_efficiency"] <= 1 and 0.9 <= summary["target_efficiency"] <= 1
    # Rows are not padded and have no fixed capacity: the slots a micro-batch reports are its tokens.
    batch = b.collator([{"input_ids": [3] * 5, "labels": [4] * 2}, {"input_ids": [3] * 7, "labels": [4] * 3}])
    assert batch["num_token_slots"] == batch["num_real_tokens"] == 17
    assert "rows of 8 random examples" in b.describe(SimpleNamespace(micro_batches_per_epoch=16, steps_per_epoch=8,
                                                                     total_steps=8), 2)  # fmt: skip


def test_packed_t5_fills_rows_to_a_budget_when_one_is_set(tmp_path):
    from lorakit.data.multipack_seq2seq import Seq2SeqMultipackBatchSampler

    b = _batching(_recipe(tmp_path, micro_batch_size=8, max_tokens=1024))
    assert isinstance(b.sampler, Seq2SeqMultipackBatchSampler) and b.max_tokens == 1024
    assert b.row_examples is None and b.efficiency >= 0.9
