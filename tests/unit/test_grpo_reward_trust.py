"""grpo.rewards naming `module:function` is code (recipe/read_back.py CODE_FIELDS): a recipe read back from a
run directory that reads its data is refused unless the caller names the module, and nothing is imported."""

from __future__ import annotations

import sys

import pytest
import yaml

from lorakit.recipe.read_back import NotGranted, named_code, read_back_recipe

RAW = {
    "train": {"objective": "grpo"},
    "grpo": {"rewards": [{"name": "exact_match"}, {"name": "lk_evil_rewards:score", "weight": 2}]},
}


def test_reward_functions_are_named_code_and_built_ins_are_not():
    assert named_code(RAW) == {"grpo.rewards[1].name": "lk_evil_rewards:score"}


def test_a_read_back_recipe_reading_data_must_be_granted_its_reward_module():
    text = yaml.safe_dump(RAW)
    with pytest.raises(
        NotGranted, match=r"grpo.rewards\[1\].name .*lk_evil_rewards:score.* --allow-code lk_evil"
    ):
        read_back_recipe(text, "run/recipe.yaml", reads_data=True)
    assert "lk_evil_rewards" not in sys.modules
