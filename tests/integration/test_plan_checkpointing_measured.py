"""The planner's selective-checkpointing term against measured memory (issue 61): what a packed forward keeps
for the backward with off, selective (every 2nd and every 3rd block) and whole checkpointing, measured with
lorakit.meter.TensorMemoryTracker in one process on CPU (a 6-block Llama of width 128, fp32, 1024-token packed
rows), beside the plan of the same recipe (device="cpu").

What selective saves against off is its share of what whole saves (n of L blocks keep only their input), and
the planner's saving is within PEAK_TOLERANCE of the measured one (measured 2026-11-28, torch 2.13: the plan
is 8-10% under the measurement in each mode, as its kept bytes are for off)."""

from __future__ import annotations

import gc

import pytest
import torch

from lorakit.model.checkpointing import OFF, SELECTIVE, WHOLE, Checkpointing, checkpointed_blocks
from tests.integration.test_plan_measured import PEAK_TOLERANCE

BLOCKS, TOKENS, EXAMPLE = 6, 1024, 128
VALUE = {OFF: False, WHOLE: True, SELECTIVE: "selective"}


def _recipe(tmp_path, choice: Checkpointing):
    from lorakit.recipe import recipe_from_dict
    from tests.conftest import tiny_recipe_dict

    raw = tiny_recipe_dict(
        tmp_path / "cache",
        tmp_path / "run",
        model={
            "name_or_path": str(tmp_path / "llama"),
            "dtype": "float32",
            "attention": "sdpa",
            "gradient_checkpointing": VALUE[choice.mode],
            "checkpoint_every": choice.every,
        },
        method={"dropout": 0.0},
        data={"packing": True, "format": "instruction", "max_length": EXAMPLE},
        train={"max_tokens": TOKENS},
    )
    return recipe_from_dict(raw)


def _kept_by_the_forward(recipe, choice: Checkpointing) -> int:
    """Tensor bytes a packed training forward leaves alive for the backward (its logits included)."""
    from lorakit.data.collate import PackedCausalCollator
    from lorakit.meter import TensorMemoryTracker
    from lorakit.model import build_model

    torch.manual_seed(0)
    built = build_model(recipe, checkpointing=choice)
    built.model.train()
    ids = torch.randint(4, 200, (TOKENS,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = [
        {"input_ids": ids[i : i + EXAMPLE], "labels": ids[i : i + EXAMPLE]} for i in range(0, TOKENS, EXAMPLE)
    ]
    batch = PackedCausalCollator(max_tokens=TOKENS)(rows)
    gc.collect()
    with TensorMemoryTracker("cpu") as tracker:
        tracker.rescan()
        before = tracker.current
        logits = built.inputs.logits(built.model, batch, "cpu")
        kept = tracker.current - before
        del logits
    return kept


@pytest.mark.slow
def test_selective_saves_its_share_and_the_plan_says_how_much(tmp_path):
    from lorakit.model.families.tiny import build_tiny_model
    from lorakit.planner import plan

    build_tiny_model("llama", tmp_path / "llama", hidden_size=128, intermediate_size=352,
                     num_hidden_layers=BLOCKS, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    choices = [
        Checkpointing(OFF),
        Checkpointing(SELECTIVE, 2),
        Checkpointing(SELECTIVE, 3),
        Checkpointing(WHOLE),
    ]
    measured, planned = {}, {}
    for choice in choices:
        recipe = _recipe(tmp_path, choice)
        measured[choice] = _kept_by_the_forward(recipe, choice)
        p = plan(recipe, device="cpu", seq_len=EXAMPLE)
        assert p.checkpointing.mode == choice.mode and p.checkpointing.every == choice.every
        planned[choice] = p.estimate.activations.kept
    off, whole = choices[0], choices[-1]
    for choice in choices[1:]:
        saved, plan_saved = measured[off] - measured[choice], planned[off] - planned[choice]
        share = checkpointed_blocks(BLOCKS, choice.every_n_blocks) / BLOCKS
        assert saved == pytest.approx(share * (measured[off] - measured[whole]), rel=0.03), choice
        assert plan_saved == pytest.approx(saved, rel=PEAK_TOLERANCE), (choice, plan_saved, saved)
