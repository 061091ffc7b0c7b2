"""Per-example SDPA for packed rows: attention cost sum(L_i^2), not T^2, without flash-attn.

Registered with transformers' AttentionInterface (its extension point for attention kernels, so no
monkeypatching) under VARLEN_SDPA. For a packed batch, lorakit.model.inputs passes the example boundaries
as `lorakit_segments`; each example's queries attend causally to its own keys only, with one SDPA call per
example, so nothing is computed across examples and no T x T mask is ever built. Batches without
boundaries (eval loss, generation) go to transformers' own SDPA unchanged.
"""

from __future__ import annotations

import torch

VARLEN_SDPA = "lorakit_varlen_sdpa"


def _segment_attention(q, k, v, scaling, dropout, window):
    n = q.shape[2]
    if window is None or n <= window:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, scale=scaling, is_causal=True
        )
    idx = torch.arange(n, device=q.device)
    allowed = (idx[None, :] <= idx[:, None]) & (idx[None, :] > idx[:, None] - window)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, dropout_p=dropout, scale=scaling
    )


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    """transformers attention function: (B, H, T, D) inputs -> ((B, T, H, D) output, None)."""
    segments = kwargs.pop("lorakit_segments", None)
    if segments is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one row per micro-batch, got {query.shape[0]}")
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    window = kwargs.get("sliding_window")
    dropout = dropout if module.training else 0.0
    out = torch.cat(
        [
            _segment_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], scaling, dropout, window)
            for s, e in zip(segments[:-1], segments[1:], strict=True)
        ],
        dim=2,
    )
    return out.transpose(1, 2).contiguous(), None


def register_varlen_sdpa() -> str:
    """Make VARLEN_SDPA loadable as an attn_implementation (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    # Unpacked batches (eval loss, left-padded generation) need transformers' usual SDPA masks.
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN_SDPA, sdpa_mask)
    return VARLEN_SDPA
