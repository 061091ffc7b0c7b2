"""The loop of lorakit's per-example attention for causal rows: each example of a packed row attends to its
own earlier tokens (within a sliding window when the layer has one), one call per example, so nothing is
computed across examples. SDPA where it computes what the model does; an explicit softmax where the model
caps its scores (Gemma 2's attn_logit_softcapping: tanh(s / c) * c before the softmax), which SDPA cannot."""

from __future__ import annotations

import torch


def _allowed(n: int, window: int | None, device) -> torch.Tensor:
    """(n, n) boolean: query i sees key j <= i, and j > i - window with a window (transformers' rule)."""
    idx = torch.arange(n, device=device)
    allowed = idx[None, :] <= idx[:, None]
    if window is not None:
        allowed &= idx[None, :] > idx[:, None] - window
    return allowed


def _capped(q, k, v, scaling, dropout, window, softcap: float):
    """Attention with soft-capped scores, as transformers' eager attention of Gemma 2 computes it."""
    scores = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~_allowed(q.shape[2], window, q.device), torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, v)


def example_attention(q, k, v, scaling, dropout, window, softcap: float | None = None):
    """Causal attention of one example: (1, H, n, D) queries, keys and values (heads already grouped)."""
    n = q.shape[2]
    if softcap:
        return _capped(q, k, v, scaling, dropout, window, softcap)
    if window is None or n <= window:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, scale=scaling, is_causal=True
        )
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=_allowed(n, window, q.device), dropout_p=dropout, scale=scaling
    )


def causal_loop(module, query, key, value, lengths, scaling, dropout, window, softcap=None) -> torch.Tensor:
    """Every example of a packed causal row on its own: (1, H, T, D) in, (1, T, H, D) out."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    # split, not slicing: the backward of a slice writes its gradient into a zero tensor of the whole row,
    # once per example (quadratic in examples per row); split's backward is one concatenation.
    parts = zip(
        query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2), strict=True
    )
    out = torch.cat(
        [example_attention(q, k, v, scaling, dropout, window, softcap) for q, k, v in parts], dim=2
    )
    return out.transpose(1, 2).contiguous()
