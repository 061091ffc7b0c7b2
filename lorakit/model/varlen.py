"""Per-example SDPA for packed rows: attention cost sum(L_i^2), not T^2, without flash-attn.

Registered with transformers' AttentionInterface (its extension point for attention kernels, so no
monkeypatching) under VARLEN_SDPA. For a packed batch, lorakit.model.inputs passes the example boundaries;
each example's queries attend to its own keys only, with one SDPA call per example, so nothing is computed
across examples and no T x T attention is ever done. Batches without boundaries (eval loss, generation) go
to transformers' own SDPA unchanged.

- Causal LMs get `lorakit_segments` (row boundaries): causal attention within each example.
- Encoder-decoders (T5) get `lorakit_seq2seq_segments` = (encoder boundaries, decoder boundaries). The
  attention module says which attention it is through T5's own attributes: encoder self-attention
  (`is_decoder` false), decoder self-attention (`is_causal` true) or cross-attention (decoder, not
  causal). T5's relative position bias arrives as `position_bias` over the whole row; the block of an
  example is exactly that example's bias, since distances inside a contiguous example do not change.
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


def _seq2seq_attention(module, query, key, value, scaling, dropout, segments, position_bias):
    source, target = segments
    if not getattr(module, "is_decoder", False):
        q_bounds, k_bounds, causal = source, source, False
    elif getattr(module, "is_causal", False):
        q_bounds, k_bounds, causal = target, target, True
    else:
        q_bounds, k_bounds, causal = target, source, False
    outs = []
    for qs, qe, ks, ke in zip(q_bounds[:-1], q_bounds[1:], k_bounds[:-1], k_bounds[1:], strict=True):
        bias = None if position_bias is None else position_bias[:, :, qs:qe, ks:ke]
        if causal:
            n = qe - qs
            future = torch.ones(n, n, dtype=torch.bool, device=query.device).triu(1)
            if bias is None:
                bias = torch.zeros((1, 1, n, n), dtype=query.dtype, device=query.device)
            bias = bias.masked_fill(future, torch.finfo(bias.dtype).min)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, qs:qe],
                key[:, :, ks:ke],
                value[:, :, ks:ke],
                attn_mask=None if bias is None else bias.to(query.dtype),
                dropout_p=dropout,
                scale=scaling,
            )
        )
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


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
    seq2seq = kwargs.pop("lorakit_seq2seq_segments", None)
    if seq2seq is not None:
        dropout = dropout if module.training else 0.0
        return _seq2seq_attention(
            module, query, key, value, scaling, dropout, seq2seq, kwargs.get("position_bias")
        )
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
