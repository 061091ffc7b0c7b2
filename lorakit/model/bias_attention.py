"""T5's attention off SDPA's math path: the fused SDPA backend that takes its additive position bias, by probe.

T5's relative position bias reaches SDPA as a float mask (B, H, q, k). SDPA's dispatcher takes the first
backend whose constraints the inputs meet, and the H100 lease of 2026-11-27 found T5-XL's attention on the
math backend (fp32 GEMMs and softmax, about 27% of kernel time). Flash attention takes no mask; cuDNN and
memory-efficient attention take an additive bias on CUDA when shapes, dtype and the bias's gradient suit
them, which depends on the torch build and the GPU. So the backend is chosen by probe: a small forward and
backward with T5's shape (scale 1, a bias that requires grad, query and key lengths that differ) under each
candidate alone, checked against the math backend in fp32; the first that runs and agrees is used. Where
none does, or the chosen backend rejects a call after all (a shape the probe did not try), SDPA dispatches
on its own, as before the probe ("default"; forcing math there changed CPU bf16 rounding against
generation's SDPA: tests/e2e/test_generate.py). `chosen()` is what summary.json's `attention_bias` reports.

Used by packed T5 rows (lorakit.model.varlen's per-example loop) only. Padded T5 batches stay on
transformers' own SDPA: routing them through lorakit's attention function changed their attention name,
memory plan and contracts, for a gain only a GPU can show (issue 61 keeps that for a GPU session).
"""

from __future__ import annotations

import os
from collections import Counter
from functools import cache

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Fastest first (pytorch#138493: cuDNN with a bias ahead of memory-efficient attention on H100).
CANDIDATES = (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION)
NAMES = {
    SDPBackend.CUDNN_ATTENTION: "cudnn",
    SDPBackend.EFFICIENT_ATTENTION: "efficient",
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.MATH: "math",
}
# LORAKIT_BIAS_SDPA=math: every biased call on math, the old path (an A/B switch for benchmarks/gpu_bench).
FORCE_MATH = "LORAKIT_BIAS_SDPA"
# {(device type, dtype, head_dim): {backend name: calls}} of this process.
_CALLS: dict[tuple[str, str, int], Counter] = {}


def _attend(backend, q, k, v, bias):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)


@cache
def probe(
    device: str, dtype: torch.dtype, head_dim: int, bias_grad: bool = True, candidates=CANDIDATES
) -> str:
    """The name of the first of `candidates` that runs T5-shaped attention with a float bias (forward and
    backward, the bias's gradient included when `bias_grad`) on `device` in `dtype` and agrees with the
    math backend in fp32; "math" when none does."""
    gen = torch.Generator().manual_seed(0)

    def make(*shape, grad=True):
        t = torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
        return t.requires_grad_(grad)

    # The first call may come in an evaluation or a reference pass (no_grad / inference mode), or inside
    # gradient checkpointing, whose saved-tensor hooks must not see the probe's tensors (the recompute,
    # with the probe cached, would save fewer): hooks of its own keep them here. They save a detached alias:
    # saving the tensor itself, an output saved by its own grad_fn (SDPA's) became a cycle through autograd's
    # C++ graph that the garbage collector cannot see, and kept 78 KiB of the probe's tensors alive for good.
    identity = torch.autograd.graph.saved_tensors_hooks(torch.Tensor.detach, lambda t: t)
    with torch.inference_mode(False), torch.enable_grad(), identity:
        return _probe(make, dtype, head_dim, bias_grad, candidates)


def _probe(make, dtype, head_dim, bias_grad, candidates) -> str:
    q, k, v = make(2, 4, 24, head_dim), make(2, 4, 40, head_dim), make(2, 4, 40, head_dim)
    bias = make(2, 4, 24, 40, grad=bias_grad)
    ref = [t.detach().float().requires_grad_(t.requires_grad) for t in (q, k, v, bias)]
    _attend(SDPBackend.MATH, *ref).square().sum().backward()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for backend in candidates:
        inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in (q, k, v, bias)]
        try:
            out = _attend(backend, *inputs)
            out.float().square().sum().backward()
        except RuntimeError:
            continue  # "No available kernel": this backend does not take these inputs here
        pairs = [(out, _attend(SDPBackend.MATH, *ref))] + [
            (a.grad, b.grad) for a, b in zip(inputs, ref, strict=True) if b.grad is not None
        ]
        if all(torch.allclose(a.float(), b, atol=tol, rtol=tol) for a, b in pairs):
            return NAMES[backend]
    return "math"


def bias_sdpa(
    query, key, value, attn_mask, dropout_p: float = 0.0, scale: float | None = None
) -> torch.Tensor:
    """F.scaled_dot_product_attention with a float `attn_mask` (T5's bias, padding folded in) on the backend
    the probe chose for this device, dtype and head size. Where it chose none, or that backend rejects the
    call, SDPA dispatches as it would for transformers ("default": on a CPU, flash where it takes the mask)."""
    device = query.device.type
    mask, dropout, scaling = attn_mask, dropout_p, scale
    calls = _CALLS.setdefault((device, str(query.dtype).removeprefix("torch."), query.shape[-1]), Counter())
    if os.environ.get(FORCE_MATH) == "math":  # the benchmark's A/B switch: the math path T5 took on CUDA
        calls["math"] += 1
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
            )
    name = probe(device, query.dtype, query.shape[-1], bool(mask is not None and mask.requires_grad))
    if name != "math":
        backend = next(b for b, n in NAMES.items() if n == name)
        try:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(
                    query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
                )
            calls[name] += 1
            return out
        except RuntimeError:
            pass
    calls["default"] += 1
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)


def chosen() -> list[dict]:
    """Each (device, dtype, head size) that attended with a bias in this process: the backend calls."""
    return [
        {"device": d, "dtype": t, "head_dim": h, "calls": dict(c)} for (d, t, h), c in sorted(_CALLS.items())
    ]
