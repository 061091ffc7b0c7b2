"""A run builds with the checkpointing its plan chose (model.gradient_checkpointing auto, issue 61) and says
which, on the console and in summary.json; one process, in-process."""

from __future__ import annotations

import pytest

import lorakit
from lorakit.planner import run_plan
from tests.conftest import tiny_recipe

# One optimizer step and nothing after it: all the choice needs to show.
ONE_STEP = {"train": {"max_steps": 1}, "eval": {"enabled": False}, "output": {"save_adapter": False}}


@pytest.mark.slow
def test_the_run_builds_with_the_plans_choice_and_says_it(cache_dir, tmp_path, monkeypatch, capsys):
    """The planner picks on a GPU only; here its plan of the run is given a choice (selective, every 2nd
    block), as it would be on a GPU whose memory off does not fit."""
    real, calls = run_plan.plan_of_run, []
    chosen = {"mode": "selective", "every": 2, "why": "auto: off needs more (test)"}

    def plan_of_run(*args):
        calls.append(args)
        return {**real(*args), "gradient_checkpointing": chosen}

    monkeypatch.setattr(run_plan, "plan_of_run", plan_of_run)
    recipe = tiny_recipe(cache_dir, tmp_path / "run", model={"gradient_checkpointing": "auto"}, **ONE_STEP)
    s = lorakit.train(recipe).summary
    # Planned before the build (the choice) and after training (summary.json's plan).
    assert len(calls) == 2
    assert s["gradient_checkpointing"] == chosen and s["plan"]["gradient_checkpointing"] == chosen
    out = capsys.readouterr().out
    assert (
        out.count("gradient checkpointing: selective (every 2nd block): auto: off needs more (test)\n") == 1
    )
    # The planner's own answer on this CPU: whole (no GPU memory to plan against).
    assert real(*calls[0])["gradient_checkpointing"]["mode"] == "whole"
