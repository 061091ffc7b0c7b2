"""Shared-prompt attention for packed DPO rows: a pair's prompt is computed once for both of its responses.

A packed row holds each pair as one segment [prompt][chosen][rejected] (lorakit.data.pair_collate).
The chosen tokens attend causally to the prompt and to themselves, the rejected tokens to the prompt and to
themselves but never to the chosen ones, and no token to another pair: a tree, not a block-diagonal mask.
The rejected tokens' position ids continue from the prompt's end, so every response sees exactly what it
would see as prompt + response alone (the idea of "Accelerating Direct Preference Optimization with Prefix
Sharing", Wang & Hegde 2024, who use a FlexAttention mask).

How each backend runs the tree, never as eager FlexAttention and without a T x T mask where lorakit has a
per-example path:

- lorakit_varlen_sdpa (what packed recipes with sdpa load) gets the pairs' spans as
  `lorakit_shared_prompt`. Its queries split into two groups per pair, prompt + chosen (keys: the same
  tokens, causal) and rejected (keys: the prompt's and its own, gathered after each other, causal aligned to
  the bottom right, so the rejected token i sees the prompt and rejected tokens 0..i). On CUDA in bf16/fp16
  that is one call of torch's varlen flash kernel (`varlen_attn`, different query and key boundaries; the
  prompt's keys and values are gathered twice, not recomputed); elsewhere one SDPA call per group with the
  explicit (rejected x prompt + rejected) mask: exact on the CPU, where FlexAttention has no backward.
- sdpa / eager (unpacked builds handed a packed row, as the packing contract tests do): the tree as a 4-D
  mask, boolean for sdpa, additive for eager; one per layer type for models mixing sliding and full layers.
- flash_attention_2 takes example boundaries from position ids that restart at 0 and cannot express the
  tree; sequence parallelism refuses DPO. `sharing_problem` says so and the pairs are packed as two
  separate sequences instead (lorakit.data.pair_collate).

Sliding windows count positions, so a rejected token's window over the prompt is the one it has alone.
"""

from __future__ import annotations

from typing import Any

import torch

from lorakit.data.pair_collate import PAIR_SPANS
from lorakit.model.fused_attention import (
    LOOP,
    VARLEN,
    KernelLog,
    PackedLayout,
    choose_kernel,
    cu_seqlens,
    varlen_attention,
)
from lorakit.model.varlen import ROW_ATTENTION, VARLEN_SDPA

# The forward keyword the spans travel under: lorakit_varlen_sdpa hands the row to its `attend`.
SHARED_PROMPT = ROW_ATTENTION


class SharedPromptSpans(tuple):
    """((prompt, chosen, rejected) lengths of every pair of one packed row, in row order), with a `cache`
    of what is derived from them once per forward (gather index, cu_seqlens, masks), as
    lorakit.model.varlen.Segments."""

    def __new__(cls, spans, kernels: KernelLog | None = None):
        self = super().__new__(cls, tuple((int(p), int(c), int(r)) for p, c, r in spans))
        self.cache = {}
        self.kernels = kernels if kernels is not None else KernelLog()
        return self

    def groups(self) -> list[tuple[tuple[int, int], list[tuple[int, int]]]]:
        """Per attention group in row order: (query start, query end), [key (start, end) ranges] (row
        offsets): prompt + chosen over itself, then rejected over the prompt and itself, for every pair."""
        out, s = [], 0
        for p, c, r in self:
            out.append(((s, s + p + c), [(s, s + p + c)]))
            out.append(((s + p + c, s + p + c + r), [(s, s + p), (s + p + c, s + p + c + r)]))
            s += p + c + r
        return out

    def attend(self, module, query, key, value, scaling, dropout, window):
        """The row's tree attention (shared_prompt_attention), as lorakit_varlen_sdpa calls it."""
        return shared_prompt_attention(module, query, key, value, scaling, dropout, self, window)


def sharing_problem(attention: str) -> str | None:
    """Why packed DPO rows cannot share the prompt on the `attention` backend (None when they can)."""
    if attention.startswith("flash"):
        return (
            f"model.attention {attention} (flash-attn) takes example boundaries from position ids restarting "
            "at 0, which cannot express a shared prompt; model.attention sdpa shares it (on CUDA through "
            "torch's varlen flash kernel)"
        )
    return None


def tree_mask(spans: SharedPromptSpans, device, window: int | None = None) -> torch.Tensor:
    """(T, T) boolean: token q may attend to token k (same pair, k not after q, a rejected token never to a
    chosen one; with `window`, fewer than `window` positions back)."""
    pair, part, pos = [], [], []
    for i, (p, c, r) in enumerate(spans):
        pair += [i] * (p + c + r)
        part += [0] * p + [1] * c + [2] * r
        pos += [*range(p + c), *range(p, p + r)]
    pair_t, part_t, pos_t = (torch.tensor(x, device=device) for x in (pair, part, pos))
    idx = torch.arange(len(pair), device=device)
    allowed = (pair_t[:, None] == pair_t[None, :]) & (idx[None, :] <= idx[:, None])
    allowed &= ~((part_t[:, None] == 2) & (part_t[None, :] == 1))
    if window is not None:
        allowed &= pos_t[None, :] > pos_t[:, None] - window
    return allowed


def _mask_argument(spans, attention: str, dtype, device, config, layer_types):
    """The 4-D attention_mask argument of an sdpa / eager forward (a dict by layer type where they mix)."""

    def build(window):
        allowed = tree_mask(spans, device, window)[None, None]
        if attention == "sdpa":
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )

    window = getattr(config, "sliding_window", None)
    if layer_types is None:
        return build(window)
    return {t: build(window if t == "sliding_attention" else None) for t in layer_types}


def shared_prompt_kwargs(inputs, batch: dict[str, Any], device) -> dict[str, Any]:
    """Forward kwargs of a shared-prompt packed batch for `inputs`' backend (a lorakit ModelInputs)."""
    spans = SharedPromptSpans(batch[PAIR_SPANS].tolist(), inputs.kernels)
    out: dict[str, Any] = {k: batch[k].to(device) for k in ("input_ids", "position_ids")}
    if inputs.attention == VARLEN_SDPA:
        out[SHARED_PROMPT] = spans
        # All ones: transformers builds no T x T mask the attention function would not use.
        out["attention_mask"] = torch.ones_like(out["input_ids"])
    elif inputs.attention in ("sdpa", "eager"):
        out["attention_mask"] = _mask_argument(
            spans, inputs.attention, inputs.dtype, device, inputs.config, inputs.layer_types
        )
    else:
        raise ValueError(
            f"shared-prompt rows cannot run on {inputs.attention}: {sharing_problem(inputs.attention)}"
        )
    return out


def _gathered(spans: SharedPromptSpans, device):
    """(key gather index, query layout, key layout) of the varlen call, built once per forward."""

    def build():
        groups = spans.groups()
        index = [i for _, keys in groups for s, e in keys for i in range(s, e)]
        q_bounds, k_bounds = [0], [0]
        for (qs, qe), keys in groups:
            q_bounds.append(q_bounds[-1] + qe - qs)
            k_bounds.append(k_bounds[-1] + sum(e - s for s, e in keys))
        index_t = torch.tensor(index, dtype=torch.long).to(device, non_blocking=True)
        return (
            index_t,
            PackedLayout(*cu_seqlens(q_bounds, device)),
            PackedLayout(*cu_seqlens(k_bounds, device)),
        )

    if "varlen" not in spans.cache:
        spans.cache["varlen"] = build()
    return spans.cache["varlen"]


def _rejected_mask(p: int, r: int, window: int | None, device) -> torch.Tensor:
    """(r, p + r) boolean: rejected token i sees the prompt and rejected tokens 0..i (positions 0..p + i)."""
    i, j = torch.arange(r, device=device)[:, None] + p, torch.arange(p + r, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    return allowed


def shared_prompt_attention(module, query, key, value, scaling, dropout, spans: SharedPromptSpans, window):
    """The tree attention of one packed row: (1, H, T, D) in, ((1, T, H, D) out, None) (module docstring)."""
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one row per micro-batch, got {query.shape[0]}")
    dropout = dropout if module.training else 0.0
    device, log = query.device, spans.kernels
    if choose_kernel("causal", device, query.dtype, dropout, bias=False, log=log) == VARLEN:
        log.used("causal", VARLEN, device, query.dtype, dropout)
        index, q_layout, k_layout = _gathered(spans, device)
        k, v = key.index_select(2, index), value.index_select(2, index)
        # Bottom-right causal alignment of flash: a query group shorter than its keys ends where they end.
        out = varlen_attention(
            query, k, v, q_layout, k_layout, scaling, (-1, 0) if window is None else (window - 1, 0)
        )
        return out, None
    log.used("causal", LOOP, device, query.dtype, dropout)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # split, not slicing: the backward of a slice writes into a zero tensor of the whole row, per slice.
    lengths = [n for span in spans for n in span]
    qs, ks, vs = (t.split(lengths, dim=2) for t in (query, key, value))
    outs = []
    for n, (p, c, r) in enumerate(spans):
        (qp, qc, qr), (kp, kc, kr), (vp, vc, vr) = (t[3 * n : 3 * n + 3] for t in (qs, ks, vs))
        q_pc, k_pc, v_pc = (torch.cat(t, dim=2) for t in ((qp, qc), (kp, kc), (vp, vc)))
        if window is None:
            outs.append(sdpa(q_pc, k_pc, v_pc, dropout_p=dropout, scale=scaling, is_causal=True))
        else:
            mask = _rejected_mask(0, p + c, window, device)
            outs.append(sdpa(q_pc, k_pc, v_pc, attn_mask=mask, dropout_p=dropout, scale=scaling))
        k_pr, v_pr = torch.cat([kp, kr], dim=2), torch.cat([vp, vr], dim=2)
        mask = _rejected_mask(p, r, window, device)
        outs.append(sdpa(qr, k_pr, v_pr, attn_mask=mask, dropout_p=dropout, scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None
