"""Shared-prompt packing of DPO pairs (lorakit.data.pair_collate, lorakit.model.shared_prompt) and
dpo.loss simpo (lorakit.objectives.simpo), on one tiny Llama where they can share it.

A pair packed as [prompt][chosen][rejected] must give every response the log-probability it has after the
prompt alone: the fixed batch's log-probs, DPO loss and LoRA gradients equal the padded (unpacked) batch's,
which tests/unit/test_dpo.py checks against a plain reference computation, on every backend that shares
the prompt; the rejected response never sees the chosen one, and no pair sees a neighbour. SimPO's loss and
gradients equal its plain formula (each response alone, its log-probability averaged over its tokens),
without a pass with the adapter turned off.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from lorakit.data.batching import make_batching
from lorakit.data.pair_collate import (
    CausalPairCollator,
    Seq2SeqPairCollator,
    SharedPromptCollator,
    shared_lengths,
)
from lorakit.errors import RecipeError
from lorakit.model import fused_attention as fa
from lorakit.model.inputs import ModelInputs
from lorakit.model.shared_prompt import SharedPromptSpans, _mask_argument, sharing_problem, tree_mask
from lorakit.objectives.dpo import DpoObjective, preference_loss, reference_model
from lorakit.objectives.simpo import response_tokens, simpo_loss
from tests.conftest import tiny_recipe, training_config_model
from tests.unit.test_dpo import BETA, _assert_same, _logp_alone, _loss_and_grads, _pairs

SIMPO_BETA, SIMPO_GAMMA = 2.0, 0.3
TOL = 1e-5
# (prompt, chosen, rejected) lengths; the last pair is longer than tiny:mistral's sliding window (64), so
# the window reaches from the rejected response into the prompt.
SPANS = ((7, 5, 9), (12, 3, 4), (1, 11, 6), (40, 20, 30))


def _rows(vocab: int, seed: int = 0, spans=SPANS) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(4, vocab, (n,), generator=gen).tolist()

    return [
        {"prompt_ids": ids(p), "chosen_ids": ids(c - 1) + [1], "rejected_ids": ids(r - 1) + [1]}
        for p, c, r in spans
    ]


def test_collator_lays_out_one_segment_per_pair():
    rows = [
        {"prompt_ids": [5, 6], "chosen_ids": [7, 1], "rejected_ids": [8, 9, 1]},
        {"prompt_ids": [10], "chosen_ids": [11, 1], "rejected_ids": [1]},
    ]
    batch = SharedPromptCollator(max_tokens=12)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 1, 8, 9, 1, 10, 11, 1, 1]]
    # The rejected positions continue from the prompt's end, as after the prompt alone.
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 2, 3, 4, 0, 1, 2, 1]]
    assert batch["pair_spans"].tolist() == [[2, 2, 3], [1, 2, 1]]
    # The first chosen and the first rejected token are both scored from the prompt's last token.
    assert batch["target_index"].tolist() == [1, 2, 1, 4, 5, 7, 8, 7]
    assert batch["target_ids"].tolist() == [7, 1, 8, 9, 1, 11, 1, 1]
    assert batch["target_sequence"].tolist() == [0, 0, 1, 1, 1, 2, 2, 3]
    assert batch["num_real_tokens"] == 11 and batch["num_target_tokens"] == 8 and batch["num_pairs"] == 2
    with pytest.raises(ValueError, match="exceeds max_tokens=10"):
        SharedPromptCollator(max_tokens=10)(rows)


def test_tree_mask():
    allowed = tree_mask(SharedPromptSpans([(2, 1, 2), (1, 1, 1)]), "cpu").int()
    expected = [
        [1, 0, 0, 0, 0, 0, 0, 0],  # prompt
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],  # chosen
        [1, 1, 0, 1, 0, 0, 0, 0],  # rejected: the prompt and itself, not the chosen token
        [1, 1, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 1, 0, 0],  # the next pair sees only itself
        [0, 0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1, 0, 1],
    ]
    assert allowed.tolist() == expected
    # A window of 2 positions: the rejected token at position 3 sees positions 2 and 3 only.
    spans = SharedPromptSpans([(2, 1, 2)])
    windowed = tree_mask(spans, "cpu", window=2).int()
    assert windowed[4].tolist() == [0, 0, 0, 1, 1]
    # Models mixing full and sliding layers (Qwen2 and others' config.layer_types): one mask per type.
    config = types.SimpleNamespace(sliding_window=2)
    masks = _mask_argument(
        spans, "eager", torch.float32, "cpu", config, ["full_attention", "sliding_attention"]
    )
    assert torch.equal(masks["sliding_attention"][0, 0] == 0, windowed.bool())
    assert torch.equal(masks["full_attention"][0, 0] == 0, tree_mask(spans, "cpu").bool())
    assert masks["full_attention"].min() == torch.finfo(torch.float32).min


def _terms(built, rows, collator, inputs=None):
    """(policy log-probs, reference log-probs, DPO loss, LoRA gradients) of one batch, `inputs` (default the
    build's) turning it into forward arguments: the objective's reference and policy passes, its loss."""
    model, objective = built.model, DpoObjective(BETA, encoder_decoder=False)
    batch = collator(rows)
    inputs = inputs or built.inputs
    model.zero_grad()
    with reference_model(model):
        ref = objective.log_probs(model, inputs, batch, "cpu")
    policy = objective.log_probs(model, inputs, batch, "cpu")
    loss = preference_loss(policy[0::2], policy[1::2], ref[0::2], ref[1::2], beta=BETA)[0].sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return policy.detach(), ref, loss.detach(), grads


def _force_reference_varlen(monkeypatch):
    """torch's varlen_attn (CUDA-only) replaced by its documented semantics, and taken on this CPU."""
    import torch.nn.attention.varlen as torch_varlen

    import lorakit.model.shared_prompt as shared_prompt
    from tests.integration.test_fused_attention import _reference_varlen

    monkeypatch.setattr(torch_varlen, "varlen_attn", _reference_varlen)
    monkeypatch.setattr(shared_prompt, "choose_kernel", lambda *a, **k: fa.VARLEN)


def _shared_equals_padded(built, monkeypatch, paths: tuple[str, ...]):
    """Shared-prompt rows through each path equal the padded pairs: log-probs, loss, LoRA gradients.
    loop: per-group SDPA; varlen: the CUDA path's layout against a CPU reference of torch's kernel; sdpa /
    eager: the tree as a boolean / additive 4-D mask (the model's SDPA takes either)."""
    rows = _rows(built.model.config.vocab_size)
    padded = _terms(built, rows, CausalPairCollator(0))
    assert any("lora_A" in n for n in padded[3])
    for path in paths:
        inputs = None
        if path == "varlen":
            _force_reference_varlen(monkeypatch)
            built.inputs.kernels.calls.clear()  # the loop path's calls, counted in the same model's log
        elif path in ("sdpa", "eager"):
            inputs = ModelInputs(built.model.config, path, torch.float32)
        shared = _terms(built, rows, SharedPromptCollator(max_tokens=512), inputs)
        for a, b in zip(shared[:3], padded[:3], strict=True):
            torch.testing.assert_close(a, b, atol=TOL, rtol=TOL, msg=path)
        assert shared[3].keys() == padded[3].keys()
        for name in padded[3]:
            torch.testing.assert_close(
                shared[3][name], padded[3][name], atol=TOL, rtol=1e-4, msg=f"{path} {name}"
            )
        if path == "varlen":
            calls = built.inputs.kernels.calls
            assert calls["causal", fa.VARLEN] > 0 and calls["causal", fa.LOOP] == 0
            monkeypatch.undo()


@pytest.fixture(scope="module")
def llama(cache_dir, tmp_path_factory):
    """The tiny Llama as packed training builds it (lorakit_varlen_sdpa), shared by this module's tests."""
    return training_config_model(
        cache_dir, tmp_path_factory.mktemp("run"), "varlen_sdpa", name_or_path="tiny:llama"
    )


def test_shared_prompt_equals_unpacked_llama(llama, monkeypatch):
    _shared_equals_padded(llama, monkeypatch, ("loop", "varlen", "sdpa"))


def test_shared_prompt_equals_unpacked_mistral(cache_dir, tmp_path, monkeypatch):
    """A sliding window (64) reaching from the rejected tokens into the prompt (the tiny Llama and Mistral
    both group their KV heads, 4 query heads over 2)."""
    built = training_config_model(cache_dir, tmp_path / "run", "varlen_sdpa", name_or_path="tiny:mistral")
    _shared_equals_padded(built, monkeypatch, ("loop", "eager"))


def test_a_pair_sees_neither_its_chosen_response_nor_its_neighbours(llama):
    vocab = llama.model.config.vocab_size
    objective = DpoObjective(BETA, encoder_decoder=False)
    collate = SharedPromptCollator(max_tokens=512)

    def logps(rows):
        with torch.no_grad():
            return objective.log_probs(llama.model, llama.inputs, collate(rows), "cpu")

    rows = _rows(vocab)
    base = logps(rows)
    # A different neighbouring pair (pair 1, between pairs 0 and 2) changes nothing of the others.
    neighbour = [*rows[:1], _rows(vocab, seed=7)[1], *rows[2:]]
    moved = logps(neighbour)
    torch.testing.assert_close(moved[[0, 1, 4, 5, 6, 7]], base[[0, 1, 4, 5, 6, 7]], atol=1e-5, rtol=0)
    assert (moved[2:4] - base[2:4]).abs().min() > 1e-3
    # A different chosen response (same length) leaves its pair's rejected log-probability alone.
    other = [dict(rows[0], chosen_ids=_rows(vocab, seed=8)[0]["chosen_ids"]), *rows[1:]]
    changed = logps(other)
    assert abs(changed[0] - base[0]) > 1e-3
    torch.testing.assert_close(changed[1:], base[1:], atol=1e-5, rtol=0)


def _simpo_reference(model, rows) -> torch.Tensor:
    """Each response alone after its prompt, its log-probability averaged over its tokens."""
    terms = []
    for row in rows:
        chosen, rejected = (
            _logp_alone(model, row, side, False) / len(row[f"{side}_ids"]) for side in ("chosen", "rejected")
        )
        terms.append(-F.logsigmoid(SIMPO_BETA * (chosen - rejected) - SIMPO_GAMMA))
    return torch.stack(terms).sum()


def test_simpo_matches_the_formula_without_a_reference_pass(llama, monkeypatch):
    model = llama.model
    rows = _pairs(model.config.vocab_size, seed=2, encoder_decoder=False)
    reference = _loss_and_grads(model, lambda: _simpo_reference(model, rows))

    def refuse():
        raise AssertionError("SimPO turned the adapter off: it has no reference model")

    monkeypatch.setattr(model, "disable_adapter", refuse)
    objective = DpoObjective(SIMPO_BETA, "simpo", encoder_decoder=False, simpo_gamma=SIMPO_GAMMA)
    for collator in (CausalPairCollator(0), SharedPromptCollator(max_tokens=200)):
        batch = collator(rows)
        ours = _loss_and_grads(model, lambda b=batch: objective.loss(model, llama.inputs, b, "cpu")[0])
        _assert_same(ours, reference)
    assert reference[0] > 0


def test_the_sampler_counts_the_prompt_once(cache_dir, tmp_path, monkeypatch):
    import datasets

    from lorakit.data.tokenize import Lengths
    from lorakit.testing import tiny_config

    rows = _rows(100, spans=((30, 5, 5),) * 6)
    train = datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in rows[0]} | {"length": [70] * 6})
    data = type("Data", (), {"train": train, "lengths": Lengths(max_length=35)})()
    assert shared_lengths(train) == [40] * 6

    def batching(attention="lorakit_varlen_sdpa", **dpo):
        recipe = tiny_recipe(
            cache_dir,
            tmp_path / "run",
            model={"name_or_path": "tiny:llama"},
            data={"source": "builtin:preference_pairs", "input_column": "question", "packing": True},
            train={"objective": "dpo", "max_steps": 2, "max_tokens": 80},
            eval={"generate": False},
            dpo=dpo,
        )
        tokenizer = types.SimpleNamespace(pad_token_id=0)
        problem = sharing_problem(attention)  # what the model build's attention tells the data
        return make_batching(
            recipe,
            data,
            tokenizer,
            tiny_config("llama"),
            packing=True,
            share_prompt_problem=problem,
            layout="pairs",
        )

    # 80 tokens hold two pairs of 30 + 5 + 5, not one of 2 x 30 + 5 + 5 = 70.
    shared = batching()
    assert isinstance(shared.collator.collator, SharedPromptCollator)  # inside WithReference
    assert [len(b) for b in shared.sampler] == [2, 2, 2]
    assert [len(b) for b in batching(share_prompt=False).sampler] == [1] * 6
    # flash_attention_2 cannot run the tree: the pairs are packed as two sequences, and the console says so.
    said = []
    monkeypatch.setattr("lorakit.data.batching._say", said.append)
    assert not isinstance(batching("flash_attention_2").collator.collator, SharedPromptCollator)
    assert said and "flash_attention_2" in said[0] and sharing_problem("lorakit_varlen_sdpa") is None


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
