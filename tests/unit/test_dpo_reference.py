"""Full fine-tuning DPO: the cached reference log-probabilities give the loss and gradients of a live
reference (a frozen copy of the initial model run alongside), and the cache is reused only for the same
model and data.

The live computation is tests/unit/test_dpo.py's plain one: every sequence alone through the model's plain
forward, -log sigmoid(beta x the log-ratio difference), the reference sequences through the frozen copy.
"""

from __future__ import annotations

import copy
import os

import datasets
import pytest
import torch
import torch.nn.functional as F

from lorakit.data.pair_collate import (
    BATCH_KEY,
    REFERENCE_COLUMNS,
    CausalPairCollator,
    PackedCausalPairCollator,
    Seq2SeqPairCollator,
    WithReference,
    add_reference,
)
from lorakit.data.prepare import PreparedData
from lorakit.data.tokenize import Lengths
from lorakit.errors import InferenceError
from lorakit.model import build_model
from lorakit.objectives.dpo import DpoObjective
from lorakit.objectives.dpo_reference import attach_reference, compute_reference, reference_key
from lorakit.recipe.known_objectives import check_objective
from tests.conftest import tiny_recipe
from tests.unit.test_dpo import BETA, TOL, _logp_alone, _pairs

SIDES = ("chosen", "rejected")


def _full_recipe(cache_dir, tmp_path, kind: str, **model):
    return tiny_recipe(
        cache_dir,
        tmp_path / "run",
        model={"name_or_path": f"tiny:{kind}", "dtype": "float32", "gradient_checkpointing": True, **model},
        method={"kind": "full"},
        data={
            "source": "builtin:preference_pairs",
            "input_column": "question",
            "prompt_template": "{input}\n",
            "packing": False,
        },
        train={"objective": "dpo", "micro_batch_size": 2},
        eval={"generate": False},
    )


def _full_model(recipe):
    """The built model without dropout (random per token), in train mode; and its frozen initial copy."""
    model = build_model(recipe)
    for m in model.model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    initial = copy.deepcopy(model.model).eval().requires_grad_(False)
    # Training moved the weights: the policy now differs from its reference.
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    model.model.train()
    return model, initial


def _grads(model, loss_fn):
    model.zero_grad()
    loss = loss_fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_cached_reference_equals_live_reference(cache_dir, tmp_path, kind):
    recipe = _full_recipe(cache_dir, tmp_path, kind)
    check_objective(recipe)  # full fine-tuning DPO is a valid recipe now
    built, initial = _full_model(recipe)
    model, enc_dec = built.model, kind == "t5"
    rows = _pairs(model.config.vocab_size, seed=2, encoder_decoder=enc_dec)
    objective = DpoObjective(BETA, encoder_decoder=enc_dec, cached_reference=True)
    padded = Seq2SeqPairCollator(0, model.config.decoder_start_token_id) if enc_dec else CausalPairCollator(0)
    ds = datasets.Dataset.from_list(rows)
    # The initial model scores every pair (in batches of 2, as before training), its table rides in the rows.
    table = compute_reference(initial, built.inputs, objective, ds, padded, batch_size=2)
    ds = add_reference(ds, table.float(), "k")
    assert set(REFERENCE_COLUMNS) <= set(ds.column_names)

    def live():
        terms = []
        for row in rows:
            with torch.no_grad():
                rc, rr = (_logp_alone(initial, row, s, enc_dec) for s in SIDES)
            pc, pr = (_logp_alone(model, row, s, enc_dec) for s in SIDES)
            terms.append(-F.logsigmoid(BETA * ((pc - rc) - (pr - rr))))
        return torch.stack(terms).sum()

    reference = _grads(model, live)
    collators = [padded] + ([] if enc_dec else [PackedCausalPairCollator(max_tokens=200)])
    for collator in collators:
        batch = WithReference(collator)(list(ds))
        assert batch[BATCH_KEY].shape == (2 * len(rows),)
        ours = _grads(model, lambda b=batch: objective.loss(model, built.inputs, b, "cpu")[0])
        torch.testing.assert_close(ours[0], reference[0], atol=TOL, rtol=TOL)
        assert ours[1].keys() == reference[1].keys() and len(ours[1]) == len(list(model.parameters()))
        for name, grad in reference[1].items():
            torch.testing.assert_close(ours[1][name], grad, atol=TOL, rtol=1e-4, msg=name)
    # Pairs without the table are refused with the reason, not scored against nothing.
    with pytest.raises(InferenceError, match="initial model's log-probabilities"):
        objective.loss(model, built.inputs, padded(rows), "cpu")


class _Counting:
    """A model wrapper that counts forwards (the engine stand-in attach_reference drives)."""

    def __init__(self, model):
        self.module, self.device, self.calls = model, model.device, 0

    def __call__(self, **kwargs):
        self.calls += 1
        return self.module(**kwargs)


def test_reference_cached_with_the_dataset_and_keyed_by_model(cache_dir, tmp_path):
    recipe = _full_recipe(cache_dir, tmp_path, "llama")
    built, _ = _full_model(recipe)
    model = built.model.eval()
    rows = _pairs(model.config.vocab_size, seed=4, encoder_decoder=False)
    splits = datasets.Dataset.from_list(rows), datasets.Dataset.from_list(rows[:2])
    data = PreparedData(*splits, Lengths(max_length=64), tmp_path / "datasets" / "abc", True)
    objective = DpoObjective(BETA, encoder_decoder=False, cached_reference=True)
    source = tmp_path / "weights"
    source.mkdir()
    (source / "model.safetensors").write_bytes(b"x")
    collator = WithReference(CausalPairCollator(0))

    def attach(engine, recipe=recipe):
        return attach_reference(recipe, engine, built.inputs, objective, str(source), data, collator)

    first = _Counting(model)
    found = attach(first)
    assert first.calls == 2 + 1  # 3 train pairs in batches of 2, 2 eval pairs in one
    files = list((data.path / "reference").iterdir())
    assert len(files) == 1 and files[0].name == f"{reference_key(recipe, str(source), data)}.safetensors"
    with torch.no_grad():  # one batch of 3, not batches of 2: padding changes nothing beyond rounding
        logp = objective.log_probs(model, built.inputs, CausalPairCollator(0)(rows), "cpu")
    torch.testing.assert_close(
        torch.tensor(found.train[REFERENCE_COLUMNS[0]], dtype=torch.float64),
        logp[0::2].double(),
        atol=TOL,
        rtol=TOL,
    )
    torch.testing.assert_close(
        torch.tensor(found.eval[REFERENCE_COLUMNS[1]], dtype=torch.float64),
        logp[1:4:2].double(),
        atol=TOL,
        rtol=TOL,
    )

    # A rerun (or a resume, whose weights have moved) reads the table instead of scoring the pairs.
    again = _Counting(model)
    assert list(attach(again).train) == list(found.train) and again.calls == 0
    # Another dtype, or changed weight files, is another model: scored anew.
    other = recipe.model_copy(update={"model": recipe.model.model_copy(update={"dtype": "bfloat16"})})
    assert reference_key(other, str(source), data) != reference_key(recipe, str(source), data)
    before = reference_key(recipe, str(source), data)
    os.utime(source / "model.safetensors", ns=(1, 1))
    assert reference_key(recipe, str(source), data) != before
    third = _Counting(model)
    attach(third)
    assert third.calls == 3 and len(list((data.path / "reference").iterdir())) == 2


def test_ranks_score_their_shares_in_lockstep(cache_dir, tmp_path, monkeypatch):
    """Each rank scores its share with as many forwards as every other (ZeRO-3 gathers are collective; a
    rank out of rows runs a stand-in), and the shares add up to the one-process table."""
    from lorakit import dist

    recipe = _full_recipe(cache_dir, tmp_path, "llama")
    built, _ = _full_model(recipe)
    model = built.model.eval()
    ds = datasets.Dataset.from_list(_pairs(model.config.vocab_size, seed=6, encoder_decoder=False))
    objective = DpoObjective(BETA, encoder_decoder=False, cached_reference=True)
    collator = CausalPairCollator(0)
    whole = compute_reference(model, built.inputs, objective, ds, collator, batch_size=1)
    shares, calls = [], []
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    for rank in (0, 1):
        monkeypatch.setattr(dist, "rank", lambda rank=rank: rank)
        engine = _Counting(model)
        shares.append(compute_reference(engine, built.inputs, objective, ds, collator, batch_size=1))
        calls.append(engine.calls)
    # 3 pairs on 2 ranks, one a batch: rank 0 scores pairs 0 and 2, rank 1 pair 1 and a stand-in.
    assert calls == [2, 2]
    assert (shares[1][[0, 2]] == 0).all() and (shares[0][1] == 0).all()
    torch.testing.assert_close(shares[0] + shares[1], whole, atol=TOL, rtol=TOL)
