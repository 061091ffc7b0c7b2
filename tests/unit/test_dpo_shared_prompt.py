"""Shared-prompt packing of DPO pairs (lorakit.data.preference_shared, lorakit.model.shared_prompt).

A pair packed as [prompt][chosen][rejected] must give every response the log-probability it has after the
prompt alone: the fixed batch's log-probs, DPO loss and LoRA gradients equal the padded (unpacked) batch's,
which tests/unit/test_dpo.py checks against a plain reference computation, on every backend that shares
the prompt; the rejected response never sees the chosen one, and no pair sees a neighbour.
"""

from __future__ import annotations

import types

import pytest
import torch

from lorakit.data.preference_batching import CausalPairCollator, preference_batching
from lorakit.data.preference_shared import SharedPromptCollator, shared_lengths
from lorakit.engine.dpo import DpoObjective
from lorakit.model import fused_attention as fa
from lorakit.model import varlen
from lorakit.model.shared_prompt import SharedPromptSpans, sharing_problem, tree_mask
from tests.conftest import tiny_recipe, training_config_model
from tests.unit.test_dpo import BETA, _assert_same, _loss_and_grads

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
    windowed = tree_mask(SharedPromptSpans([(2, 1, 2)]), "cpu", window=2).int()
    assert windowed[4].tolist() == [0, 0, 0, 1, 1]


def _log_probs_loss_grads(built, rows, collator):
    objective = DpoObjective(BETA, encoder_decoder=False)
    batch = collator(rows)
    with torch.no_grad():
        logps = objective.log_probs(built.model, built.inputs, batch, "cpu")
    result = _loss_and_grads(built.model, lambda: objective.loss(built.model, built.inputs, batch, "cpu")[0])
    return logps, result


@pytest.fixture
def reference_varlen(monkeypatch):
    """torch's varlen_attn (CUDA-only) replaced by its documented semantics, taken on this CPU."""
    import torch.nn.attention.varlen as torch_varlen

    from tests.integration.test_fused_attention import _reference_varlen

    monkeypatch.setattr(torch_varlen, "varlen_attn", _reference_varlen)
    monkeypatch.setattr(varlen, "choose_kernel", lambda *a, **k: fa.VARLEN)
    import lorakit.model.shared_prompt as sp

    monkeypatch.setattr(sp, "choose_kernel", lambda *a, **k: fa.VARLEN)
    fa.KERNELS_USED.clear()


@pytest.mark.parametrize(
    ("kind", "backend", "kernel"),
    [
        ("llama", "varlen_sdpa", "loop"),
        ("llama", "varlen_sdpa", "varlen"),
        ("llama", "sdpa_mask", None),
        ("qwen2", "varlen_sdpa", "varlen"),  # grouped KV heads through the gathered keys
        ("mistral", "eager", None),  # the sliding window across the prompt, additive mask
        ("mistral", "varlen_sdpa", "loop"),
    ],
)
def test_shared_prompt_equals_unpacked(cache_dir, tmp_path, request, kind, backend, kernel):
    if kernel == "varlen":
        request.getfixturevalue("reference_varlen")
    built = training_config_model(cache_dir, tmp_path / "run", backend, name_or_path=f"tiny:{kind}")
    rows = _rows(built.model.config.vocab_size)
    padded_logps, padded = _log_probs_loss_grads(built, rows, CausalPairCollator(0))
    shared_logps, shared = _log_probs_loss_grads(built, rows, SharedPromptCollator(max_tokens=512))
    torch.testing.assert_close(shared_logps, padded_logps, atol=1e-5, rtol=1e-5)
    _assert_same(shared, padded)
    if kernel == "varlen":
        assert fa.KERNELS_USED["causal", fa.VARLEN] > 0 and fa.KERNELS_USED["causal", fa.LOOP] == 0


def test_a_pair_sees_neither_its_chosen_response_nor_its_neighbours(cache_dir, tmp_path):
    built = training_config_model(cache_dir, tmp_path / "run", "varlen_sdpa", name_or_path="tiny:llama")
    vocab = built.model.config.vocab_size
    objective = DpoObjective(BETA, encoder_decoder=False)
    collate = SharedPromptCollator(max_tokens=512)

    def logps(rows):
        with torch.no_grad():
            return objective.log_probs(built.model, built.inputs, collate(rows), "cpu")

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


def test_the_sampler_counts_the_prompt_once(cache_dir, tmp_path, monkeypatch):
    import datasets

    from lorakit.data.tokenize import Lengths
    from lorakit.testing import tiny_config

    rows = _rows(100, spans=((30, 5, 5),) * 6)
    train = datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in rows[0]} | {"length": [70] * 6})
    data = type("Data", (), {"train": train, "lengths": Lengths(max_length=35)})()
    assert shared_lengths(train) == [40] * 6

    def batching(**dpo):
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
        return preference_batching(recipe, data, tokenizer, tiny_config("llama"), packing=True)

    # 80 tokens hold two pairs of 30 + 5 + 5, not one of 2 x 30 + 5 + 5 = 70.
    shared = batching()
    assert isinstance(shared.collator, SharedPromptCollator)
    assert [len(b) for b in shared.sampler] == [2, 2, 2]
    assert [len(b) for b in batching(share_prompt=False).sampler] == [1] * 6
    # flash_attention_2 cannot run the tree: the pairs are packed as two sequences, and the console says so.
    monkeypatch.setattr("lorakit.data.preference_shared.resolved_attention", lambda *a: "flash_attention_2")
    said = []
    monkeypatch.setattr("lorakit.data.preference_shared._say", said.append)
    assert not isinstance(batching().collator, SharedPromptCollator)
    assert said and "flash_attention_2" in said[0] and sharing_problem("lorakit_varlen_sdpa") is None
