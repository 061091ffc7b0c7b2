"""model.gradient_checkpointing auto (issue 61): the planner's choice of off, selective (every k-th block)
and whole, its own memory term for selective, what the plan and the job read back, and the recipe field."""

from __future__ import annotations

import pytest

from lorakit.errors import RecipeError
from lorakit.model.checkpointing import (
    OFF,
    SELECTIVE,
    WHOLE,
    Checkpointing,
    checkpointed_blocks,
    from_plan,
    from_recipe,
    ordinal,
    planner_decides,
)
from lorakit.planner import plan
from lorakit.planner.search import slowdown
from lorakit.planner.states import Setup
from lorakit.planner.units import HEADROOM
from lorakit.recipe import load_recipe
from tests.conftest import RECIPES

GiB = 2**30


def _llama(*overrides):
    # 8 GPUs, ZeRO-3, packed rows of 16384 tokens (recipes/llama3_8b_lora.yaml): activations dominate.
    return load_recipe(RECIPES / "llama3_8b_lora.yaml", ["model.gradient_checkpointing=auto", *overrides])


def _with(value: str, *overrides):
    return load_recipe(RECIPES / "llama3_8b_lora.yaml", [f"model.gradient_checkpointing={value}", *overrides])


def test_auto_takes_the_cheapest_mode_that_fits_with_headroom():
    recipe = _llama()
    big = 1000 * GiB
    off = plan(_with("false"), gpu_memory=big).per_gpu_bytes
    whole = plan(_with("true"), gpu_memory=big).per_gpu_bytes
    assert off > 2 * whole
    # Off fits with headroom: off.
    p = plan(recipe, gpu_memory=int(off / HEADROOM) + GiB)
    assert p.checkpointing.mode == OFF and p.estimate.setup.checkpointing == OFF
    assert p.per_gpu_bytes == off and p.checkpointing.why.startswith("auto: off fits")
    # Off misses by a little: selective with the largest k (fewest blocks recomputed), every 32nd here.
    p = plan(recipe, gpu_memory=int(off / HEADROOM) - GiB)
    assert (
        p.checkpointing == Checkpointing(SELECTIVE, 32, p.checkpointing.why)
        and "every 32nd block" in p.checkpointing.why
    )
    assert whole < p.per_gpu_bytes <= HEADROOM * p.gpu_memory < off
    # Room for every 4th block: k is the largest that fits, one more would not.
    every4 = plan(_with("selective", "model.checkpoint_every=4"), gpu_memory=big).per_gpu_bytes
    p = plan(recipe, gpu_memory=int(every4 / HEADROOM) + 2**20)
    assert p.checkpointing.mode == SELECTIVE and p.checkpointing.every == 4 and p.per_gpu_bytes == every4
    bigger = plan(_with("selective", "model.checkpoint_every=5"), gpu_memory=p.gpu_memory)
    assert bigger.checkpointing.why == "model.gradient_checkpointing: selective in the recipe"
    assert whole < every4 < bigger.per_gpu_bytes and bigger.per_gpu_bytes > HEADROOM * p.gpu_memory
    # Only whole fits: whole.
    p = plan(recipe, gpu_memory=int(whole / HEADROOM) + GiB)
    assert (
        p.checkpointing.mode == WHOLE and p.per_gpu_bytes == whole and p.checkpointing.why.endswith(", fits")
    )
    # Nothing fits: whole (the most it saves), and the plan says so.
    p = plan(recipe, gpu_memory=whole // 2)
    assert p.checkpointing.mode == WHOLE and "does not fit either" in p.checkpointing.why


def test_without_gpu_memory_auto_is_whole_and_explicit_values_are_kept():
    for p in (plan(_llama()), plan(_llama(), gpu_memory="1000GB", device="cpu")):
        assert p.checkpointing == from_recipe(_llama().model)
        assert p.checkpointing.mode == WHOLE and "without a GPU memory" in p.checkpointing.why
    for value, mode in (("true", WHOLE), ("false", OFF)):
        p = plan(_with(value), gpu_memory="1000GB")
        assert (
            p.checkpointing.mode == mode
            and p.checkpointing.why == f"model.gradient_checkpointing: {value} in the recipe"
        )
    # Selective without a k: the planner's k on a GPU, 2 without one.
    sel = _with("selective")
    assert plan(sel).checkpointing == Checkpointing(
        SELECTIVE, 2, "model.gradient_checkpointing: selective in the recipe"
    )
    on_gpu = plan(sel, gpu_memory="141GB").checkpointing
    assert on_gpu.mode == SELECTIVE and on_gpu.why.startswith("selective without model.checkpoint_every")


def test_selective_keeps_the_inputs_of_its_blocks_and_everything_of_the_others():
    """The layers' kept bytes: n x (layer input) + (L - n) x (whole layer) for n checkpointed blocks of L,
    so (off - selective) x L == n x (off - whole); T5 counts its blocks over both stacks."""
    for recipe_file, blocks in (("llama3_8b_lora.yaml", 32), ("flan_t5_xl_lora.yaml", 48)):

        def kept(*o, recipe_file=recipe_file):
            return plan(load_recipe(RECIPES / recipe_file, list(o)), gpu_memory="80GB").estimate.activations

        off, whole = kept("model.gradient_checkpointing=false"), kept("model.gradient_checkpointing=true")
        assert (off.checkpointed, whole.checkpointed) == (0, blocks)
        for k in (2, 3, 5, 47):
            sel = kept("model.gradient_checkpointing=selective", f"model.checkpoint_every={k}")
            n = checkpointed_blocks(blocks, k)
            assert sel.checkpointed == n and whole.kept < sel.kept < off.kept
            if blocks == 32:  # causal: the blocks are alike
                assert (off.kept - sel.kept) * blocks == n * (off.kept - whole.kept)
            assert sel.recompute == whole.recompute > 0 == off.recompute


def test_blocks_counted_as_transformers_flags_them():
    # Blocks numbered over the encoder's then the decoder's: every 3rd of 2 + 2 is encoder 0, decoder 1.
    assert checkpointed_blocks(2, 3) == 1 and checkpointed_blocks(2, 3, start=2) == 1
    assert checkpointed_blocks(24, 5) == 5 and checkpointed_blocks(24, 5, start=24) == 5
    assert checkpointed_blocks(32, 32) == 1 and checkpointed_blocks(32, 1) == 32
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st"]  # fmt: skip


def test_selective_costs_its_share_of_the_recompute():
    off = Setup(2, "none", "none", 1, 4096, False)
    whole = Setup(2, "none", "none", 1, 4096, True)
    every4 = Setup(2, "none", "none", 1, 4096, True, 4)
    assert slowdown(whole, off, adapter=True, nodes=1) == pytest.approx(1.5)
    assert slowdown(every4, off, adapter=True, nodes=1) == pytest.approx(1.125)
    assert slowdown(every4, off, adapter=False, nodes=1) == pytest.approx(1 + 1 / 12)
    assert every4.checkpointing == SELECTIVE and "checkpointing every 4th block" in every4.label()


def test_the_job_reads_the_plans_choice_back():
    """What the job builds with is a pure function of the plan it is handed (summary.json's plan too)."""
    recipe = _llama()
    p = plan(recipe, gpu_memory="141GB")
    assert planner_decides(recipe.model) and p.checkpointing.mode == SELECTIVE
    assert p.to_dict()["gradient_checkpointing"] == p.checkpointing.to_dict()
    assert from_plan(p.to_dict(), recipe.model) == p.checkpointing
    # A plan that failed: auto is whole, and the line says why.
    failed = from_plan({"error": "PlanError: unknown"}, recipe.model)
    assert failed.mode == WHOLE and "PlanError: unknown" in failed.why
    assert not planner_decides(_with("true").model)
    assert p.checkpointing.describe().startswith(
        "gradient checkpointing: selective (every 2nd block): auto: "
    )
    assert "gradient checkpointing: selective" in p.describe()


def test_recommendations_name_checkpointing_only_when_it_changes():
    p = plan(_llama(), gpu_memory="141GB")
    assert p.recommendation is not None
    changes = [o for o in p.recommended_overrides if o.startswith("model.")]
    assert changes == ["model.gradient_checkpointing=false"]
    explicit = plan(_with("selective", "model.checkpoint_every=2"), gpu_memory="141GB")
    assert [o for o in explicit.recommended_overrides if o.startswith("model.")] == [
        "model.gradient_checkpointing=false", "model.checkpoint_every=null"]  # fmt: skip
    # Applied, they load.
    _with("selective", "model.checkpoint_every=2", *explicit.recommended_overrides)


def test_the_recipe_field():
    assert (
        load_recipe(
            RECIPES / "quickstart.yaml", ["model.gradient_checkpointing=selective"]
        ).model.checkpoint_every
        is None
    )
    with pytest.raises(RecipeError, match="model.checkpoint_every"):
        load_recipe(RECIPES / "quickstart.yaml", ["model.checkpoint_every=4"])
    with pytest.raises(RecipeError, match="checkpoint_every"):
        load_recipe(
            RECIPES / "quickstart.yaml",
            ["model.gradient_checkpointing=selective", "model.checkpoint_every=1"],
        )
    with pytest.raises(RecipeError, match="gradient_checkpointing"):
        load_recipe(RECIPES / "quickstart.yaml", ["model.gradient_checkpointing=partial"])
