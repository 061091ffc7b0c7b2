"""What packed attention remembers lives with one model, not the process: which kernel each call took (and
the console line that says so), and the T5 position-bias hooks. A second model in the same process, as a
second run would build, starts from nothing."""

import types

import torch

from lorakit.model import fused_attention as fa
from lorakit.model.inputs import ModelInputs
from lorakit.model.varlen import T5_BIAS_HOOK, VARLEN_SDPA, attach_t5_position_bias, varlen_sdpa_attention
from lorakit.testing import tiny_config


def _packed_forward(inputs: ModelInputs) -> None:
    """One causal attention call over a packed row of two examples, as a model's layer makes it."""
    batch = {
        "input_ids": torch.zeros(1, 5, dtype=torch.long),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
    }
    kwargs = inputs(batch, "cpu")
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    layer = types.SimpleNamespace(training=False)
    varlen_sdpa_attention(layer, q, k, v, None, lorakit_segments=kwargs["lorakit_segments"])


def test_a_second_model_counts_and_says_its_own_kernels(monkeypatch):
    said = []
    monkeypatch.setattr(fa, "_say", said.append)
    config = tiny_config("llama")
    first = ModelInputs(config, VARLEN_SDPA, torch.float32)
    _packed_forward(first)
    _packed_forward(first)
    assert first.kernels.counts() == {"causal": {fa.LOOP: 2}} and len(said) == 1
    second = ModelInputs(config, VARLEN_SDPA, torch.float32)
    assert second.kernels.counts() == {}
    _packed_forward(second)
    # Said again for the second model (a second run's console), counted apart from the first's.
    assert second.kernels.counts() == {"causal": {fa.LOOP: 1}} and len(said) == 2 and said[0] == said[1]
    assert first.kernels.counts() == {"causal": {fa.LOOP: 2}}


def test_t5_position_bias_hooks_belong_to_their_model():
    from transformers import T5ForConditionalGeneration

    models = [T5ForConditionalGeneration(tiny_config("t5")) for _ in range(2)]
    count = attach_t5_position_bias(models[0])
    assert count > 0 and attach_t5_position_bias(models[0]) == count  # idempotent
    hooked = [m for m in models[0].modules() if getattr(m, T5_BIAS_HOOK, None) is not None]
    assert len(hooked) == count and all(len(m._forward_pre_hooks) == 1 for m in hooked)
    # The other model has no hook until it is attached itself.
    assert not any(getattr(m, T5_BIAS_HOOK, None) for m in models[1].modules())
    assert attach_t5_position_bias(models[1]) == count
