"""The packing contract: a packed row computes exactly what each of its examples computes alone.

Run in the training configuration (train mode, gradient checkpointing on, LoRA attached with a non-zero
update) through the same ModelInputs.logits call the training loop uses, for every causal architecture
lorakit claims and for both mask-taking attention backends.
"""

from __future__ import annotations

import pytest
import torch

from lorakit.data.collate import IGNORE_INDEX, CausalCollator, PackedCausalCollator
from lorakit.doctor import contracts
from lorakit.model.loss import token_loss_sum
from tests.conftest import PACKING_BACKENDS, losses_and_grads, training_config_model

CAUSAL_KINDS = ("llama", "mistral", "qwen2")
# Longer than tiny:mistral's sliding window (64), so the window is exercised inside an example.
LENGTHS = contracts.CAUSAL_LENGTHS
TOL = 1e-4


BACKENDS = PACKING_BACKENDS


def _model(cache_dir, tmp_path, kind: str, backend: str):
    built = training_config_model(cache_dir, tmp_path / "run", backend, name_or_path=f"tiny:{kind}")
    assert built.model.base_model.model.model.gradient_checkpointing
    return built


def _rows(vocab: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in LENGTHS:
        ids = torch.randint(4, vocab, (n,), generator=gen).tolist()
        # Loss on the second half only, like a prompt/response split.
        labels = [IGNORE_INDEX] * (n // 2) + ids[n // 2 :]
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _per_example(built, rows, use_cache: bool = False):
    """(logits, loss sum) of each example run alone and sliced out of one packed row."""
    alone = []
    for r in rows:
        batch = CausalCollator(0)([r])
        logits = built.inputs.logits(built.model, batch, "cpu")
        alone.append((logits[0], token_loss_sum(logits, batch["labels"])))
    packed = PackedCausalCollator(max_tokens=sum(LENGTHS))(rows)
    if use_cache:
        logits = built.model(**built.inputs(packed, "cpu"), use_cache=True).logits
    else:
        logits = built.inputs.logits(built.model, packed, "cpu")
    sliced, start = [], 0
    for r in rows:
        n = len(r["input_ids"])
        labels = packed["labels"][:, start : start + n]
        seg = logits[:, start : start + n]
        sliced.append((seg[0], token_loss_sum(seg, labels)))
        start += n
    return alone, sliced, packed, logits


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_packed_examples_equal_examples_alone(cache_dir, tmp_path, kind, backend):
    """The doctor's packing contract (lorakit.doctor.contracts), in float32 on every backend and kind."""
    built = _model(cache_dir, tmp_path, kind, backend)
    result = contracts.packing(built, _rows(built.model.config.vocab_size), packed=True, tolerance=TOL)
    assert result.passed, result.detail
    assert result.data["examples"] == len(LENGTHS)


@pytest.mark.parametrize("backend", ["varlen_sdpa", "sdpa_mask"])
@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_isolation_holds_with_kv_cache_on(cache_dir, tmp_path, kind, backend):
    """transformers skips its packed-sequence detection when a cache is live; our isolation does not use it."""
    built = _model(cache_dir, tmp_path, kind, backend)
    rows = _rows(built.model.config.vocab_size, seed=1)
    alone, sliced, _, _ = _per_example(built, rows, use_cache=True)
    for (la, _), (lp, _) in zip(alone, sliced, strict=True):
        assert (la - lp).abs().max().item() < TOL


def test_contract_detects_leaks(cache_dir, tmp_path):
    """Negative control: the same comparison on a row packed WITHOUT isolation fails by a wide margin."""
    built = _model(cache_dir, tmp_path, "llama", "sdpa_mask")
    rows = _rows(built.model.config.vocab_size)
    alone, _, packed, _ = _per_example(built, rows)
    leaky = {"input_ids": packed["input_ids"]}  # one long causal sequence, positions not restarting
    logits = built.inputs.logits(built.model, leaky, "cpu")
    second = logits[0, LENGTHS[0] : LENGTHS[0] + LENGTHS[1]]
    assert (second - alone[1][0]).abs().max().item() > 100 * TOL


@pytest.mark.parametrize(("kind", "backend"), [("llama", "varlen_sdpa"), ("qwen2", "sdpa_mask")])
def test_packed_step_loss_and_grads_equal_padded(cache_dir, tmp_path, kind, backend):
    """The token-weighted loss (and its LoRA gradients) of a packed batch equal those of the padded batch."""
    built = _model(cache_dir, tmp_path, kind, backend)
    rows = _rows(built.model.config.vocab_size, seed=2)
    results = losses_and_grads(built, rows, (CausalCollator(0), PackedCausalCollator(max_tokens=512)))
    (padded_loss, padded_n, padded_g), (packed_loss, packed_n, packed_g) = results
    assert padded_n == packed_n == sum(n - n // 2 for n in LENGTHS)
    assert abs(padded_loss - packed_loss) < TOL
    worst = max((padded_g[n] - packed_g[n]).abs().max().item() for n in padded_g)
    assert worst < TOL
