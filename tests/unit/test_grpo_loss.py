"""GRPO's loss (lorakit.objectives.grpo_loss) equals the hand formula, value and gradient, for each
aggregation (grpo, dapo, dr_grpo), with clipping on later passes and the k3 KL to the reference; group
advantages and zero-variance groups; the reference is the base with the adapter switched off."""

from __future__ import annotations

import math

import pytest
import torch

from lorakit.objectives.grpo_loss import (
    STD_EPS,
    adapter_off,
    completion_log_probs,
    group_advantages,
    policy_loss,
)


def test_group_advantages_normalise_within_each_group_and_count_flat_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 3.0, 0.0, 0.0])
    adv, flat = group_advantages(rewards, 4, scale=True)
    assert flat == 1
    for g in range(3):
        r = rewards[4 * g : 4 * g + 4].tolist()
        mean = sum(r) / 4
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / 3)
        for i in range(4):
            assert adv[4 * g + i].item() == pytest.approx((r[i] - mean) / (std + STD_EPS), rel=1e-5)
    assert adv[4:8].tolist() == [0.0] * 4
    centred, _ = group_advantages(rewards, 4, scale=False)
    assert centred[:4].tolist() == [0.5, -0.5, -0.5, 0.5]


def _hand(logp, old, ref, adv, mask, aggregation, eps, beta, max_new):
    """The loss written out token by token (torch scalars, so its gradient is the hand formula's too)."""
    n, t = mask.shape
    per_seq, total, tokens = [], 0.0, 0
    for i in range(n):
        seq, count = 0.0, 0
        for j in range(t):
            if not mask[i, j]:
                continue
            rho = torch.exp(logp[i, j] - old[i, j])
            a = adv[i].item()
            term = -torch.minimum(rho * a, torch.clamp(rho, 1 - eps, 1 + eps) * a)
            d = ref[i, j] - logp[i, j]
            term = term + beta * (torch.exp(d) - d - 1)
            seq, count = seq + term, count + 1
        per_seq.append(seq / max(count, 1))
        total, tokens = total + seq, tokens + count
    if aggregation == "grpo":
        return sum(per_seq) / n
    if aggregation == "dapo":
        return total / tokens
    return total / (n * max_new)


@pytest.mark.parametrize("aggregation", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_loss_and_gradient_equal_the_hand_formula(aggregation, beta):
    g = torch.Generator().manual_seed(0)
    n, t = 4, 6
    # A later pass: the policy has moved away from the one that sampled, far enough that some tokens clip.
    old = -torch.rand(n, t, generator=g) * 3
    base = old + torch.randn(n, t, generator=g) * 0.4
    ref = old + torch.randn(n, t, generator=g) * 0.3
    mask = torch.ones(n, t)
    mask[0, 4:] = 0  # completions of different lengths (right-padded)
    mask[2, 2:] = 0
    adv = torch.tensor([1.2, -0.7, 0.4, -0.9])
    logp = base.clone().requires_grad_(True)
    parts = policy_loss(
        logp, old, adv, mask, aggregation=aggregation, epsilon=0.2, beta=beta, ref_logp=ref, max_new_tokens=8
    )
    parts.loss.backward()
    hand_logp = base.clone().requires_grad_(True)
    hand = _hand(hand_logp, old, ref, adv, mask, aggregation, 0.2, beta, 8)
    hand.backward()
    assert parts.loss.item() == pytest.approx(hand.item(), rel=1e-5)
    assert torch.allclose(logp.grad, hand_logp.grad, atol=1e-6)
    assert (logp.grad[mask == 0] == 0).all()
    ratio = torch.exp(base - old)
    cut = ((ratio < 0.8) & (adv[:, None] < 0)) | ((ratio > 1.2) & (adv[:, None] > 0))
    assert 0 < parts.clip_fraction == pytest.approx((cut & (mask > 0)).sum().item() / mask.sum().item())
    if beta:
        d = ref - base
        assert parts.kl == pytest.approx(
            ((torch.exp(d) - d - 1) * mask).sum().item() / mask.sum().item(), rel=1e-5
        )
    else:
        assert parts.kl == 0.0


def test_first_pass_gradient_is_the_advantage_weighted_score():
    # rho = 1 on a batch's first pass: nothing clips, and d loss / d logp is -A / (tokens of the batch).
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    parts = policy_loss(logp, logp.detach(), adv, torch.ones(2, 2), aggregation="dapo", epsilon=0.2)
    parts.loss.backward()
    assert parts.clip_fraction == 0.0
    assert logp.grad.tolist() == [[-0.25, -0.25], [0.5, 0.5]]


def test_step_totals_split_a_batch_over_micro_batches():
    g = torch.Generator().manual_seed(1)
    logp, old = -torch.rand(4, 5, generator=g), -torch.rand(4, 5, generator=g)
    adv, mask = torch.randn(4, generator=g), (torch.rand(4, 5, generator=g) > 0.3).float()
    for agg in ("grpo", "dapo", "dr_grpo"):
        whole = policy_loss(logp, old, adv, mask, aggregation=agg, epsilon=0.2, max_new_tokens=5).loss
        kw = {
            "aggregation": agg,
            "epsilon": 0.2,
            "max_new_tokens": 5,
            "num_tokens": mask.sum(),
            "num_sequences": 4,
        }
        halves = sum(
            policy_loss(logp[s], old[s], adv[s], mask[s], **kw).loss for s in (slice(0, 2), slice(2, 4))
        )
        assert halves.item() == pytest.approx(whole.item(), rel=1e-6)


def test_the_reference_is_the_base_with_the_adapter_off(tmp_path):
    from peft import LoraConfig, get_peft_model

    from lorakit.testing import build_tiny_model

    base = build_tiny_model("llama", tmp_path / "m")
    ids = torch.randint(5, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = completion_log_probs(base, ids, mask, 3)
    model = get_peft_model(
        base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    with torch.no_grad():
        policy = completion_log_probs(model, ids, mask, 3)
    with adapter_off(model):
        reference = completion_log_probs(model, ids, mask, 3)
    assert reference.shape == (2, 4)
    assert torch.allclose(reference, expected, atol=1e-6) and not torch.allclose(policy, expected, atol=1e-4)
    assert not reference.requires_grad
