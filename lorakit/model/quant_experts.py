"""QLoRA's 4-bit fused experts: an MoE layer's expert stacks in NF4 (or FP4), double quantization, LoRA on top.

bitsandbytes quantizes `nn.Linear` only, and transformers 5 keeps every MoE family's experts as two fused 3-D
parameters (`gate_up_proj`: experts x 2 ffn x hidden, `down_proj`: experts x hidden x ffn), so under QLoRA they
stayed in model.dtype: 29B of Qwen3-30B-A3B's 30.5B weights. `quantize_experts` replaces each experts module
of a loaded model, by composition, with a `QuantizedExperts` holding:

- per stack, the experts quantized one by one with bitsandbytes' `quantize_4bit` (blocks of 64, double
  quantization, storage in model.dtype as for the linear layers: model/quantize.py says why), stacked into one
  frozen parameter `<name>_4bit` (experts x packed) that ZeRO-3 partitions and FSDP2 shards as any weight, and
  its quantization constants as buffers, every rank a copy (kept in their own dtypes: DeepSpeed casts
  parameters only);
- per stack, a parameter of the logical shape and no memory (a zero expanded to experts x out x in), named as
  transformers names the stack, which is what peft's parameter LoRA (`target_parameters`) wraps: peft adds its
  delta to it for the forward (W + scale B A with W = 0), so the adapter trains and saves under the very names
  a bf16 run's does (merge, export and resume read it unchanged). `as_buffers` turns it into a buffer once
  peft has wrapped it, so ZeRO-3 and FSDP2 never partition or gather it.

The forward is transformers' expert loop (Mixtral, Qwen3-MoE and OLMoE share it): for each expert a token
reaches, its weight dequantized (that expert only) plus its LoRA delta, then the gated MLP.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

STACKS = ("gate_up_proj", "down_proj")
BLOCKSIZE = 64


class QuantizedExperts(nn.Module):
    """An experts module with 4-bit stacks (module docstring); `experts` is transformers' module it replaces,
    whose 3-D stacks are quantized and not kept."""

    def __init__(self, experts: nn.Module, quant_type: str):
        super().__init__()
        from lorakit.model.quantize import require_bitsandbytes

        functional = require_bitsandbytes().functional
        for flag in ("is_transposed", "has_bias"):
            if getattr(experts, flag, False):
                from lorakit.errors import RecipeError

                raise RecipeError(
                    f"method.kind qlora: {type(experts).__name__} has {flag}, which lorakit's 4-bit experts do not "
                    "support; use method.kind: lora"
                )
        self.num_experts = int(experts.num_experts)
        self.act_fn = experts.act_fn
        self.quant_type = quant_type
        self.shapes: dict[str, tuple[int, int, int]] = {}
        for name in STACKS:
            weight = getattr(experts, name).detach()
            self.dtype = weight.dtype
            packed, absmax, absmax2, offset = [], [], [], []
            for e in range(weight.shape[0]):
                p, qs = functional.quantize_4bit(
                    weight[e], blocksize=BLOCKSIZE, compress_statistics=True, quant_type=quant_type,
                    quant_storage=weight.dtype,
                )  # fmt: skip
                packed.append(p.reshape(-1))
                absmax.append(qs.absmax)
                absmax2.append(qs.state2.absmax)
                offset.append(qs.offset.reshape(()))
            self.shapes[name] = tuple(weight.shape)
            self.register_parameter(f"{name}_4bit", nn.Parameter(torch.stack(packed), requires_grad=False))
            # The code tables are the same for every expert (NF4/FP4's 16 values, the 8-bit dynamic map).
            for key, value in (("absmax", torch.stack(absmax)), ("absmax2", torch.stack(absmax2)),
                               ("offset", torch.stack(offset)), ("code", qs.code), ("code2", qs.state2.code)):  # fmt: skip
                self.register_buffer(f"{name}_{key}", value.clone(), persistent=False)
            self.register_parameter(name, nn.Parameter(_anchor(weight.shape, weight), requires_grad=False))
            delattr(experts, name)  # the 16-bit stack goes with transformers' module
        self._tag_quant_states()

    def dequantized(self, name: str, expert: int) -> torch.Tensor:
        """Expert `expert`'s weight of stack `name`, dequantized to model.dtype (out x in)."""
        from lorakit.model.quantize import require_bitsandbytes

        functional = require_bitsandbytes().functional
        return functional.dequantize_4bit(getattr(self, f"{name}_4bit")[expert], self._state(name, expert))

    def expert_weight(self, name: str, expert: int) -> torch.Tensor:
        """The weight the expert computes with: dequantized, plus peft's LoRA delta while it is active."""
        w = self.dequantized(name, expert)
        if nn.utils.parametrize.is_parametrized(self, name):
            w = w + getattr(self, name)[expert]
        return w

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """transformers' expert loop (MixtralExperts.forward), each expert's weights as `expert_weight` gives them."""
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for (e,) in hit.tolist():
            if e == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[e])
            x = hidden_states[token_idx]
            gate, up = nn.functional.linear(x, self.expert_weight("gate_up_proj", e)).chunk(2, dim=-1)
            h = nn.functional.linear(self.act_fn(gate) * up, self.expert_weight("down_proj", e))
            h = h * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out

    def as_buffers(self) -> None:
        """Re-register the zero stacks as buffers (after peft has found them as parameters): nothing to
        partition, shard or hand the optimizer."""
        for name in STACKS:
            if name in self._parameters:
                anchor = self._parameters.pop(name)
                self.register_buffer(name, anchor.data, persistent=False)

    def _state(self, name: str, expert: int):
        from lorakit.model.quantize import require_bitsandbytes

        QuantState = require_bitsandbytes().functional.QuantState
        nested = QuantState(absmax=getattr(self, f"{name}_absmax2")[expert], code=getattr(self, f"{name}_code2"),
                            blocksize=256, dtype=torch.float32)  # fmt: skip
        return QuantState(
            absmax=getattr(self, f"{name}_absmax")[expert], shape=torch.Size(self.shapes[name][1:]),
            code=getattr(self, f"{name}_code"), blocksize=BLOCKSIZE, quant_type=self.quant_type,
            dtype=self.dtype, offset=getattr(self, f"{name}_offset")[expert], state2=nested,
        )  # fmt: skip

    @property
    def quant_states(self) -> dict[str, StackState]:
        """Each packed parameter's quantization state by its name (what lorakit.model.quantize reads of any 4-bit
        weight: the logical shape and the constants), kept here too since FSDP2's DTensors drop attributes."""
        return {f"{name}_4bit": StackState(self, name) for name in STACKS}

    def _tag_quant_states(self) -> None:
        for name, state in self.quant_states.items():
            getattr(self, name).quant_state = state

    def _apply(self, fn, recurse: bool = True):
        # A move or cast would materialise the zero stacks (an expanded tensor copies whole): re-expand instead.
        anchors = {}
        for name in STACKS:
            store = self._parameters if name in self._parameters else self._buffers
            if store.get(name) is not None and not nn.utils.parametrize.is_parametrized(self, name):
                anchors[name] = (store, store[name])
                store[name] = store[name].new_zeros(())
        out = super()._apply(fn, recurse)
        for name, (store, old) in anchors.items():
            scalar = store[name]
            anchor = _anchor(old.shape, scalar)
            store[name] = (
                nn.Parameter(anchor, requires_grad=False) if isinstance(old, nn.Parameter) else anchor
            )
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in STACKS:
            destination.pop(prefix + name, None)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, *args: Any):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, *args)
        for name in STACKS:
            if prefix + name in missing_keys:
                missing_keys.remove(prefix + name)


class StackState:
    """A 4-bit stack's quantization state as lorakit.model.quantize reads it: `shape` (the logical experts x
    out x in) and its constants (`absmax`, `code`, nested: `state2`, `offset`), read from the module."""

    nested = True

    def __init__(self, module: QuantizedExperts, name: str):
        self.module, self.name = module, name

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.module.shapes[self.name])

    def __getattr__(self, key: str):
        table = {"absmax": "absmax", "code": "code", "offset": "offset"}
        if key in table:
            return getattr(self.module, f"{self.name}_{table[key]}")
        if key == "state2":
            return _Nested(
                getattr(self.module, f"{self.name}_absmax2"), getattr(self.module, f"{self.name}_code2")
            )
        raise AttributeError(key)


class _Nested:
    def __init__(self, absmax: torch.Tensor, code: torch.Tensor):
        self.absmax, self.code = absmax, code


def _anchor(shape, like: torch.Tensor) -> torch.Tensor:
    """A zero tensor of `shape` in `like`'s dtype and device that holds one element."""
    return torch.zeros((), dtype=like.dtype, device=like.device).expand(shape)


def quantize_experts(model: nn.Module, quant_type: str, experts_names: tuple[str, ...] = STACKS) -> int:
    """Replace every fused experts module of `model` (a module holding `gate_up_proj` and `down_proj` 3-D
    parameters) with a QuantizedExperts; returns how many. Runs on the loaded model, before peft."""
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if all(
            isinstance(getattr(m, s, None), nn.Parameter) and getattr(m, s).dim() == 3 for s in experts_names
        )
    ]
    for name, m in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, QuantizedExperts(m, quant_type))
    return len(targets)


def experts_as_buffers(model: nn.Module) -> int:
    """QuantizedExperts.as_buffers on every one of `model`'s 4-bit experts (after peft); returns how many."""
    modules = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
    for m in modules:
        m.as_buffers()
    return len(modules)
