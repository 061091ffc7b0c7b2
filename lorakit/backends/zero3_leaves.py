"""ZeRO-3 gathers each adapter layer whole: its base linear with the adapter's weights, in one all-gather.

Left to itself ZeRO-3 hooks every submodule, so a LoRA layer's base linear, lora_A and lora_B are fetched
and released one by one (three all-gathers and three hook pairs where one does, in the forward, again in
the backward, and again when gradient checkpointing recomputes). Marked a leaf
(`deepspeed.utils.set_z3_leaf_module`), the layer is one unit: one coalesced gather of all its weights,
released after it. The same losses bit for bit; 21% less training time for the tiny quickstarts on 2 CPU
processes, 3% on long code sources (benchmarks/README.md#zero-3-adapter-leaves).

DeepSpeed reduces a leaf's gradients from a full backward hook on the leaf (stage3.py,
create_reduce_and_remove_grad_hooks). torch fires such a hook once the gradient of the module's *inputs*
is known, or, when no input requires grad, as soon as its *output's* is: before the layer's own weights
have theirs. DeepSpeed then fills a zero gradient for the (still partitioned, empty) weight and the real
one cannot accumulate into it ("size of tensor a (0) must match the size of tensor b (16)"). That is every
adapter layer reading frozen embeddings when gradient checkpointing is off (DeepSpeed PR #5074 names the
requirement; issue #5524 is its twin for the release of the weights). So a leaf given an input that does
not require grad gets it as a new graph leaf that does: nothing upstream changes (there was no graph to
it), and the hook fires after the weights' gradients. The cost is the gradient of that input, one matmul
for each such layer (the first block's projections).
"""

from __future__ import annotations

import torch


def _base_is_linear(layer) -> bool:
    # LoRA on an embedding or a convolution reads token ids or images: its input never requires grad, so
    # its backward hook would fire early whatever lorakit did. Those stay hooked module by module.
    return isinstance(layer.get_base_layer(), torch.nn.Linear)


def _input_requires_grad(module, args):
    """A forward pre-hook: the layer's input as a graph leaf that requires grad, where it did not."""
    if not (torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor)):
        return None
    x = args[0]
    if x.requires_grad or not x.is_floating_point():
        return None
    return (x.detach().requires_grad_(), *args[1:])


def gather_adapter_layers_whole(model: torch.nn.Module) -> int:
    """Marks every adapter layer over a linear a ZeRO-3 leaf (module docstring); layers inside a module
    that is a leaf already (an MoE block, a tiled MLP) are gathered with it and stay as they are. Call
    before deepspeed.initialize, which installs the hooks. Returns how many layers it marked."""
    from deepspeed.utils import set_z3_leaf_module, z3_leaf_module
    from peft.tuners.tuners_utils import BaseTunerLayer

    marked = 0

    def visit(module: torch.nn.Module) -> None:
        nonlocal marked
        for child in module.children():
            if z3_leaf_module(child):
                continue
            if isinstance(child, BaseTunerLayer) and _base_is_linear(child):
                set_z3_leaf_module(child, True)
                # Before DeepSpeed's own pre-hooks, which wrap the input this one returns.
                child.register_forward_pre_hook(_input_requires_grad)
                marked += 1
            else:
                visit(child)

    visit(model)
    return marked


def before_initialize(model: torch.nn.Module, ds_config: dict) -> int:
    """What the model gets before deepspeed.initialize under `ds_config` (DeepSpeedBackend.wrap): under ZeRO-3
    its adapter layers as leaves (gather_adapter_layers_whole); nothing at stages 0-2. Returns how many."""
    if ds_config["zero_optimization"]["stage"] != 3:
        return 0
    return gather_adapter_layers_whole(model)
