"""Fused kernels for packed rows on CUDA, from PyTorch itself (no flash-attn package): variable-length flash
attention for causal rows and T5 cross-attention, FlexAttention for T5 self-attention with its position bias.

lorakit.model.varlen asks `choose_kernel` which path a packed attention call takes:

- `varlen`: `torch.nn.attention.varlen.varlen_attn` (PyTorch's flash kernel over cumulative sequence
  boundaries, cu_seqlens): CUDA, bf16/fp16, no attention dropout, no bias. Causal rows of causal LMs
  (sliding windows through `window_size`, grouped KV heads through `enable_gqa`) and T5's cross-attention
  (decoder examples attend to their own encoder example; T5's cross-attention has no bias).
- `flex`: FlexAttention with a block mask that keeps attention inside each example (and causal in the
  decoder) and a score_mod that adds T5's relative position bias, read from a table over distances k - q.
  T5's bias depends on that distance only, so one table per row gives every example its unpacked bias.
  CUDA, no attention dropout (FlexAttention has none).
- `loop`: lorakit.model.varlen's grouped SDPA: every other case (CPU, fp32, attention dropout in training,
  a PyTorch without the kernel). FLAN-T5 trains with dropout_rate 0.1, which applies to attention weights
  too: set it to 0 (model config) for the fused T5 paths.

Which kernel ran is recorded per call kind in KERNELS_USED (read by tests and benchmarks).
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from collections.abc import Sequence

import torch

VARLEN, FLEX, LOOP = "varlen", "flex", "loop"
# (attention kind, kernel) -> calls, since the process started.
KERNELS_USED: Counter = Counter()


def varlen_available() -> bool:
    """Whether this PyTorch has torch.nn.attention.varlen.varlen_attn."""
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def flex_available() -> bool:
    """Whether this PyTorch has FlexAttention."""
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def choose_kernel(kind: str, device: torch.device, dtype: torch.dtype, dropout: float, *, bias: bool) -> str:
    """The kernel for one packed attention call: VARLEN, FLEX or LOOP (module docstring).

    `kind` is causal (a causal LM's row), encoder, decoder (T5 self-attention) or cross (T5); `bias` says
    whether the call carries a position bias (T5 self-attention does)."""
    if device.type != "cuda" or dropout > 0:
        return LOOP
    if kind in ("causal", "cross") and not bias:
        if dtype in (torch.bfloat16, torch.float16) and varlen_available():
            return VARLEN
        return LOOP
    if kind in ("encoder", "decoder") and flex_available():
        return FLEX
    return LOOP


def cu_seqlens(bounds: Sequence[int], device: torch.device | str) -> tuple[torch.Tensor, int]:
    """Example boundaries (0, end_1, ..., T) as varlen's cumulative int32 offsets, and the longest example."""
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    if not lengths or bounds[0] != 0 or min(lengths) < 1:
        raise ValueError(f"example boundaries must start at 0 and increase, got {tuple(bounds)}")
    return torch.tensor(list(bounds), dtype=torch.int32, device=device), max(lengths)


def _varlen(q, k, v, q_bounds, k_bounds, scaling, window_size):
    from torch.nn.attention.varlen import varlen_attn

    cu_q, max_q = cu_seqlens(q_bounds, q.device)
    cu_k, max_k = cu_seqlens(k_bounds, q.device)
    # (1, H, T, D) -> (T, H, D): varlen takes the row's tokens as one flat sequence.
    out = varlen_attn(
        q[0].transpose(0, 1),
        k[0].transpose(0, 1),
        v[0].transpose(0, 1),
        cu_q,
        cu_k,
        max_q,
        max_k,
        scale=scaling,
        window_size=window_size,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out.unsqueeze(0)  # (1, T, H, D), transformers' attention output layout


def varlen_causal(q, k, v, bounds: Sequence[int], scaling: float | None, window: int | None) -> torch.Tensor:
    """Causal attention inside each example of a packed row: (1, H, T, D) in, (1, T, H, D) out. `window`:
    a key at most window - 1 tokens before its query (transformers' sliding_window), or None."""
    KERNELS_USED["causal", VARLEN] += 1
    return _varlen(q, k, v, bounds, bounds, scaling, (-1, 0) if window is None else (window - 1, 0))


def varlen_cross(q, k, v, q_bounds, k_bounds, scaling: float | None) -> torch.Tensor:
    """T5 cross-attention of a packed row pair: decoder example i attends to all of encoder example i."""
    KERNELS_USED["cross", VARLEN] += 1
    return _varlen(q, k, v, q_bounds, k_bounds, scaling, (-1, -1))


def bias_table(position_bias: torch.Tensor) -> torch.Tensor:
    """(H, 2m - 1) bias by distance k - q (index k - q + m - 1) from T5's (1, H, m, m) relative bias of an
    m-token example: its last row holds distances -(m-1)..0, its first row 0..m-1."""
    m = position_bias.shape[-1]
    return torch.cat([position_bias[0, :, m - 1, : m - 1], position_bias[0, :, 0, :]], dim=-1)


def example_index(bounds: Sequence[int], device) -> torch.Tensor:
    """(T,) the example each token of a packed row belongs to."""
    lengths = torch.tensor([e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)], device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)


def flex_self_attention(
    q, k, v, bounds: Sequence[int], position_bias: torch.Tensor, *, causal: bool, scaling: float | None
) -> torch.Tensor:
    """T5 self-attention of a packed row with FlexAttention: attention inside each example (causal in the
    decoder) plus T5's bias for each pair's distance. (1, H, T, D) in, (1, T, H, D) out."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    KERNELS_USED["decoder" if causal else "encoder", FLEX] += 1
    doc = example_index(bounds, q.device)
    table = bias_table(position_bias).to(q.dtype)
    offset = table.shape[-1] // 2  # m - 1
    n = q.shape[2]

    def same_example(b, h, q_idx, kv_idx):
        keep = doc[q_idx] == doc[kv_idx]
        return keep & (kv_idx <= q_idx) if causal else keep

    def add_bias(score, b, h, q_idx, kv_idx):
        # Pairs of different examples are masked; clamp keeps their (unused) index inside the table.
        return score + table[h, (kv_idx - q_idx + offset).clamp(0, 2 * offset)]

    mask = create_block_mask(same_example, 1, None, n, n, device=q.device)
    out = flex_attention(q, k, v, score_mod=add_bias, block_mask=mask, scale=scaling)
    return out.transpose(1, 2)
