"""GRPO for encoder-decoders (FLAN-T5, T5Gemma; lorakit.objectives.grpo_rollouts and grpo_loss): the prompt
is the encoder's input, the sampled completion the decoder's targets from the family's start token; the
teacher-forced log-probabilities are the ones the sampler drew from; the loss and the LoRA gradients equal the
hand formula (log-probabilities from the model's own label shifting) for each aggregation; resumed mid-window
the source makes exactly the uninterrupted run's rollouts."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from lorakit.evaluation.generate import generate_ids
from lorakit.model.families.start import decoder_start_token_id
from lorakit.objectives.grpo_loss import policy_loss, rollout_log_probs
from lorakit.objectives.grpo_rollouts import DONE, PASS
from lorakit.testing import resolve_model_source
from tests.unit.test_grpo_loss import _hand
from tests.unit.test_grpo_rollouts import _run, _source

TARGETS = {"t5": ["q", "v", "o"], "t5gemma": ["q_proj", "v_proj", "o_proj"]}


def _setup(cache_dir, kind="t5", **grpo):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    path = resolve_model_source(f"tiny:{kind}", cache_dir)  # built once a session
    tok = AutoTokenizer.from_pretrained(path)
    base = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS[kind], init_lora_weights=False)
    # Dropout off (as GRPO trains): the first pass's ratio is then exactly 1.
    return _source(get_peft_model(base, config).eval(), tok, target=3, **grpo)


def _label_log_probs(model, b) -> torch.Tensor:
    """Each completion token's log-probability the way training computes seq2seq losses: labels given, the
    model shifting them right onto its own start token (not the rollout's decoder_input_ids)."""
    labels = b["completions"].masked_fill(b["completion_mask"] == 0, -100)
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=labels).logits
    return -torch.nn.functional.cross_entropy(
        logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none"
    )


@pytest.mark.parametrize("kind", ["t5", "t5gemma"])
def test_rollouts_are_the_decoders_rows_and_score_what_was_sampled(cache_dir, kind):
    model, engine, source, settings = _setup(cache_dir, kind, beta=0.1)
    window = next(iter(source.windows(0, {})))  # made lazily: the second window is never sampled
    assert window.position == {DONE: 2, PASS: 0} and not window.last
    b = window.batches[0]
    start = decoder_start_token_id(model.config)
    assert b["input_ids"].shape[0] == b["completions"].shape[0] == 8
    assert (b["decoder_input_ids"][:, 0] == start).all()
    assert torch.equal(b["decoder_input_ids"][:, 1:], b["completions"][:, :-1])
    assert (b["attention_mask"].sum(1) == b["input_ids"].ne(0).sum(1)).all()  # the source, right-padded
    lengths = b["completion_mask"].sum(1).float()
    assert torch.allclose(b["rewards"], (1 - (lengths - 3).abs() / 3).clamp(min=0))
    assert b["num_target_tokens"] == int(lengths.sum())
    assert b["num_real_tokens"] == int(b["attention_mask"].sum() + lengths.sum())
    # The teacher-forced log-probabilities are those the sampler drew each token from (temperature 1).
    torch.manual_seed(3)
    out = generate_ids(
        model, b["input_ids"], b["attention_mask"], do_sample=True, max_new_tokens=6, top_k=0,
        pad_token_id=0, eos_token_id=1, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    drawn = torch.stack(out.logits, dim=1).float().log_softmax(-1)
    drawn = drawn.gather(-1, out.sequences[:, 1:, None]).squeeze(-1)
    again = {**b, "decoder_input_ids": out.sequences[:, :-1], "completions": out.sequences[:, 1:]}
    with torch.no_grad():
        forced = rollout_log_probs(engine, again)
    assert torch.allclose(forced, drawn, atol=1e-4)
    with torch.no_grad():
        now = rollout_log_probs(engine, b)
    assert "old_logp" not in b  # one pass: the old policy is the current one, no forward for it
    assert not torch.allclose(b["ref_logp"], now, atol=1e-3)  # the adapter was off


@pytest.mark.parametrize("kind", ["t5", "t5gemma"])
def test_loss_and_lora_gradients_equal_the_hand_formula(cache_dir, kind):
    model, engine, source, settings = _setup(cache_dir, kind, beta=0.05)
    b = next(iter(source.windows(0, {}))).batches[0]
    # A later pass: the sampling policy moved away from the current one, so some tokens clip.
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        current = rollout_log_probs(engine, b)
    old = current + torch.randn(current.shape, generator=g) * 0.3
    adv = b["advantages"] + torch.randn(8, generator=g) * 0.5  # no group left without signal
    mask, lora = b["completion_mask"], [p for n, p in model.named_parameters() if "lora_" in n]

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in lora]

    wrong = {}
    for aggregation in ("grpo", "dapo", "dr_grpo"):
        parts = policy_loss(
            rollout_log_probs(engine, b), old, adv, mask, aggregation=aggregation, epsilon=0.2, beta=0.05,
            ref_logp=b["ref_logp"], max_new_tokens=settings.max_new_tokens,
        )  # fmt: skip
        got = grads(parts.loss)
        hand = _hand(_label_log_probs(model, b), old, b["ref_logp"], adv, mask, aggregation, 0.2, 0.05, 6)
        want = grads(hand)
        assert 0 < parts.clip_fraction < 1 and parts.kl > 0 and any(x.abs().sum() > 0 for x in got)
        if parts.loss.item() != pytest.approx(hand.item(), rel=1e-4):
            wrong[aggregation] = f"loss {parts.loss.item()} != {hand.item()}"
        elif not all(torch.allclose(x, y, atol=1e-6, rtol=1e-4) for x, y in zip(got, want, strict=True)):
            wrong[aggregation] = "LoRA gradients differ"
    assert not wrong


@pytest.mark.slow  # trains: 4 + 3 + 1 + 1 optimiser steps of rollouts
def test_a_t5_run_resumed_mid_window_makes_the_uninterrupted_runs_rollouts(cache_dir):
    def setup():
        return _setup(cache_dir, passes=2)

    whole, _ = _run(setup, epochs=1)
    # Step 3 ends the first pass of the second window: its second pass comes from rank_state.
    first, saved = _run(setup, epochs=1, stop_after=3)
    assert saved[-1] == {DONE: 2, PASS: 1}
    assert {"pending.0.decoder_input_ids", "pending.0.completions"} <= set(saved[0])
    rest, _ = _run(setup, epochs=1, resume=saved)
    assert len(first) + len(rest) == len(whole) == 4
    for got, want in zip(first + rest, whole, strict=True):
        assert torch.equal(got, want)
    # What the checkpoint keeps is the window's rollouts themselves (their completions first), not a way
    # to sample them again: sampling is seeded by the micro-batch's place, the weights moved since.
    pending = sorted(k for k in saved[0] if k.startswith("pending.") and k.endswith(".completions"))
    kept = torch.cat([saved[0][k].flatten() for k in pending])
    assert torch.equal(whole[3][-kept.numel() :], kept.to(whole[3].dtype))
