"""bf16 linear layers on a CPU without a fast bf16 kernel, multiplied in fp32.

torch multiplies bf16 matrices on a CPU with oneDNN where the CPU has bf16 instructions (AVX512-BF16, AMX);
elsewhere (AVX2: most laptops, many CI machines and some GPU hosts' CPUs) they fall to a loop that is far
slower than fp32 SGEMM on the same matrices (pytorch#146508): on an AVX2 AMD EPYC, one LoRA layer's forward
and backward of 512 tokens took 42 s against 0.44 s at FLAN-T5-XL width (benchmarks/README.md, "CPU bf16
products in fp32").
That loop already multiplies in fp32 and rounds the sum to bf16 once, so computing the product in fp32 with
SGEMM and rounding it to bf16 is the same arithmetic summed in another order (outputs differ by bf16's last
bit where the order matters). So a bf16 model built for such a CPU has each `nn.Linear` (the base's
projections, LoRA's A and B, the output head) compute through `_Fp32Linear`: weights, activations and
gradients stay bf16 in memory; only the product is formed in fp32.

- `_Fp32Linear` saves its inputs as they are (the parameter itself, as DeepSpeed's ZeRO-3 linear function
  does, so a partitioned weight is re-gathered for the backward rather than kept) and forms its gradients
  in fp32 the same way.
- Over and above what torch's kernel holds, it keeps an fp32 copy of the input while it runs (in the
  backward only for a weight that trains) and of the input's gradient, and pieces of the output features
  of at most CHUNK_ELEMENTS fp32 values: an output head over a 128k-token vocabulary never has its fp32
  weight or logits whole.
- A call whose tensors are not plain bf16 CPU tensors (a GPU, another dtype, a DTensor) runs `nn.Linear`'s
  own forward, so the layer stays correct wherever the model goes.
- 4-bit layers (bitsandbytes' subclasses of `nn.Linear`) keep their own kernels: only `nn.Linear` itself is
  changed.

LORAKIT_CPU_BF16_MATMUL: `auto` (default) decides from torch's own test for the fast kernel
(`torch.ops.mkldnn._is_mkldnn_bf16_supported()`); `native` keeps torch's kernels on any CPU; `fp32` uses
this path on any CPU (how the tests take both branches on any machine).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from lorakit.errors import LorakitError

FORCE = "LORAKIT_CPU_BF16_MATMUL"
CHOICES = ("auto", "native", "fp32")
DOC = "README.md#quickstart-cpu-no-network-a-few-minutes"
# fp32 elements of one transient piece (64 MiB): an output head's weight and logits are formed in pieces.
CHUNK_ELEMENTS = 2**24
# The run's console line when the layers were changed.
FP32_PRODUCTS_LINE = (
    "matmul: bf16 linear layers multiply in fp32 on this CPU (it has no fast bf16 kernel; "
    f"{FORCE}=native keeps torch's)"
)


def fast_bf16_kernel() -> bool:
    """torch's own test for a fast bf16 matrix product on this CPU (oneDNN with bf16 instructions)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def forced_setting() -> str:
    """LORAKIT_CPU_BF16_MATMUL (unset: auto); any other value than auto, native or fp32 is a LorakitError
    (exit 2), which lorakit.train raises before any work."""
    forced = os.environ.get(FORCE, "") or "auto"
    if forced not in CHOICES:
        raise LorakitError(f"{FORCE}={forced!r}: expected one of {', '.join(CHOICES)} (unset: auto)", doc=DOC)
    return forced


def fp32_products_wanted(dtype: torch.dtype, device_type: str) -> bool:
    """Whether a `dtype` model on `device_type` multiplies in fp32: bf16 on a CPU without torch's fast bf16
    kernel, unless LORAKIT_CPU_BF16_MATMUL says `native` or `fp32`."""
    forced = forced_setting()
    if dtype != torch.bfloat16 or device_type != "cpu" or forced == "native":
        return False
    return forced == "fp32" or not fast_bf16_kernel()


def _plain_bf16_cpu(t: torch.Tensor | None) -> bool:
    # Tensor subclasses (DTensor, quantized storage) keep their own dispatch.
    return t is None or (
        type(t) in (torch.Tensor, nn.Parameter) and t.dtype == torch.bfloat16 and not t.is_cuda
    )


def _spans(n_out: int, width: int) -> list[tuple[int, int]]:
    # Output features per piece, so that no fp32 piece (weight rows, output columns) exceeds CHUNK_ELEMENTS.
    step = max(1, CHUNK_ELEMENTS // max(width, 1))
    return [(a, min(a + step, n_out)) for a in range(0, n_out, step)]


class _Fp32Linear(torch.autograd.Function):
    """`F.linear` of bf16 CPU tensors, with the products formed in fp32 and rounded to bf16 once, a piece of
    the output features at a time (an output head's fp32 weight and logits never exist whole)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        x32 = x.reshape(-1, x.shape[-1]).float()
        out = x.new_empty(x32.shape[0], weight.shape[0])
        # Plain products, not F.linear: ZeRO-3's zero.Init replaces F.linear process-wide with its own.
        for a, b in _spans(weight.shape[0], max(x32.shape)):
            piece = x32 @ weight[a:b].float().t()
            if bias is not None:
                piece += bias[a:b].float()
            out[:, a:b] = piece
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        rows, width = g.shape[0], x.shape[-1]
        want_x, want_w, want_b = ctx.needs_input_grad
        # A frozen base weight (every LoRA layer's) needs no fp32 copy of the input.
        x32 = x.reshape(rows, width).float() if want_w else None
        gx32 = torch.zeros(rows, width, dtype=torch.float32) if want_x else None
        gw = torch.empty_like(weight) if want_w else None
        gb = torch.empty_like(bias) if bias is not None and want_b else None
        for a, b in _spans(weight.shape[0], max(rows, width)):
            g32 = g[:, a:b].float()
            if gx32 is not None:
                gx32 += g32 @ weight[a:b].float()
            if gw is not None:
                gw[a:b] = g32.t() @ x32
            if gb is not None:
                gb[a:b] = g32.sum(0)
        gx = gx32.to(x.dtype).reshape(x.shape) if gx32 is not None else None
        return gx, gw, gb


class Fp32ProductLinear(nn.Linear):
    """An `nn.Linear` whose bf16 products on a CPU are formed in fp32 (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and all(map(_plain_bf16_cpu, (x, self.weight, self.bias))):
            return _Fp32Linear.apply(x, self.weight, self.bias)
        return super().forward(x)

    def _get_name(self) -> str:
        return "Linear"  # printed models read as before


def use_fp32_products(model: nn.Module, dtype: torch.dtype, device_type: str) -> bool:
    """Makes `model`'s linear layers form bf16 products in fp32 where `fp32_products_wanted`; whether it did."""
    if not fp32_products_wanted(dtype, device_type):
        return False
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Fp32ProductLinear
    return True
