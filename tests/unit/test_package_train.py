"""The package's own `lorakit.train` takes what lorakit.api.train takes (docs/data.md: in-memory datasets)."""

from __future__ import annotations

import datasets
import yaml

import lorakit
from tests.conftest import tiny_recipe
from tests.unit.test_causal_data import CONVERSATION


def test_lorakit_train_reads_in_memory_datasets(cache_dir, tmp_path):
    train = datasets.Dataset.from_list([{"messages": CONVERSATION}, {"messages": CONVERSATION[1:3]}] * 2)
    held = datasets.Dataset.from_list([{"messages": CONVERSATION[:3]}])
    recipe = tiny_recipe(
        cache_dir,
        tmp_path / "run",
        model={"name_or_path": "tiny:llama"},
        data={"format": "chat", "eval_split": "auto", "max_samples": None},
        train={"max_steps": 1, "micro_batch_size": 2},
        eval={"generate": False},
    )
    result = lorakit.train(recipe, train_dataset=train, eval_dataset=held)
    # The run read the four in-memory rows (not the recipe's source) and evaluated on the held-out one.
    assert result.summary["train_samples"] == 2 and result.summary["steps"] == 1
    resolved = yaml.safe_load((result.run_dir / "recipe.yaml").read_text())["data"]
    assert "/inputs/" in resolved["source"] and resolved["eval_split"] == "validation"
    assert "loss" in result.summary["eval"]
