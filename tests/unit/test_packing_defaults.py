"""Which recipes pack by default, and the encoder-row budget an unset train.max_tokens gives packed T5."""

import pytest

from lorakit.engine.job import seq2seq_packing_max_tokens
from lorakit.errors import RecipeError
from lorakit.model.attention import packing_enabled
from lorakit.recipe import recipe_from_dict
from tests.conftest import tiny_recipe_dict


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
    return recipe_from_dict(tiny_recipe_dict(tmp_path, tmp_path / "run", train=train))


def test_default_t5_row_holds_micro_batch_size_examples_on_average(tmp_path):
    recipe = _recipe(tmp_path, micro_batch_size=8)
    sources = [100, 120, 80, 140] * 25  # mean 110
    budget = seq2seq_packing_max_tokens(recipe, sources, max_source_length=140)
    # 8 x 110 / 0.95 = 926.3, rounded up to a multiple of 8: rows of ~8 examples at the packer's fill.
    assert budget == 928
    assert 7.5 <= budget * 0.95 / 110 <= 8.5


def test_default_t5_row_bounds(tmp_path):
    recipe = _recipe(tmp_path, micro_batch_size=2)
    # Never below the longest source (a row must hold any one example) ...
    assert seq2seq_packing_max_tokens(recipe, [10, 10, 10, 300], max_source_length=300) == 300
    # ... never above what a padded micro-batch of the same recipe holds.
    assert seq2seq_packing_max_tokens(recipe, [100] * 10, max_source_length=100) == 200


def test_explicit_max_tokens_wins(tmp_path):
    recipe = _recipe(tmp_path, micro_batch_size=8, max_tokens=4096)
    assert seq2seq_packing_max_tokens(recipe, [100] * 10, max_source_length=100) == 4096
