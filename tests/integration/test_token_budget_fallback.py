"""Encoder-decoders whose packing would not be exact (BART: absolute position embeddings) train, under
data.packing: auto, on token-budget, length-grouped padded micro-batches; forcing packing is refused."""

import pytest

import lorakit
from lorakit.errors import RecipeError
from lorakit.testing import build_tiny_model
from tests.conftest import tiny_recipe


@pytest.fixture(scope="module")
def tiny_bart(tmp_path_factory):
    """The BART family's tiny random model (one encoder and one decoder layer, lorakit's tiny tokenizer),
    saved as a local model directory."""
    path = tmp_path_factory.mktemp("tiny-bart")
    build_tiny_model("bart", path)
    return path


def _recipe(cache_dir, out, model_dir, **data):
    return tiny_recipe(
        cache_dir,
        out,
        model={"name_or_path": str(model_dir)},
        data={"max_samples": 64, **data},
        train={"micro_batch_size": 4, "lr": 1e-2},
        eval={"generate": False},
    )


def test_bart_trains_on_token_budget_batches(cache_dir, tmp_path, tiny_bart):
    summary = lorakit.train(_recipe(cache_dir, tmp_path / "run", tiny_bart)).summary
    batching = summary["batching"]
    assert batching["packing"] is False and batching["token_budget"] is True
    # Rows of micro_batch_size examples on average: about the steps fixed batches of 4 would take.
    assert 12 <= summary["steps"] <= 20, summary["steps"]
    # Grouped by length under a budget: little padding on either side.
    assert batching["source_efficiency"] > 0.8 and batching["target_efficiency"] > 0.6
    assert summary["padded_tokens"] <= summary["steps"] * (
        batching["max_tokens"] + batching["max_target_tokens"]
    )
    assert summary["loss"]["last"] < summary["loss"]["first"]


def test_explicit_packing_false_keeps_fixed_micro_batches(cache_dir, tmp_path, tiny_bart):
    recipe = _recipe(cache_dir, tmp_path / "run", tiny_bart, packing=False)
    summary = lorakit.train(
        recipe.model_copy(update={"train": recipe.train.model_copy(update={"max_steps": 2})})
    ).summary
    assert summary["batching"]["packing"] is False and "token_budget" not in summary["batching"]
    assert summary["batching"]["micro_batches_per_epoch_per_rank"] == 64 // 4


def test_forcing_packing_on_bart_is_refused(cache_dir, tmp_path, tiny_bart):
    with pytest.raises(RecipeError, match="T5 family"):
        lorakit.train(_recipe(cache_dir, tmp_path / "run", tiny_bart, packing=True))
