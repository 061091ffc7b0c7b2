"""What the tiled MLP and the tiled loss share: a wrapper module that takes over another module's children
and parameters under their own names, and the replay of the forward's random stream in a backward that
recomputes.

A wrapper (`Adopting`) stands where the wrapped module stood (a decoder layer's `mlp`, a causal LM's
`lm_head`): parameter names, state dicts, saved adapters and checkpoints are unchanged, the wrapped module's
own forward runs inside it, and transformers is not patched. It is a DeepSpeed ZeRO-3 leaf module
(deepspeed.utils.set_z3_leaf_module): its parameters are gathered once when its forward (or backward)
starts and released when it ends, not once per tile, and the number of tiles may differ between ranks
without the ranks' all-gathers falling out of step.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def rng_state(device: torch.device) -> tuple:
    """The random streams a forward on `device` draws from (CPU, and CUDA's when on CUDA)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def replayed(state: tuple | None, device: torch.device):
    """Run the block on the random stream `state` (as it was at the forward), then put the stream back."""
    if state is None:
        yield
        return
    cpu, cuda = state
    devices = [device] if cuda is not None else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


def has_dropout(module: nn.Module) -> bool:
    """Whether a forward of `module` in its current mode draws random numbers (an active dropout)."""
    return module.training and any(
        isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules() if m.training
    )


class Adopting(nn.Module):
    """A wrapper whose children, parameters and buffers are the wrapped module's (`inner`), under the same
    names (module docstring)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        for name, child in inner.named_children():
            self.add_module(name, child)
        for name, p in inner._parameters.items():  # None entries too (a Linear's bias=None)
            self.register_parameter(name, p)
        for name, b in inner.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name not in inner._non_persistent_buffers_set)
        # Not a child (its children are already ours): the module whose forward runs on each tile. Its own
        # parameters are ours by the same dict, so a parameter swapped on the wrapper (FSDP2's shard and
        # gathered weight, each forward) is the one its forward uses.
        object.__setattr__(inner, "_parameters", self._parameters)
        object.__setattr__(self, "inner", inner)
        from deepspeed.utils import set_z3_leaf_module

        set_z3_leaf_module(self, True)

    def __setattr__(self, name: str, value) -> None:
        # A child replaced later (peft's merge_and_unload puts the base layer back) is the inner one's too.
        if isinstance(value, nn.Module) and name in self.__dict__.get("_modules", {}):
            setattr(self.inner, name, value)
        super().__setattr__(name, value)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("inner")
            if inner is None:
                raise
            # The wrapped module's plain attributes (config, hidden_size, in_features, ...).
            return getattr(inner, name)

    def train(self, mode: bool = True):
        self.inner.training = mode
        return super().train(mode)
