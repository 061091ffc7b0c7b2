"""Gradient checkpointing off, selective (every k-th block) and whole (issue 61): the same loss and every
LoRA gradient on the tiny Llama and the tiny T5, padded and packed rows (packing passes lorakit's segments
through the blocks), with dropout off and on (the recompute must draw the forward's dropout masks), and the
blocks transformers flags are the blocks the planner counts."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from lorakit.doctor import contracts
from lorakit.model import build_model
from lorakit.model.checkpointing import OFF, SELECTIVE, WHOLE, Checkpointing, checkpointed_blocks
from lorakit.model.loss import token_loss_sum
from tests.conftest import tiny_recipe

# T5 numbers its 4 blocks over both stacks: every 3rd is encoder block 0 and decoder block 1.
EVERY = {"llama": 2, "t5": 3}
CASES = [
    (kind, packed, dropout)
    for kind in ("llama", "t5")
    for packed in (False, True)
    for dropout in (False, True)
]


def _built(cache_dir, tmp_path, kind: str, choice: Checkpointing, packed: bool, dropout: bool):
    p = 0.1 if dropout else 0.0
    recipe = tiny_recipe(
        cache_dir,
        tmp_path / "run",
        model={"name_or_path": f"tiny:{kind}", "attention": "sdpa", "attention_dropout": p},
        method={"dropout": p},
        data={"packing": packed},
    )
    torch.manual_seed(0)  # the LoRA A init
    built = build_model(recipe, checkpointing=choice)
    if dropout:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, w in built.model.named_parameters():
                if "lora_B" in name:
                    w.copy_(torch.randn(w.shape, generator=gen) * 0.05)
        built.model.train()
        return built
    return contracts.prepare_for_contract(built)  # also sets T5's hidden-state dropout (0.1) to 0


def _loss_and_grads(built, packed: bool = False, seed: int = 1):
    rows = contracts.contract_rows(built)
    batch = contracts.collators(built, packed)[1](rows)
    built.model.zero_grad()
    torch.manual_seed(seed)  # the dropout masks
    logits = built.inputs.logits(built.model, batch, "cpu")
    loss = token_loss_sum(logits, batch["labels"]) / batch["num_target_tokens"]
    loss.backward()
    grads = {
        n: w.grad.clone() for n, w in built.model.named_parameters() if "lora_" in n and w.grad is not None
    }
    return loss.detach(), grads


def _flags(built) -> list[bool]:
    return [
        m.gradient_checkpointing for m in built.model.modules() if isinstance(m, GradientCheckpointingLayer)
    ]


@pytest.mark.parametrize(("kind", "packed", "dropout"), CASES)
def test_off_selective_and_whole_give_the_same_loss_and_lora_gradients(
    cache_dir, tmp_path, kind, packed, dropout
):
    every = EVERY[kind]
    results, flags = {}, {}
    for choice in (Checkpointing(OFF), Checkpointing(SELECTIVE, every), Checkpointing(WHOLE)):
        built = _built(cache_dir, tmp_path, kind, choice, packed, dropout)
        assert built.checkpointing == choice
        flags[choice.mode] = _flags(built)
        results[choice.mode] = _loss_and_grads(built, packed)
    blocks = len(flags[OFF])
    assert blocks == 4 if kind == "t5" else blocks == 2
    assert flags[OFF] == [False] * blocks and flags[WHOLE] == [True] * blocks
    assert flags[SELECTIVE] == [i % every == 0 for i in range(blocks)]
    assert sum(flags[SELECTIVE]) == checkpointed_blocks(blocks, every)
    loss, grads = results[OFF]
    assert len(grads) >= 4 * blocks and all(g.abs().sum() > 0 for g in grads.values())
    for mode in (SELECTIVE, WHOLE):
        other_loss, other = results[mode]
        torch.testing.assert_close(other_loss, loss, rtol=0, atol=0)
        assert other.keys() == grads.keys()
        for name in grads:
            torch.testing.assert_close(other[name], grads[name], rtol=1e-5, atol=1e-7, msg=f"{mode}: {name}")


@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_the_dropout_masks_are_drawn_and_the_recompute_draws_them_again(cache_dir, tmp_path, kind):
    """Dropout is on in the dropout cases above (another seed gives another loss), and a recompute that does
    not restore the RNG state (torch's preserve_rng_state=False) gives other gradients: the equality above
    holds because the recompute draws the forward's masks."""
    built = _built(cache_dir, tmp_path, kind, Checkpointing(OFF), packed=False, dropout=True)
    loss, grads = _loss_and_grads(built)
    other_seed, _ = _loss_and_grads(built, seed=2)
    assert abs(float(other_seed - loss)) > 1e-4
    fresh_masks = _built(cache_dir, tmp_path, kind, Checkpointing(OFF), packed=False, dropout=True)
    fresh_masks.model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": False}
    )
    unrestored_loss, unrestored = _loss_and_grads(fresh_masks)
    torch.testing.assert_close(unrestored_loss, loss, rtol=0, atol=0)  # the forward is the same
    assert any(not torch.allclose(unrestored[n], grads[n], rtol=1e-3, atol=1e-6) for n in grads)
