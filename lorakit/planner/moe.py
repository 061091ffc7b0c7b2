"""The planner's mixture-of-experts terms: LoRA on fused expert parameters (peft's ParamWrapper, counted
exactly from the census's parameter shapes), the activations of the top-k experts a token is routed to, and
the expert weights peft's parameter LoRA materialises per forward (W + scale * B A of a layer's stack)."""

from __future__ import annotations

from lorakit.model.families import family_for_type
from lorakit.model.families.moe import dropout_note, parameter_targets


def _targeted(arch, method) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the fused parameters the method adapts (lorakit.model.adapter's targets)."""
    targets = parameter_targets(family_for_type(arch.model_type).moe, method)
    return [(n, s) for n, s in arch.fused_params if any(n.endswith(t) for t in targets)]


def moe_notes(arch, method) -> list[str]:
    """What the plan says of an MoE method, as the run says it (lorakit.model.families.moe.describe): where
    method.dropout applies (the linear layers' adapters, and so their dropout masks are planned) and not."""
    note = dropout_note(family_for_type(arch.model_type).moe, method)
    return [note] if note else []


def parameter_lora(arch, method) -> list[int]:
    """Element counts of the LoRA matrices peft's ParamWrapper adds per fused parameter: a 3-D stack
    (experts, out, in) gets A: r*experts x in and B: out x r*experts; a 2-D weight (out, in) A: r x in and
    B: out x r."""
    out = []
    for _, shape in _targeted(arch, method):
        experts, rows, cols = shape if len(shape) == 3 else (1, *shape)
        out += [method.r * experts * cols, rows * method.r * experts]
    return out


def moe_mlp(arch, a: int) -> int:
    """Bytes per token an MoE block keeps: the router's logits and fp32 probabilities over every expert, and
    for each of the top-k experts it is routed to, the gathered input, the gated MLP's tensors (as a dense
    gated MLP's at the expert's width) and the weighted output."""
    e = arch.experts
    return e.count * (a + 8) + e.active * (4 * a * e.ffn + 2 * a * arch.hidden)


def expert_weights(arch, method, a: int) -> int:
    """Bytes one layer keeps of its expert weights with LoRA folded in: peft's parameter LoRA replaces each
    adapted stack by W + scale * B A for the forward, and the expert matmuls keep it for the backward."""
    if method.kind == "full" or arch.experts is None or arch.layers == 0:
        return 0
    numel = 0
    for _, shape in _targeted(arch, method):
        n = 1
        for d in shape:
            n *= d
        numel += n
    return a * numel // arch.layers


def expert_stacks(arch) -> list[tuple[str, int]]:
    """(parameter name, weights) of every fused expert stack (not the router's weight): what QLoRA stores in 4
    bits among the fused parameters, as lorakit.model.quant_experts quantizes them."""
    out = []
    for name, shape in arch.fused_params:
        if ".experts." in f".{name}" and len(shape) == 3:
            out.append((name, shape[0] * shape[1] * shape[2]))
    return out


def quantized_experts(arch) -> tuple[int, int]:
    """(weights, stacks) of the fused experts QLoRA stores in 4 bits (expert_stacks)."""
    stacks = expert_stacks(arch)
    return sum(n for _, n in stacks), len(stacks)


def moe_frozen_note(quantized: int, experts: int, unquantized: int, dtype_bytes: int) -> str:
    """The plan's words for an MoE QLoRA base: which weights are 4-bit and which stay in model.dtype."""
    return (
        f"4-bit: {_billions(experts)} fused expert and {_billions(quantized - experts)} linear weights; "
        f"{8 * dtype_bytes}-bit: {_billions(unquantized)} (embeddings, norms, routers, output head)"
    )


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"
