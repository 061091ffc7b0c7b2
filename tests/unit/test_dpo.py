"""DPO on a fixed batch equals a plain reference computation, packed equals padded (tiny Llama, tiny T5).

The reference computation runs every sequence alone through the peft model's plain forward (adapter on,
then inside disable_adapter()), sums the response tokens' log-softmax and applies -log sigmoid(beta x the
log-ratio difference); the objective must give the same loss and the same LoRA gradients to fp32 tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lorakit.data.pair_collate import CausalPairCollator, PackedCausalPairCollator, Seq2SeqPairCollator
from lorakit.model.loss import sequence_log_probs
from lorakit.objectives.dpo import DpoObjective, metric_sums, preference_loss
from tests.conftest import training_config_model

BETA = 0.5
TOL = 1e-5


def _pairs(vocab: int, seed: int, encoder_decoder: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(4, vocab, (n,), generator=gen).tolist()

    rows = []
    for prompt, chosen, rejected in ((7, 5, 9), (12, 3, 4), (4, 11, 6)):
        if encoder_decoder:
            rows.append(
                {
                    "input_ids": ids(prompt) + [1],
                    "chosen_ids": ids(chosen) + [1],
                    "rejected_ids": ids(rejected) + [1],
                }
            )
        else:
            rows.append(
                {
                    "prompt_ids": ids(prompt),
                    "chosen_ids": ids(chosen) + [1],
                    "rejected_ids": ids(rejected) + [1],
                }
            )
    return rows


def _logp_alone(model, row: dict, side: str, encoder_decoder: bool) -> torch.Tensor:
    """Summed log-probability of one response, its sequence run alone through the model's plain forward."""
    response = torch.tensor([row[f"{side}_ids"]])
    if encoder_decoder:
        decoder = torch.cat([torch.zeros((1, 1), dtype=torch.long), response[:, :-1]], dim=1)
        logits = model(
            input_ids=torch.tensor([row["input_ids"]]), decoder_input_ids=decoder, use_cache=False
        ).logits
        return torch.log_softmax(logits[0].float(), -1).gather(-1, response[0, :, None]).sum()
    ids = torch.tensor([row["prompt_ids"] + row[f"{side}_ids"]])
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
    start = len(row["prompt_ids"]) - 1
    return torch.log_softmax(logits[start:].float(), -1).gather(-1, ids[0, start + 1 :, None]).sum()


def _reference(model, rows, encoder_decoder: bool) -> torch.Tensor:
    terms = []
    for row in rows:
        with torch.no_grad(), model.disable_adapter():
            rc, rr = (_logp_alone(model, row, s, encoder_decoder) for s in ("chosen", "rejected"))
        pc, pr = (_logp_alone(model, row, s, encoder_decoder) for s in ("chosen", "rejected"))
        terms.append(-F.logsigmoid(BETA * ((pc - rc) - (pr - rr))))
    return torch.stack(terms).sum()


def _loss_and_grads(model, loss_fn):
    model.zero_grad()
    loss = loss_fn()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _setup(cache_dir, tmp_path, backend: str, model: str, seed: int):
    """A tiny model built as training builds it, three random pairs for it and a DPO objective."""
    built = training_config_model(cache_dir, tmp_path / "run", backend, name_or_path=f"tiny:{model}")
    enc_dec = built.model.config.is_encoder_decoder
    rows = _pairs(built.model.config.vocab_size, seed=seed, encoder_decoder=enc_dec)
    return built, rows, DpoObjective(BETA, encoder_decoder=enc_dec)


def _encoder_passes(model, fn):
    """(fn's loss and gradients, how many times the encoder ran meanwhile)."""
    calls = []
    hook = model.get_encoder().register_forward_hook(lambda *_: calls.append(1))
    try:
        return _loss_and_grads(model, fn), len(calls)
    finally:
        hook.remove()


def _assert_same(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, atol=TOL, rtol=TOL)
    assert grads_a.keys() == grads_b.keys() and any("lora_A" in n for n in grads_a)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=TOL, rtol=1e-4, msg=name)


@pytest.mark.parametrize("backend", ["varlen_sdpa", "sdpa_mask"])
def test_causal_dpo_matches_reference_and_packed_matches_padded(cache_dir, tmp_path, backend):
    built, rows, objective = _setup(cache_dir, tmp_path, backend, "llama", seed=0)
    model = built.model

    def run(collator):
        batch = collator(rows)
        assert batch["num_pairs"] == len(rows)
        return lambda: objective.loss(model, built.inputs, batch, "cpu")[0]

    reference = _loss_and_grads(model, lambda: _reference(model, rows, False))
    padded = _loss_and_grads(model, run(CausalPairCollator(0)))
    packed = _loss_and_grads(model, run(PackedCausalPairCollator(max_tokens=200)))
    _assert_same(padded, reference)
    _assert_same(packed, padded)
    assert reference[0] > 0 and torch.isfinite(reference[0])


def test_t5_dpo_encodes_once_and_matches_reference(cache_dir, tmp_path):
    built, rows, objective = _setup(cache_dir, tmp_path, "sdpa_mask", "t5", seed=1)
    model = built.model
    batch = Seq2SeqPairCollator(0, model.config.decoder_start_token_id)(rows)
    ours, passes = _encoder_passes(model, lambda: objective.loss(model, built.inputs, batch, "cpu")[0])
    # One encoder pass for the policy and one for the reference, each shared by both responses.
    assert passes == 2
    _assert_same(ours, _loss_and_grads(model, lambda: _reference(model, rows, True)))


def test_preference_losses_and_metrics():
    pc, pr = torch.tensor([-3.0, -5.0, -2.0]), torch.tensor([-4.0, -1.0, -2.0])
    rc, rr = torch.tensor([-3.5, -4.0, -2.0]), torch.tensor([-3.5, -2.0, -2.0])
    h = (pc - rc) - (pr - rr)
    losses, chosen, rejected = preference_loss(pc, pr, rc, rr, beta=0.2)
    torch.testing.assert_close(losses, -F.logsigmoid(0.2 * h))
    smooth, _, _ = preference_loss(pc, pr, rc, rr, beta=0.2, label_smoothing=0.1)
    torch.testing.assert_close(smooth, -0.9 * F.logsigmoid(0.2 * h) - 0.1 * F.logsigmoid(-0.2 * h))
    ipo, _, _ = preference_loss(pc, pr, rc, rr, beta=0.2, loss="ipo")
    torch.testing.assert_close(ipo, (h - 2.5) ** 2)
    sums = metric_sums(chosen, rejected)
    torch.testing.assert_close(sums["rewards/chosen"], (0.2 * (pc - rc)).sum())
    torch.testing.assert_close(sums["margin"], (chosen - rejected).sum())
    # Pair 0 wins (h = 1), pair 1 loses (h = -5), pair 2 ties (h = 0): half a win.
    assert sums["accuracy"].item() == pytest.approx(100 * 1.5)


def test_sequence_log_probs_chunked_equals_whole():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 9, 17, generator=gen, requires_grad=True)
    labels = torch.randint(0, 17, (2, 9), generator=gen)
    labels[0, :3] = -100
    seq = torch.tensor([[0] * 5 + [1] * 4, [2] * 9])
    whole = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    whole = torch.zeros(3).index_add(0, seq.reshape(-1), (whole * (labels != -100)).reshape(-1))
    (g_whole,) = torch.autograd.grad(whole @ torch.tensor([1.0, -2.0, 0.5]), logits)
    chunked = sequence_log_probs(logits, labels, seq, 3, chunk_elements=17 * 4)
    (g_chunked,) = torch.autograd.grad(chunked @ torch.tensor([1.0, -2.0, 0.5]), logits)
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(g_chunked, g_whole)
