"""ORPO and KTO (lorakit.objectives.orpo, .kto): each loss and its LoRA gradients equal the formula computed
by hand, response by response (each sequence run alone through the model's plain forward), on a tiny Llama
(padded and shared-prompt packed rows) and a tiny T5 (padded and packed rows); the formulas themselves on
small tensors; KTO's reference point is the clamped, detached mismatched-pair KL estimate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lorakit.data.pair_collate import (
    BATCH_KEY,
    LABELS,
    CausalPairCollator,
    PackedSeq2SeqPairCollator,
    Seq2SeqPairCollator,
    SharedPromptCollator,
    WithLabels,
)
from lorakit.objectives.kto import KtoObjective, kto_loss
from lorakit.objectives.orpo import OrpoObjective, orpo_loss
from tests.conftest import training_config_model
from tests.unit.test_dpo import _assert_same, _logp_alone, _loss_and_grads, _pairs

WEIGHT, BETA, W_D, W_U = 0.3, 0.5, 1.5, 0.7
SIDES = ("chosen", "rejected")
# Which of _pairs' three rows are desirable (KTO rows: chosen = the completion, rejected = the mismatched one).
LABEL = [True, False, True]


@pytest.fixture(scope="module")
def llama(cache_dir, tmp_path_factory):
    return _moved(
        training_config_model(
            cache_dir, tmp_path_factory.mktemp("run"), "varlen_sdpa", name_or_path="tiny:llama"
        )
    )


@pytest.fixture(scope="module")
def t5(cache_dir, tmp_path_factory):
    built = training_config_model(
        cache_dir, tmp_path_factory.mktemp("run"), "sdpa_mask", name_or_path="tiny:t5"
    )
    return _moved(built)


def _moved(built):
    """The model with its LoRA B away from zero, so the policy differs from the reference (adapter off)."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in built.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return built


def _orpo_by_hand(model, rows, enc_dec: bool) -> torch.Tensor:
    terms = []
    for row in rows:
        c, r = (_logp_alone(model, row, s, enc_dec) / len(row[f"{s}_ids"]) for s in SIDES)
        odds = (c - torch.log1p(-torch.exp(c))) - (r - torch.log1p(-torch.exp(r)))
        terms.append(-c - WEIGHT * F.logsigmoid(odds))
    return torch.stack(terms).sum()


def _kto_by_hand(model, rows, enc_dec: bool) -> torch.Tensor:
    policy, ref = [], []
    for row in rows:
        with torch.no_grad(), model.disable_adapter():
            ref.append([_logp_alone(model, row, s, enc_dec) for s in SIDES])
        policy.append([_logp_alone(model, row, s, enc_dec) for s in SIDES])
    kl = torch.stack([p[1] - r[1] for p, r in zip(policy, ref, strict=True)]).mean()
    z0 = torch.clamp(kl, min=0).detach()
    terms = []
    for (p, _), (r, _), good in zip(policy, ref, LABEL, strict=True):
        x = BETA * ((p - r) - z0) if good else BETA * (z0 - (p - r))
        terms.append((W_D if good else W_U) * (1 - torch.sigmoid(x)))
    return torch.stack(terms).sum()


def _labelled(rows):
    return [dict(r, label=good) for r, good in zip(rows, LABEL, strict=True)]


def _orpo(built, enc_dec: bool, collators, monkeypatch) -> None:
    model = built.model
    rows = _pairs(model.config.vocab_size, seed=4 + enc_dec, encoder_decoder=enc_dec)
    by_hand = _loss_and_grads(model, lambda: _orpo_by_hand(model, rows, enc_dec))
    assert by_hand[0] > 0

    def refuse():
        raise AssertionError("ORPO turned the adapter off: it has no reference model")

    monkeypatch.setattr(model, "disable_adapter", refuse)
    objective = OrpoObjective(WEIGHT, encoder_decoder=enc_dec)
    for collator in collators:
        batch = collator(rows)
        ours = _loss_and_grads(model, lambda b=batch: objective.loss(model, built.inputs, b, "cpu")[0])
        _assert_same(ours, by_hand)


def test_orpo_loss_and_grads_equal_the_formula_llama(llama, monkeypatch):
    _orpo(llama, False, (CausalPairCollator(0), SharedPromptCollator(max_tokens=200)), monkeypatch)


def test_orpo_loss_and_grads_equal_the_formula_t5(t5, monkeypatch):
    start = t5.model.config.decoder_start_token_id
    _orpo(
        t5, True, (Seq2SeqPairCollator(0, start), PackedSeq2SeqPairCollator(None, None, start)), monkeypatch
    )


def _kto(built, enc_dec: bool, collators, cached: bool = False):
    model = built.model
    rows = _labelled(_pairs(model.config.vocab_size, seed=6, encoder_decoder=enc_dec))
    by_hand = _loss_and_grads(model, lambda: _kto_by_hand(model, rows, enc_dec))
    live = KtoObjective(BETA, W_D, W_U, encoder_decoder=enc_dec)
    for collator in collators:
        batch = WithLabels(collator)(rows)
        assert batch[LABELS].tolist() == LABEL
        _assert_same(
            _loss_and_grads(model, lambda b=batch: live.loss(model, built.inputs, b, "cpu")[0]), by_hand
        )
    if cached:
        # Full fine-tuning: the same reference log-probabilities read from the batch (the cached table).
        with torch.no_grad(), model.disable_adapter():
            batch[BATCH_KEY] = live.log_probs(model, built.inputs, batch, "cpu").detach()
        table = KtoObjective(BETA, W_D, W_U, encoder_decoder=enc_dec, cached_reference=True)
        _assert_same(
            _loss_and_grads(model, lambda: table.loss(model, built.inputs, batch, "cpu")[0]), by_hand
        )
    return by_hand


def test_kto_loss_and_grads_equal_the_formula_llama(llama):
    _kto(llama, False, (CausalPairCollator(0), SharedPromptCollator(max_tokens=200)), cached=True)


def test_kto_loss_and_grads_equal_the_formula_t5(t5):
    start = t5.model.config.decoder_start_token_id
    _kto(t5, True, (Seq2SeqPairCollator(0, start), PackedSeq2SeqPairCollator(None, None, start)))


def test_orpo_formula_on_small_tensors():
    pc = torch.tensor([-3.0, -8.0], requires_grad=True)
    pr = torch.tensor([-6.0, -4.0], requires_grad=True)
    nc, nr = torch.tensor([3.0, 4.0]), torch.tensor([2.0, 4.0])
    losses, chosen, rejected, nll, ratio = orpo_loss(pc, pr, nc, nr, weight=0.5)
    # Pair 0: mean log-probs -1 and -3; odds ratio log(e^-1 / (1 - e^-1)) - log(e^-3 / (1 - e^-3)).
    a, b = torch.tensor(-1.0), torch.tensor(-3.0)
    ratio0 = (a - torch.log(1 - torch.exp(a))) - (b - torch.log(1 - torch.exp(b)))
    assert ratio[0].item() == pytest.approx(ratio0.item(), rel=1e-6)
    assert losses[0].item() == pytest.approx((1.0 - 0.5 * F.logsigmoid(ratio0)).item(), rel=1e-6)
    assert chosen.tolist() == pytest.approx([-0.5, -1.0]) and rejected.tolist() == pytest.approx([-1.5, -0.5])
    assert nll.tolist() == pytest.approx([1.0, 2.0]) and ratio[1] < 0 < ratio[0]
    losses.sum().backward()
    # d loss / d pc = (-1 - w sigmoid(-ratio) dratio/dc) / |c|, dratio/dc = 1 / (1 - P_c).
    pa = torch.exp(a)
    expected = (-1 - 0.5 * torch.sigmoid(-ratio0) / (1 - pa)) / 3
    assert pc.grad[0].item() == pytest.approx(expected.item(), rel=1e-5)
    # Stable where P is close to 1 (log(1 - P) of a mean log-probability of -1e-6).
    near = orpo_loss(torch.tensor([-1e-6]), torch.tensor([-2.0]), torch.ones(1), torch.ones(1), weight=1.0)[0]
    assert torch.isfinite(near).all()


def test_kto_formula_on_small_tensors_and_its_reference_point():
    policy = torch.tensor([-2.0, -3.0, -1.0], requires_grad=True)
    ref = torch.tensor([-2.5, -2.0, -1.0])
    policy_kl = torch.tensor([-4.0, -5.0, -6.0], requires_grad=True)
    ref_kl = torch.tensor([-4.3, -5.3, -6.3])
    good = torch.tensor([True, False, True])
    losses, rewards, z0 = kto_loss(
        policy, policy_kl, ref, ref_kl, good, beta=0.5, desirable_weight=2.0, undesirable_weight=1.0
    )
    assert z0.item() == pytest.approx(0.3, abs=1e-6) and not z0.requires_grad
    r = torch.tensor([0.5, -1.0, 0.0])
    expected = [2 * (1 - torch.sigmoid(0.5 * (r[0] - 0.3))), 1 - torch.sigmoid(0.5 * (0.3 - r[1]))]
    expected.append(2 * (1 - torch.sigmoid(0.5 * (r[2] - 0.3))))
    assert losses.tolist() == pytest.approx([float(e) for e in expected], rel=1e-6)
    assert rewards.tolist() == pytest.approx((0.5 * r).tolist())
    losses.sum().backward()
    assert policy_kl.grad is None or not policy_kl.grad.any()  # z0 is detached: no gradient through it
    s = torch.sigmoid(0.5 * (r - 0.3))
    # d/dr of 2(1 - s) = -2 * 0.5 s(1 - s); of 1 - sigmoid(0.5 (z0 - r)) = +0.5 s'(1 - s').
    s1 = torch.sigmoid(0.5 * (0.3 - r[1]))
    grads = [-2 * 0.5 * s[0] * (1 - s[0]), 0.5 * s1 * (1 - s1), -2 * 0.5 * s[2] * (1 - s[2])]
    assert policy.grad.tolist() == pytest.approx([float(g) for g in grads], rel=1e-5)
    # A policy closer to the reference on the mismatched pairs than zero: z0 is clamped at 0.
    _, _, z0 = kto_loss(policy, ref_kl, ref, policy_kl, good, beta=0.5)
    assert z0.item() == 0.0


def test_response_tokens_of_packed_t5_pairs_are_counted_per_pair():
    from lorakit.objectives.simpo import response_tokens

    rows = _pairs(100, seed=7, encoder_decoder=True)
    padded = response_tokens(Seq2SeqPairCollator(0, 0)(rows), encoder_decoder=True)
    packed = response_tokens(PackedSeq2SeqPairCollator(None, None, 0)(rows), encoder_decoder=True)
    assert packed.tolist() == padded.tolist() == [len(r[f"{s}_ids"]) for r in rows for s in SIDES]
