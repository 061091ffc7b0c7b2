"""Fused kernels for packed rows on CUDA, from PyTorch itself (no flash-attn package): variable-length flash
attention for causal rows and T5 cross-attention, compiled FlexAttention for T5 self-attention with its
position bias.

lorakit.model.varlen asks `choose_kernel` which path a packed attention call takes:

- `varlen`: `torch.nn.attention.varlen.varlen_attn` (PyTorch's flash kernel over cumulative sequence
  boundaries, cu_seqlens): CUDA, bf16/fp16, no attention dropout, no bias. Causal rows of causal LMs
  (sliding windows through `window_size`, grouped KV heads through `enable_gqa`, or repeated before the
  call where torch's varlen_attn lacks it, as in torch 2.11) and T5's cross-attention
  (decoder examples attend to their own encoder example; T5's cross-attention has no bias).
- `flex`: FlexAttention, compiled (`torch.compile` with automatic dynamic shapes: at most two compilations
  per process, not one per row length), with a block mask that keeps attention inside each example (and causal in the decoder) and a
  score_mod that adds T5's relative position bias, read from a table over distances k - q. T5's bias depends
  on that distance only, so one table gives every example its unpacked bias. CUDA, no attention dropout
  (FlexAttention has none). Only the compiled kernel is ever called: eager FlexAttention is PyTorch's
  unfused reference, which builds fp32 scores of (heads x T x T) for the whole packed row (4 GiB for one
  4096-token row of FLAN-T5-XXL's 64 heads). Where torch.compile cannot run (no Triton, or the first
  compilation fails) the call takes the loop, said once on the console.
- `loop`: lorakit.model.varlen's grouped SDPA: every other case (CPU, fp32 causal rows, attention dropout in
  training, a PyTorch without the kernels). Attention-probability dropout cannot be applied inside the fused
  kernels: `model.attention_dropout` (default 0) sets it, and a value above 0 keeps T5 on this path in
  training. Hidden-state dropout (T5's `dropout_rate`) is applied outside attention and is unaffected.

What a batch's packed attention needs (cu_seqlens, the FlexAttention block mask) is built once per batch on
the device and kept in the batch's segments (`PackedLayout`, in lorakit.model.varlen's segment caches): every
layer and gradient checkpointing's recompute share it, with no host round trip per layer.

Which kernel ran is counted per call kind in the model's KernelLog (ModelInputs.kernels, summary.json's
`attention_kernels`); the first call of each kind with each kernel is named on the console (rank 0). The
log lives as long as the model's ModelInputs, so a second run in one process starts from nothing.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

VARLEN, FLEX, LOOP = "varlen", "flex", "loop"
KINDS = {
    "causal": "causal self-attention",
    "encoder": "T5 encoder self-attention",
    "decoder": "T5 decoder self-attention",
    "cross": "T5 cross-attention",
}
KERNEL_NAMES = {
    VARLEN: "torch varlen_attn (flash, cu_seqlens)",
    FLEX: "compiled FlexAttention (block mask + position-bias score_mod)",
    LOOP: "per-example SDPA (lorakit.model.varlen)",
}


@dataclass
class KernelLog:
    """The packed attention calls of one model (its ModelInputs holds it; each batch's segments carry it to
    the attention function): calls per (kind, kernel), the pairs already named on the console, and, once
    known, why FlexAttention cannot be compiled here with the compiled functions that did run."""

    calls: Counter = field(default_factory=Counter)
    said: set = field(default_factory=set)
    flex_broken: str | None = None
    compiled: set = field(default_factory=set)

    def used(
        self,
        kind: str,
        kernel: str,
        device: torch.device,
        dtype: torch.dtype,
        dropout: float,
        *,
        allowed: Sequence[str] | None = None,
        softcap: float | None = None,
    ) -> None:
        """Count one packed attention call of `kind` on `kernel`; the first of each pair is said (with
        choose_kernel's `allowed` and `softcap`, so the loop's reason is the one that decided)."""
        self.calls[kind, kernel] += 1
        if (kind, kernel) in self.said:
            return
        self.said.add((kind, kernel))
        line = f"packed attention: {KINDS.get(kind, kind)} -> {KERNEL_NAMES[kernel]}"
        if kernel == LOOP:
            bias = kind in ("encoder", "decoder")
            why = _decide(kind, device, dtype, dropout, bias, self.flex_broken, allowed, softcap)[1]
            line += f" ({why})" if why else ""
        _say(line)

    def counts(self) -> dict[str, dict[str, int]]:
        """{kind: {kernel: calls}}, as summary.json's attention_kernels."""
        out: dict[str, dict[str, int]] = {}
        for (kind, kernel), n in sorted(self.calls.items()):
            out.setdefault(kind, {})[kernel] = n
        return out


def varlen_available() -> bool:
    """Whether this PyTorch has torch.nn.attention.varlen.varlen_attn."""
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def flex_available() -> bool:
    """Whether this PyTorch has FlexAttention."""
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def flex_compile_problem(device: torch.device) -> str | None:
    """Why compiled FlexAttention cannot run on `device` (None when it can)."""
    if not flex_available():
        return "this PyTorch has no FlexAttention"
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python"
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "torch.compile needs Triton on CUDA and it is not installed"
    return None


def choose_kernel(
    kind: str,
    device: torch.device,
    dtype: torch.dtype,
    dropout: float,
    *,
    bias: bool,
    log: KernelLog | None = None,
    allowed: Sequence[str] | None = None,
    softcap: float | None = None,
) -> str:
    """The kernel for one packed attention call: VARLEN, FLEX or LOOP (module docstring).

    `kind` is causal (a causal LM's row), encoder, decoder (T5 self-attention) or cross (T5); `bias` says
    whether the call carries a position bias (T5 self-attention does); `log`, the model's KernelLog, whether
    compiling FlexAttention has failed for this model. `allowed`: the kernels the model's family allows for
    this kind (lorakit.model.families.PackedAttention.kernels_for; None: any), the loop otherwise; `softcap`:
    the call caps its attention scores (Gemma 2), which no fused kernel here does, so it takes the loop."""
    flex_broken = log.flex_broken if log is not None else None
    return _decide(kind, device, dtype, dropout, bias, flex_broken, allowed, softcap)[0]


def _decide(
    kind, device, dtype, dropout, bias, flex_broken: str | None = None, allowed=None, softcap=None
) -> tuple[str, str]:
    """(kernel, why the loop) for choose_kernel."""
    if device.type != "cuda":
        return LOOP, f"{device.type}: the fused kernels are CUDA-only"
    if dropout > 0:
        return LOOP, (
            f"attention dropout {dropout:g} in training, which the fused kernels cannot apply; "
            "model.attention_dropout: 0 reaches them"
        )
    if softcap:
        return LOOP, f"attention soft-capping ({softcap:g}), which the fused kernels do not apply"
    kernel, why = _fastest(kind, device, dtype, bias, flex_broken)
    if kernel != LOOP and allowed is not None and kernel not in allowed:
        return (
            LOOP,
            f"the model's family allows {', '.join(allowed)} for {KINDS.get(kind, kind)}, not {kernel}",
        )
    return kernel, why


def _fastest(kind, device, dtype, bias, flex_broken) -> tuple[str, str]:
    """The fused kernel a CUDA call of `kind` can take without dropout, else (LOOP, why)."""
    if kind in ("causal", "cross") and not bias:
        if dtype not in (torch.bfloat16, torch.float16):
            return LOOP, f"{dtype}: varlen_attn takes bf16 or fp16"
        if not varlen_available():
            return LOOP, "this PyTorch has no torch.nn.attention.varlen"
        return VARLEN, ""
    if kind in ("encoder", "decoder") and bias:
        problem = flex_broken or flex_compile_problem(device)
        return (LOOP, problem) if problem else (FLEX, "")
    return LOOP, "no fused kernel for this call"


def _say(line: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


@dataclass(frozen=True)
class PackedLayout:
    """One packed row's example boundaries on the device, built once per batch and attention kind.

    cu: varlen's cumulative int32 offsets (0, end_1, ..., T); longest: the longest example. block_mask: the
    FlexAttention block mask of a T5 self-attention (None for varlen calls)."""

    cu: torch.Tensor
    longest: int
    block_mask: object = None


def cu_seqlens(bounds: Sequence[int], device: torch.device | str) -> tuple[torch.Tensor, int]:
    """Example boundaries (0, end_1, ..., T) as varlen's cumulative int32 offsets, and the longest example."""
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    if not lengths or bounds[0] != 0 or min(lengths) < 1:
        raise ValueError(f"example boundaries must start at 0 and increase, got {tuple(bounds)}")
    # One host-to-device copy per batch (the layout is cached), not one per layer.
    return torch.tensor(list(bounds), dtype=torch.int32).to(device, non_blocking=True), max(lengths)


def varlen_layout(bounds: Sequence[int], device) -> PackedLayout:
    """The PackedLayout of a varlen call over `bounds`."""
    return PackedLayout(*cu_seqlens(bounds, device))


@functools.cache
def _varlen_takes_gqa() -> bool:
    """Whether torch's varlen_attn groups KV heads itself (`enable_gqa`, torch >= 2.12); before that, the
    grouped heads are repeated here."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def varlen_attention(q, k, v, q_layout: PackedLayout, k_layout: PackedLayout, scaling, window_size):
    from torch.nn.attention.varlen import varlen_attn

    # (1, H, T, D) -> (T, H, D): varlen takes the row's tokens as one flat sequence.
    q, k, v = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)
    grouped = {}
    if k.shape[1] != q.shape[1]:
        if _varlen_takes_gqa():
            grouped = {"enable_gqa": True}
        else:
            # Query head i reads KV head i // group, as enable_gqa and SDPA do.
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = varlen_attn(
        q,
        k,
        v,
        q_layout.cu,
        k_layout.cu,
        q_layout.longest,
        k_layout.longest,
        scale=scaling,
        window_size=window_size,
        **grouped,
    )
    return out.unsqueeze(0)  # (1, T, H, D), transformers' attention output layout


def varlen_causal(q, k, v, layout: PackedLayout, scaling: float | None, window: int | None) -> torch.Tensor:
    """Causal attention inside each example of a packed row: (1, H, T, D) in, (1, T, H, D) out. `window`:
    a key at most window - 1 tokens before its query (transformers' sliding_window), or None."""
    return varlen_attention(q, k, v, layout, layout, scaling, (-1, 0) if window is None else (window - 1, 0))


def varlen_cross(q, k, v, q_layout: PackedLayout, k_layout: PackedLayout, scaling) -> torch.Tensor:
    """T5 cross-attention of a packed row pair: decoder example i attends to all of encoder example i."""
    return varlen_attention(q, k, v, q_layout, k_layout, scaling, (-1, -1))


def bias_table(position_bias: torch.Tensor, max_distance: int | None = None) -> torch.Tensor:
    """T5's (1, H, m, m) relative bias of an m-token example as a table by distance k - q.

    Without `max_distance`: (H, 2m - 1), index k - q + m - 1 (the bias's last row holds distances
    -(m-1)..0, its first row 0..m-1). With it, K: (H, 2K + 1) over distances -K..K, index k - q + K. T5's
    bucket is the same for every distance of at least relative_attention_max_distance, so reading the
    distance clamped to +-K is exact for any example length; a table of fixed size keeps the compiled
    kernel's inputs the same shape for every row."""
    m = position_bias.shape[-1]
    table = torch.cat([position_bias[0, :, m - 1, : m - 1], position_bias[0, :, 0, :]], dim=-1)
    if max_distance is None:
        return table
    k = max_distance
    if m - 1 >= k:
        return table[:, m - 1 - k : m + k]
    # Distances beyond m - 1 occur only between examples, which the block mask leaves out.
    pad = k - (m - 1)
    return torch.cat([table[:, :1].expand(-1, pad), table, table[:, -1:].expand(-1, pad)], dim=-1)


def example_index(bounds: Sequence[int], device) -> torch.Tensor:
    """(T,) the example each token of a packed row belongs to."""
    lengths = torch.tensor([e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)])
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)


@functools.cache
def _compiled(device_type: str):
    """(flex_attention, create_block_mask) for `device_type`, compiled once per process: rows of a new
    length recompile at most once, after which the row length is a dynamic dimension."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # CUDA: automatic dynamic shapes (dynamic=None): the first row compiles static, the first row of another
    # length recompiles with that length symbolic and the bias table's shape still fixed. dynamic=True makes
    # the table's size symbolic too, and inductor's FlexAttention lowering then fails in torch 2.11 ("'Shape
    # AsConstantBuffer' object has no attribute 'dtype'", seen on an H200; dynamic=None compiled forward and
    # backward there). CPU, which only tests use (the fused kernels are CUDA-only): static shapes, because in
    # torch 2.13 inductor's C++ FlexAttention template fails to build with symbolic lengths and a mask_mod
    # that reads a tensor ("'cur_kvSplitSize7' was not declared"); there each row length compiles once.
    dynamic = None if device_type != "cpu" else False
    # torch.compile(create_block_mask) is what PyTorch now recommends over create_block_mask(_compile=True):
    # the mask is computed block by block, never as a T x T tensor.
    return torch.compile(flex_attention, dynamic=dynamic), torch.compile(create_block_mask, dynamic=dynamic)


def _keep(span: torch.Tensor):
    # A closure over this batch's (2, T) tensor only: dynamo guards on its shape (dynamic), not its values,
    # so a new batch does not recompile.
    def keep(b, h, q_idx, kv_idx):
        return (kv_idx >= span[0, q_idx]) & (kv_idx <= span[1, q_idx])

    return keep


def _add_bias(table: torch.Tensor, k: int):
    # k (relative_attention_max_distance) is the model's constant and the table's shape (H, 2k + 1) is
    # fixed: one compiled kernel for every row. A 0-d tensor offset here made the CPU kernel dense.
    def add_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, (kv_idx - q_idx).clamp(-k, k) + k]

    return add_bias


def flex_layout(bounds: Sequence[int], *, causal: bool, device, log: KernelLog) -> PackedLayout | None:
    """The PackedLayout of a T5 self-attention over `bounds`, with its block mask (built compiled; None
    when compiling fails, said once)."""
    layout = varlen_layout(bounds, device)
    n = bounds[-1]
    idx = example_index(bounds, "cpu")
    b = torch.tensor(list(bounds))
    start = b[idx]
    limit = torch.arange(n) if causal else b[idx + 1] - 1
    # Where each query's keys start and end: one host-to-device copy per batch and kind.
    span = torch.stack([start, limit]).to(device, non_blocking=True)
    _, create_block_mask = _compiled(torch.device(device).type)
    mask = _first_compile("mask", lambda: create_block_mask(_keep(span), 1, None, n, n, device=device), log)
    return None if mask is None else PackedLayout(layout.cu, layout.longest, mask)


def flex_self_attention(
    q,
    k,
    v,
    layout: PackedLayout,
    position_bias: torch.Tensor,
    *,
    max_distance: int,
    scaling: float | None,
    log: KernelLog,
) -> torch.Tensor | None:
    """T5 self-attention of a packed row with compiled FlexAttention: attention inside each example (the
    layout's block mask) plus T5's bias for each pair's distance. (1, H, T, D) in, (1, T, H, D) out; None
    when compiling fails (said once; the caller takes the loop)."""
    flex, _ = _compiled(q.device.type)
    # Contiguous: a strided view of the bias as the kernel's buffer broke inductor's lowering (CPU).
    table = bias_table(position_bias, max_distance).to(q.dtype).contiguous()
    out = _first_compile(
        "flex",
        lambda: flex(
            q, k, v, score_mod=_add_bias(table, max_distance), block_mask=layout.block_mask, scale=scaling
        ),
        log,
    )
    return None if out is None else out.transpose(1, 2)


def _first_compile(name: str, call, log: KernelLog):
    """call() of the compiled function `name`, where a failure of its first call means compiling is
    impossible here: said once, returns None, and every later call of the model (`log`) takes the loop.
    Later failures are real errors and raise."""
    if name in log.compiled:
        return call()
    try:
        out = call()
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - torch.compile raises many kinds (backend, C++ or Triton build)
        if log.flex_broken is None:
            first = (str(e).strip().splitlines() or [""])[0][:200]
            log.flex_broken = f"compiling FlexAttention failed: {type(e).__name__}: {first}"
            _say(f"packed attention: {log.flex_broken}; T5 self-attention takes per-example SDPA instead")
        return None
    log.compiled.add(name)
    return out
