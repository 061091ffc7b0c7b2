"""Experts computed as groups, with their LoRA in the same grouped form.

transformers 5 runs an MoE block's fused experts through its experts interface (`@use_experts_implementation`:
"eager" is the loop over the experts a batch reaches, "grouped_mm" sorts the token-expert pairs by expert and
makes one grouped matmul per projection). With LoRA on the fused experts, peft's parameter wrapper hands the
experts W + scale * B A for each stack (a parametrization), so either path multiplies by a materialised
expert stack and keeps it for the backward.

lorakit registers one more implementation in that interface (its public extension point, as attention
backends are registered) and selects it for MoE models whose experts carry LoRA: tokens sorted by expert,
then per projection and expert group e

    y = x W_e + scale * (x A_e) B_e

as three grouped matmuls (torch's grouped_mm where the device, dtype and strides allow it; per-expert segment
matmuls elsewhere), reading W and the low-rank factors from the parametrization peft installed for the
forward. Whether LoRA applies (adapter active, disabled, merged) stays peft's decision: with no
parametrization the experts use W as it is. peft still forms W + scale * B A once when it installs the
parametrization (torch checks its shape); the grouped path neither multiplies by it nor keeps it.
"""

from __future__ import annotations

import torch

# The name lorakit's implementation has in transformers' experts interface.
NAME = "lorakit_grouped"
# torch's grouped matmul needs 16-byte aligned strides and pointers (CPU and CUDA kernels alike).
_ALIGN = 16


def register() -> str:
    """Register lorakit's grouped experts forward in transformers' experts interface (idempotent); its name."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, grouped_lora_experts_forward)
    return NAME


def kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch has a grouped matmul kernel for `dtype` on `device` (strides aside)."""
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    if torch.__version__ < "2.9":
        # Before 2.9 torch's grouped matmul had no CPU kernel and needed Hopper on CUDA.
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)


def _aligned(t: torch.Tensor, inner: tuple[int, ...]) -> bool:
    size = t.element_size()
    return t.data_ptr() % _ALIGN == 0 and all(
        t.stride(d) * size % _ALIGN == 0 for d in inner if t.size(d) > 1 and t.stride(d) != 1
    )


def can_group(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x (rows, in) @ w (experts, in, out) can run as torch's grouped matmul."""
    if x.dtype != w.dtype or not kernel_available(w.device, w.dtype):
        return False
    # One of w's last two dimensions must be contiguous; x's rows contiguous; the output's rows (and so the
    # backward's gradients of it and of w) 16-byte strided too.
    if x.stride(-1) != 1 or 1 not in (w.stride(-1), w.stride(-2)) or w.size(-1) * w.element_size() % _ALIGN:
        return False
    return _aligned(x, (0,)) and _aligned(w, (0, 1, 2))


def grouped_matmul(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, sizes: list[int] | None
) -> torch.Tensor:
    """Rows of x sorted by expert (group e: rows offsets[e-1]..offsets[e]) times their expert's w[e]
    (experts, in, out): torch's grouped matmul, else one matmul per non-empty group (`sizes`, the groups'
    row counts, read from the device only on this path)."""
    if can_group(x, w):
        mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
        return mm(x, w, offs=offsets)
    if sizes is None:
        sizes = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
    parts = [x_e @ w[e] for e, x_e in enumerate(torch.split(x, sizes)) if x_e.size(0)]
    return torch.cat(parts) if parts else x.new_zeros(0, w.size(-1))


def _weight_and_factors(experts: torch.nn.Module, name: str):
    """(W, (lhs, rhs, scale) or None) of the experts' parameter `name`: under peft's single-adapter
    parametrization (W + scale * lhs @ rhs, shaped as W) its original W and factors; under any other
    parametrization (several adapters) the parametrized tensor itself, with no factors."""
    parametrizations = getattr(experts, "parametrizations", None)
    if parametrizations is None or name not in parametrizations:
        return getattr(experts, name), None
    plist = parametrizations[name]
    proxy = plist[0] if len(plist) == 1 else None
    if proxy is not None and all(hasattr(proxy, a) for a in ("lhs", "rhs", "scaling")):
        return plist.original, (proxy.lhs, proxy.rhs, proxy.scaling)
    return getattr(experts, name), None


def _project(experts, name: str, x: torch.Tensor, offsets: torch.Tensor, sizes) -> torch.Tensor:
    """x's rows (sorted by expert) through expert parameter `name`, its LoRA as two more grouped matmuls."""
    weight, factors = _weight_and_factors(experts, name)
    transposed = experts.is_transposed
    x = x.to(weight.dtype)
    y = grouped_matmul(x, weight if transposed else weight.transpose(-2, -1), offsets, sizes)
    if factors is not None:
        lhs, rhs, scale = factors
        # The parameter is W + scale * lhs @ rhs: (experts, out, in) stacks multiply by its transpose.
        a, b = (lhs, rhs) if transposed else (rhs.transpose(-2, -1), lhs.transpose(-2, -1))
        # peft's B factor is a permuted view (no unit stride in its last two dimensions, which the grouped
        # kernel needs): a copy the size of the factor, not of the stack.
        a, b = a.contiguous(), b.contiguous()
        y = y + scale * grouped_matmul(grouped_matmul(x, a, offsets, sizes), b, offsets, sizes)
    return y


def grouped_lora_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' forward (transformers' experts-interface signature) as grouped matmuls, LoRA factored."""
    if self.has_bias or self.has_post_expert_norm or self._is_expert_parallel or not self.has_gate:
        # Layouts the three families lorakit selects this for do not have: transformers' own grouped path.
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    tokens, top_k = top_k_index.shape
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)
    counts = torch.bincount(expert_ids, minlength=self.num_experts)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    # The segment path needs the group sizes on the host: read once per forward, not once per matmul.
    sizes = None if kernel_available(hidden_states.device, hidden_states.dtype) else counts.tolist()
    x = hidden_states[order // top_k]
    h = self._apply_gate(_project(self, "gate_up_proj", x, offsets, sizes))
    y = _project(self, "down_proj", h, offsets, sizes)
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel(), device=order.device)
    return y[restore].view(tokens, top_k, -1).sum(1).to(hidden_states.dtype)


def use_grouped_experts(model: torch.nn.Module, factored: bool | None = None) -> str | None:
    """Choose the experts' path for `model` (a peft model of an MoE family with LoRA on its fused experts) and
    return the run's line saying which it is; None when the model has no experts interface (then transformers'
    own choice stays, unsaid).

    `factored` None chooses by device: with CUDA, lorakit's grouped experts (grouped GEMM kernels make the
    rank-r factors cheap, no weight gradient of the stack is formed, and no W + B A stack is kept for the
    backward: for Qwen3-30B-A3B in bf16 1.2 GB per layer); on CPU, transformers' own experts path, which the
    planner's CPU measurements model and which measured alike within noise
    (benchmarks/results/moe_experts.json: torch's CPU grouped matmul loops over the groups, and peft forms
    W + B A for its parametrization check either way)."""
    from peft.tuners.lora.layer import ParamWrapper

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "_can_set_experts_implementation", lambda: False)():
        return None
    stacks = [m for m in model.modules() if isinstance(m, ParamWrapper) and m.num_experts > 1]
    weights = [m.get_param() for m in stacks]
    if not weights or not all(w.dtype.is_floating_point for w in weights):
        return None
    if factored is None:
        factored = torch.cuda.is_available()
    if not factored:
        own = base.config._experts_implementation
        how = "the loop over the experts" if own == "eager" else "torch's grouped matmul"
        return (
            f"experts: transformers' {own!r} path ({how}) through peft's W + B A per expert stack; lorakit's "
            f"factored grouped experts ({NAME!r}) are chosen with CUDA only (docs/moe.md)"
        )
    base.set_experts_implementation(register())
    return (
        f"experts: computed as groups ({NAME!r} in transformers' experts interface: torch grouped_mm where the "
        "device, dtype and 16-byte strides allow it, else one matmul per expert group), the experts' LoRA as "
        "(x A_e) B_e per group, not through a materialised W + B A"
    )
