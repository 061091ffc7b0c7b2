"""Objectives as a type: adding one is a module with an Objective subclass and its registration.

The toy objective below (twice the token-weighted cross-entropy) is defined here and nowhere else; once
registered, a recipe names it in train.objective and lorakit.train runs it through the real loop (one
process, ZeRO stage 0 on the CPU). Its rows, batching and evaluation are the Objective defaults (SFT's).
"""

from __future__ import annotations

import json

import pytest

import lorakit
from lorakit.errors import RecipeError
from lorakit.objectives import (
    Objective,
    make_objective,
    objective_named,
    objective_type,
    register,
    unregister,
)
from lorakit.objectives.dpo import DpoObjective
from lorakit.objectives.sft import SftObjective, causal_loss_sum
from lorakit.recipe import recipe_from_dict
from lorakit.recipe.known_objectives import known_names
from lorakit.recipe.objective_spec import ObjectiveSpec
from tests.conftest import tiny_recipe, tiny_recipe_dict

DOUBLED = "doubled_tokens"


class DoubledTokens(Objective):
    """2 x the summed token cross-entropy; divisor: target tokens. Reports the cross-entropy itself."""

    spec = ObjectiveSpec(name=DOUBLED)

    def units(self, batch):
        return batch["num_target_tokens"]

    def loss(self, engine, inputs, batch, device):
        ce = causal_loss_sum(engine, inputs, batch, device)
        return 2.0 * ce, {"ce": ce.detach()}


@pytest.fixture
def doubled():
    register(DoubledTokens)
    yield DoubledTokens
    unregister(DOUBLED)


def _records(run_dir, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_a_registered_objective_trains_through_the_real_loop(doubled, cache_dir, tmp_path):
    sections = dict(train={"max_steps": 2, "lr": 1e-2}, eval={"generate": False})
    sft = lorakit.train(tiny_recipe(cache_dir, tmp_path / "sft", **sections))
    recipe = tiny_recipe(
        cache_dir, tmp_path / "toy", **{**sections, "train": {**sections["train"], "objective": DOUBLED}}
    )
    assert recipe.train.objective == DOUBLED and isinstance(make_objective(recipe, None), DoubledTokens)
    toy = lorakit.train(recipe)
    assert toy.summary["steps"] == 2
    ours, theirs = _records(toy.run_dir, "train"), _records(sft.run_dir, "train")
    # The first window is scored before any update, from the same seed: exactly twice SFT's loss, and the
    # objective's own metric, divided by the same units, is SFT's loss itself.
    assert ours[0]["loss"] == pytest.approx(2 * theirs[0]["loss"], rel=1e-5)
    assert all(r["ce"] == pytest.approx(r["loss"] / 2, rel=1e-6) for r in ours)
    # Evaluation is the default (SFT's token loss), recorded as for an SFT run.
    assert "loss" in toy.summary["eval"]
    assert "objective: doubled_tokens" in (toy.run_dir / "recipe.yaml").read_text()


def test_the_registry_knows_the_built_ins_and_what_is_registered(doubled, cache_dir, tmp_path):
    assert objective_named("sft") is SftObjective and objective_named("dpo") is DpoObjective
    assert objective_named(DOUBLED) is DoubledTokens and DOUBLED in known_names()
    recipe = tiny_recipe(cache_dir, tmp_path / "run", train={"objective": DOUBLED})
    assert objective_type(recipe) is DoubledTokens
    register(DoubledTokens)  # registering the same objective again changes nothing

    class Impostor(DoubledTokens):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register(Impostor)
    unregister("sft")  # a built-in stays
    assert objective_named("sft") is SftObjective


def test_an_unknown_objective_names_the_field_and_the_known_ones(cache_dir, tmp_path):
    raw = tiny_recipe_dict(cache_dir, tmp_path / "run", train={"objective": DOUBLED})
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(raw)
    assert f"train.objective: unknown objective '{DOUBLED}'; known: dpo, grpo, kto, orpo, sft" in str(e.value)
    with pytest.raises(RecipeError, match=r"'nope': no such objective; known: dpo, grpo, kto, orpo, sft"):
        objective_named("nope")


def test_after_unregistering_a_recipe_no_longer_accepts_the_name(cache_dir, tmp_path):
    register(DoubledTokens)
    unregister(DOUBLED)
    with pytest.raises(RecipeError, match="unknown objective"):
        tiny_recipe(cache_dir, tmp_path / "run", train={"objective": DOUBLED})


def test_what_a_new_objective_refuses_by_default(doubled, cache_dir, tmp_path):
    """An objective's spec says whether the tiled loss and sequence parallelism can take its loss; a new
    one refuses both until it says otherwise, naming itself."""
    with pytest.raises(RecipeError, match=f"train.objective {DOUBLED} computes its loss from the logits"):
        tiny_recipe(
            cache_dir,
            tmp_path / "run",
            model={"name_or_path": "tiny:llama", "tiled_loss": True},
            data={"format": "instruction", "max_length": 64},
            train={"objective": DOUBLED},
        )
    with pytest.raises(RecipeError, match=f"train.objective {DOUBLED} needs each row whole on one rank"):
        tiny_recipe(
            cache_dir,
            tmp_path / "run",
            model={"name_or_path": "tiny:llama"},
            data={"format": "instruction", "max_length": 64},
            distributed={"num_processes": 2, "sequence_parallel": 2},
            train={"objective": DOUBLED},
        )


def test_another_objectives_section_is_refused(doubled, cache_dir, tmp_path):
    with pytest.raises(RecipeError, match="the dpo section is read only with train.objective: dpo"):
        tiny_recipe(cache_dir, tmp_path / "run", train={"objective": DOUBLED}, dpo={"beta": 0.5})


@pytest.mark.slow
def test_a_plugin_module_registers_its_objective_in_every_process_that_reads_the_recipe(cache_dir, tmp_path):
    """train.objective_module is imported before train.objective is read: a fresh process (as each worker
    the launcher starts is) that loads the recipe file knows the plugin's objective."""
    import subprocess
    import sys

    import yaml

    from lorakit.recipe import load_recipe

    raw = tiny_recipe_dict(
        cache_dir,
        tmp_path / "run",
        train={"objective": DOUBLED, "objective_module": "tests.unit.objective_plugin"},
    )
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    code = (
        "import sys; from lorakit.recipe import load_recipe; from lorakit.objectives import objective_type; "
        "print(objective_type(load_recipe(sys.argv[1])).__qualname__)"
    )
    found = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True
    )
    assert found.stdout.strip() == "DoubledTokens"
    try:
        assert load_recipe(path).train.objective_module == "tests.unit.objective_plugin"
    finally:
        unregister(DOUBLED)
    raw["train"]["objective_module"] = "tests.unit.no_such_plugin"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(
        RecipeError, match="train.objective_module 'tests.unit.no_such_plugin' cannot be imported"
    ):
        load_recipe(path)
