"""dpo.loss simpo: reference-free, length-normalised, equal to SimPO's plain formula on a fixed batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lorakit.data.preference_batching import CausalPairCollator, Seq2SeqPairCollator
from lorakit.data.preference_shared import SharedPromptCollator
from lorakit.engine.dpo import DpoObjective
from lorakit.engine.simpo import response_tokens, simpo_loss
from lorakit.errors import RecipeError
from tests.conftest import tiny_recipe, training_config_model
from tests.unit.test_dpo import _assert_same, _logp_alone, _loss_and_grads, _pairs

BETA, GAMMA = 2.0, 0.3


def _reference(model, rows) -> torch.Tensor:
    """Each response alone after its prompt, its log-probability averaged over its tokens."""
    terms = []
    for row in rows:
        chosen, rejected = (
            _logp_alone(model, row, side, False) / len(row[f"{side}_ids"]) for side in ("chosen", "rejected")
        )
        terms.append(-F.logsigmoid(BETA * (chosen - rejected) - GAMMA))
    return torch.stack(terms).sum()


def test_simpo_matches_the_formula_without_a_reference_pass(cache_dir, tmp_path, monkeypatch):
    built = training_config_model(cache_dir, tmp_path / "run", "varlen_sdpa", name_or_path="tiny:llama")
    model = built.model
    rows = _pairs(model.config.vocab_size, seed=2, encoder_decoder=False)
    reference = _loss_and_grads(model, lambda: _reference(model, rows))

    def refuse():
        raise AssertionError("SimPO turned the adapter off: it has no reference model")

    monkeypatch.setattr(model, "disable_adapter", refuse)
    objective = DpoObjective(BETA, "simpo", encoder_decoder=False, simpo_gamma=GAMMA)
    for collator in (CausalPairCollator(0), SharedPromptCollator(max_tokens=200)):
        batch = collator(rows)
        _assert_same(
            _loss_and_grads(model, lambda b=batch: objective.loss(model, built.inputs, b, "cpu")[0]),
            reference,
        )
    assert reference[0] > 0


def test_simpo_loss_rewards_and_response_tokens():
    pc, pr = torch.tensor([-6.0, -2.0]), torch.tensor([-4.0, -9.0])
    nc, nr = torch.tensor([3.0, 2.0]), torch.tensor([1.0, 3.0])
    losses, chosen, rejected = simpo_loss(pc, pr, nc, nr, beta=2.0, gamma=0.5, label_smoothing=0.1)
    z = 2.0 * (pc / nc - pr / nr) - 0.5
    torch.testing.assert_close(losses, -0.9 * F.logsigmoid(z) - 0.1 * F.logsigmoid(-z))
    torch.testing.assert_close(chosen, 2.0 * pc / nc)
    torch.testing.assert_close(rejected, 2.0 * pr / nr)
    rows = [
        {"prompt_ids": [5, 6], "chosen_ids": [7, 1], "rejected_ids": [8, 9, 1]},
        {"prompt_ids": [10], "chosen_ids": [11, 1], "rejected_ids": [1]},
    ]
    expected = [2.0, 3.0, 2.0, 1.0]
    for batch in (CausalPairCollator(0)(rows), SharedPromptCollator(32)(rows)):
        assert response_tokens(batch, False).tolist() == expected
    seq2seq = [{"input_ids": [5, 1], "chosen_ids": [7, 1], "rejected_ids": [8, 9, 1]}]
    assert response_tokens(Seq2SeqPairCollator(0, 0)(seq2seq), True).tolist() == [2.0, 3.0]


def test_simpo_gamma_belongs_to_loss_simpo(cache_dir, tmp_path):
    def recipe(**dpo):
        return tiny_recipe(
            cache_dir,
            tmp_path / "run",
            model={"name_or_path": "tiny:llama"},
            data={"source": "builtin:preference_pairs", "input_column": "question"},
            train={"objective": "dpo", "max_steps": 2},
            eval={"generate": False},
            dpo=dpo,
        )

    assert recipe(loss="simpo", simpo_gamma=1.0, beta=2.0).dpo.simpo_gamma == 1.0
    with pytest.raises(RecipeError, match="dpo.simpo_gamma applies to loss simpo only"):
        recipe(simpo_gamma=1.0)
