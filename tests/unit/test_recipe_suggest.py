"""An unknown recipe key names the key it most likely meant: the HF Trainer / PEFT / axolotl name of a
lorakit key, a misspelling of a key in any section, or the right key in the wrong section."""

from __future__ import annotations

import pytest

from lorakit.errors import RecipeError
from lorakit.recipe import load_recipe
from lorakit.recipe.load import _section_type
from lorakit.recipe.schema import Recipe
from lorakit.recipe.suggest import ECOSYSTEM
from tests.conftest import RECIPES

RECIPE = RECIPES / "quickstart_causal.yaml"
SECTIONS = {name: _section_type(f.annotation) for name, f in Recipe.model_fields.items()}


def _error(override: str) -> str:
    with pytest.raises(RecipeError) as e:
        load_recipe(RECIPE, [override])
    return str(e.value)


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("train.learning_rate", "train.lr"),
        ("train.num_train_epochs", "train.epochs"),
        ("train.per_device_train_batch_size", "train.micro_batch_size"),
        ("method.lora_alpha", "method.alpha"),
        ("model.torch_dtype", "model.dtype"),
        ("output.output_dir", "output.dir"),
        ("checkpoint.save_total_limit", "checkpoint.keep"),
        ("train.gradient_checkpointing", "model.gradient_checkpointing"),  # the right key, another section
    ],
)
def test_the_ecosystems_names_and_misplaced_keys_are_suggested(typed, meant):
    assert f"{typed}: unknown key (did you mean {meant}? see docs/recipes.md" in _error(f"{typed}=1")


@pytest.mark.parametrize("section", [s for s, t in SECTIONS.items() if t is not None])
def test_a_misspelled_key_of_every_section_is_suggested(section):
    # Every key of the section, with two letters swapped: the suggestion is the key itself.
    for key in SECTIONS[section].model_fields:
        if len(key) < 4:
            continue
        typo = key[:1] + key[2] + key[1] + key[3:]
        if typo == key or typo in SECTIONS[section].model_fields:
            continue
        assert f"did you mean {section}.{key}?" in _error(f"{section}.{typo}=1"), (section, key)


def test_a_misspelled_section_is_suggested_and_a_stranger_is_not():
    assert "trian: unknown key (did you mean train?" in _error("trian.lr=1")
    assert "train.zzz: unknown key (check the spelling; see docs/recipes.md" in _error("train.zzz=1")


def test_every_ecosystem_name_points_at_a_lorakit_key():
    keys = {k for t in SECTIONS.values() if t is not None for k in t.model_fields}
    assert set(ECOSYSTEM.values()) <= keys
