"""ZeRO-3 adapter leaves (lorakit/backends/zero3_leaves.py): which layers become leaves, and the input hook
that keeps DeepSpeed's leaf gradient hook after the weights' gradients. The two-process runs that train with
them (with and without gradient checkpointing, against one process without ZeRO) are
tests/integration/test_token_weighting.py's and the ZeRO-3 quickstarts': without the input hook 16 of
test_token_weighting's checks fail with "size of tensor a (0) must match the size of tensor b (16)"."""

from __future__ import annotations

import warnings

import pytest
import torch
from deepspeed.utils import set_z3_leaf_module, z3_leaf_module
from peft import LoraConfig, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import LlamaForCausalLM

from lorakit.backends.zero3_leaves import _input_requires_grad, gather_adapter_layers_whole
from lorakit.testing import tiny_config


def _lora_llama(targets, use_dora=False):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama"))
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_dora=use_dora))


def test_every_linear_adapter_layer_becomes_a_leaf_and_nothing_else():
    model = _lora_llama(["q_proj", "v_proj", "down_proj", "embed_tokens"])
    marked = gather_adapter_layers_whole(model)
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    linear = [m for m in layers if isinstance(m.get_base_layer(), torch.nn.Linear)]
    assert marked == len(linear) == 3 * 2  # three targets in each of the two blocks
    assert all(z3_leaf_module(m) for m in linear)
    # LoRA on the embedding reads token ids, which never require grad: it stays hooked module by module.
    embedding = [m for m in layers if m not in linear]
    assert len(embedding) == 1 and not z3_leaf_module(embedding[0])
    # Nothing else is a leaf, the adapter's own linears included (they are gathered with their layer).
    assert sum(z3_leaf_module(m) for m in model.modules()) == marked


def test_layers_inside_a_leaf_are_gathered_with_it():
    model = _lora_llama(["q_proj", "down_proj"])
    set_z3_leaf_module(model.base_model.model.model.layers[0].mlp, True)  # as an MoE block or tiled MLP is
    assert gather_adapter_layers_whole(model) == 3  # both q_proj, the second block's down_proj
    assert not z3_leaf_module(model.base_model.model.model.layers[0].mlp.down_proj)


def test_the_input_hook_replaces_only_a_floating_input_without_grad_while_grad_is_on():
    x = torch.randn(2, 3)
    (y,) = _input_requires_grad(None, (x,))
    assert y.requires_grad and y.is_leaf and torch.equal(y, x)
    assert _input_requires_grad(None, (x.requires_grad_(),)) is None  # already in the graph: untouched
    assert _input_requires_grad(None, (torch.tensor([1, 2]),)) is None  # token ids
    with torch.no_grad():
        assert _input_requires_grad(None, (torch.randn(2, 3),)) is None  # eval and generation
    extra = object()
    _, kept = _input_requires_grad(None, (torch.randn(2, 3), extra))
    assert kept is extra


@pytest.mark.parametrize("hooked", [False, True], ids=["torch alone", "with the input hook"])
def test_a_full_backward_hook_sees_the_weight_gradients_only_with_the_input_hook(hooked):
    """What the workaround stands on, and what it fixes: torch fires a module's full backward hook (where
    DeepSpeed reduces a leaf's gradients) as soon as its output's gradient is known when no input requires
    grad, before the weights have theirs; given an input that requires grad it fires after them. If torch
    ever changes the first half, this test says so and the hook may go."""
    model = _lora_llama(["q_proj"])
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    if hooked:
        layer.register_forward_pre_hook(_input_requires_grad)
    seen = []
    weight = layer.lora_A["default"].weight
    layer.register_full_backward_hook(lambda m, gi, go: seen.append(weight.grad is not None))
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()  # B starts at zero: A's gradient would be zero but present
    # torch warns when it fires the hook early, and says nothing when it fires after the inputs' gradients.
    early = pytest.warns(UserWarning, match="no inputs require gradients")
    with early if not hooked else warnings.catch_warnings(action="error"):
        layer(torch.randn(2, 5, 64)).sum().backward()
    assert seen == [hooked]
    assert weight.grad is not None


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_the_planners_largest_module_is_the_largest_leaf_deepspeed_gathers(use_dora):
    """planner/states.largest_adapter_layer against the built model: the most parameters one leaf holds (its
    base linear with A, B and DoRA's magnitude), which ZeRO-3 gathers at once."""
    from types import SimpleNamespace

    from lorakit.planner.arch import arch_from_config
    from lorakit.planner.states import largest_adapter_layer

    model = _lora_llama("all-linear", use_dora)
    gather_adapter_layers_whole(model)
    leaves = [m for m in model.modules() if z3_leaf_module(m)]
    method = SimpleNamespace(kind="lora", r=4, use_dora=use_dora, target_modules="all-linear")
    planned = largest_adapter_layer(arch_from_config(tiny_config("llama")), method)
    assert planned == max(sum(p.numel() for p in leaf.parameters()) for leaf in leaves)
