"""The evaluation loop runs without autograd: no graph (and no activations kept for one) while scoring."""

from __future__ import annotations

import datasets
import torch
from transformers import AutoModelForCausalLM

from lorakit.data.collate import CausalCollator
from lorakit.evaluation.generate import evaluate_model
from lorakit.model.inputs import ModelInputs
from lorakit.testing import tiny_config


class _Engine:
    """The engine surface evaluate_model uses: the module, its device, and the forward."""

    def __init__(self, model):
        self.module, self.device = model, torch.device("cpu")

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_the_eval_loss_is_computed_without_a_graph():
    torch.manual_seed(0)
    config = tiny_config("llama")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    inputs = ModelInputs(model.config, "sdpa", torch.float32)
    grad_enabled = []
    real = inputs.logits

    def logits(*args, **kwargs):
        out = real(*args, **kwargs)
        grad_enabled.append((torch.is_grad_enabled(), out.requires_grad))
        return out

    inputs.logits = logits
    rows = [{"input_ids": list(range(5, 5 + n)), "labels": list(range(5, 5 + n))} for n in (6, 9, 4)]
    engine = _Engine(model)
    out = evaluate_model(
        engine,
        inputs,
        datasets.Dataset.from_list(rows),
        CausalCollator(0),
        tokenizer=None,
        batch_size=2,
        generate=False,
        max_new_tokens=1,
        num_beams=1,
        zero3=False,
    )
    assert out["loss"] > 0 and grad_enabled == [(False, False)] * 2


def test_generate_ids_runs_in_eval_mode_and_puts_every_submodules_mode_back():
    """A peft model is in train mode over a base that from_pretrained left in eval mode: generating must not
    turn the base's dropout on for the steps after it (putting the root's mode back on all would)."""
    import torch

    from lorakit.evaluation.generate import generate_ids

    class _Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = torch.nn.Dropout(0.5)
            self.seen: list[bool] = []

        def generate(self, input_ids, attention_mask, **kwargs):
            self.seen = [m.training for m in self.modules()]
            return input_ids

    model = _Model()
    model.base.eval()
    ids = torch.ones(1, 3, dtype=torch.long)
    assert generate_ids(model, ids, ids).equal(ids)
    assert model.seen == [False, False]
    assert model.training and not model.base.training
