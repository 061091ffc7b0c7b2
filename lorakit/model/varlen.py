"""Per-example SDPA for packed rows: attention cost sum(L_i^2), not T^2, without flash-attn (on CUDA, the
fused kernels of lorakit.model.fused_attention where they apply).

Registered with transformers' AttentionInterface (its extension point for attention kernels, so no
monkeypatching) under VARLEN_SDPA. For a packed batch, lorakit.model.inputs passes the example boundaries;
each example's queries attend to its own keys only, with one SDPA call per example, so nothing is computed
across examples and no T x T attention is ever done. Batches without boundaries (eval loss, generation) go
to transformers' own SDPA unchanged.

- Causal LMs get `lorakit_segments` (row boundaries): causal attention within each example.
- Encoder-decoders (T5) get `lorakit_seq2seq_segments` = (encoder boundaries, decoder boundaries). The
  attention module says which attention it is through T5's own attributes: encoder self-attention
  (`is_decoder` false), decoder self-attention (`is_causal` true) or cross-attention (decoder, not
  causal).

T5's relative position bias. T5 builds it in the first layer of each stack, `compute_bias(T, T)` over the
whole row (heads x T x T, quadratic in the packed row's length: 46% of a training step at 4096 tokens per
row), and hands it to the later layers. It depends only on the distance k - q, so the bias of every
example is the top-left L x L block of any bias at least that large. `attach_t5_position_bias` registers a
forward pre-hook (PyTorch's public Module hook API; no transformers code is replaced) on T5's attention
modules that, for packed rows only, supplies T5Attention.forward's own `position_bias` argument: the bias of
the row's longest example, `compute_bias(m, m)`, from the layer's own `relative_attention_bias` weights (so
its gradient is T5's). T5 then skips its whole-row bias and shares this one with the later layers, as it
would its own. Cross-attention has no relative bias in T5 (its `position_bias` is zeros of decoder x
encoder length): the hook hands it a broadcastable zero and the attention function ignores it.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from lorakit.model.bias_attention import bias_sdpa
from lorakit.model.fused_attention import (
    FLEX,
    LOOP,
    VARLEN,
    KernelLog,
    choose_kernel,
    flex_layout,
    flex_self_attention,
    varlen_causal,
    varlen_cross,
    varlen_layout,
)
from lorakit.model.varlen_causal import causal_loop

VARLEN_SDPA = "lorakit_varlen_sdpa"
# Forward keyword of a packed row that attends its own way (shared_prompt's DPO pairs): an object whose
# `attend(module, query, key, value, scaling, dropout, window)` returns what varlen_sdpa_attention returns.
ROW_ATTENTION = "lorakit_row_attention"
# Examples of a packed T5 row are attended in groups padded to a common size when the padding adds no more
# attention work than a call of their own costs: about this many (query x key) score elements (see _buckets).
_CALL_COST = 4096
# What attach_t5_position_bias sets: on a T5 attention module its hook's handle, on the model the count.
T5_BIAS_HOOK, T5_BIAS_MODULES = "lorakit_position_bias_hook", "lorakit_position_bias_modules"


def _lengths(bounds) -> list[int]:  # example lengths from boundaries (0, end 1, ..., T)
    return [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)]


def _buckets(q_lengths: list[int], k_lengths: list[int], call_cost: int) -> list[list[int]]:
    """Examples grouped for batched attention: largest (queries x keys) first, an example joins the current
    group while the padding of every member to the group's longest queries and keys costs no more than the
    calls the group saves, `call_cost` (query x key) elements each. Work, not a share of it: on long
    examples a share of their attention is far more than a call's fixed cost (rows of long-tailed code
    took 19% longer to run forward and backward with 25% padding allowed than with none, docs/packing.md),
    while short examples still share calls."""
    order = sorted(range(len(q_lengths)), key=lambda i: q_lengths[i] * k_lengths[i], reverse=True)
    groups: list[list[int]] = []
    real = longest_q = longest_k = 0
    for i in order:
        q, k = q_lengths[i], k_lengths[i]
        if groups:
            mq, mk = max(longest_q, q), max(longest_k, k)
            n = len(groups[-1])
            if (n + 1) * mq * mk <= real + q * k + n * call_cost:
                groups[-1].append(i)
                real, longest_q, longest_k = real + q * k, mq, mk
                continue
        groups.append([i])
        real, longest_q, longest_k = q * k, q, k
    return groups


class Seq2SeqSegments(tuple):
    """(encoder boundaries, decoder boundaries) of one packed T5 row pair, as `lorakit_seq2seq_segments`.

    Every layer of a stack attends over the same examples with the same position bias, so what the
    attention function derives from them (groups, gather indices, masks, the fused kernels' cu_seqlens and
    block masks on the device) is built once per forward and kept in `cache`, which lives as long as the
    batch's forward arguments (gradient checkpointing's recompute included); `kernels` counts which kernel
    each call took (lorakit.model.fused_attention.KernelLog)."""

    def __new__(cls, source, target, kernels: KernelLog | None = None, packed=None):
        self = super().__new__(cls, (tuple(source), tuple(target)))
        self.cache = {}
        # The model's KernelLog (lorakit.model.inputs.ModelInputs), or one of this batch's own.
        self.kernels = kernels if kernels is not None else KernelLog()
        # The model family's PackedAttention: the fused kernels each call kind may take (None: any).
        self.packed = packed
        return self


class Segments(tuple):
    """Example boundaries (0, end 1, ..., T) of one packed causal row, as `lorakit_segments`, with a `cache`
    of what is derived from them once per batch (varlen's cu_seqlens on the device) and the model's
    KernelLog and its family's kernel table, as Seq2SeqSegments."""

    def __new__(cls, bounds, kernels: KernelLog | None = None, packed=None):
        self = super().__new__(cls, tuple(bounds))
        self.cache = {}
        self.kernels = kernels if kernels is not None else KernelLog()
        self.packed = packed
        return self


def kernel_log(segments) -> KernelLog:
    """The KernelLog that `segments` carry (a fresh one for plain boundary tuples)."""
    return getattr(segments, "kernels", None) or KernelLog()


def allowed_kernels(segments, kind: str) -> tuple[str, ...] | None:
    """The kernels the family whose row `segments` describe allows for `kind` (None: not said, any)."""
    packed = getattr(segments, "packed", None)
    return None if packed is None else tuple(packed.kernels_for(kind))


def _cached(segments, key, build):
    """segments.cache[key], built by build() the first time (every time for segments without a cache)."""
    cache = getattr(segments, "cache", None)
    if cache is None:
        return build()
    if key not in cache:
        cache[key] = build()
    return cache[key]


def _causal(bias: torch.Tensor) -> torch.Tensor:
    """`bias` (..., L, L) with every key after its query masked (the dtype's most negative value)."""
    future = torch.ones(bias.shape[-2:], dtype=torch.bool, device=bias.device).triu(1)
    return bias.masked_fill(future, torch.finfo(bias.dtype).min)


def _seq2seq_attention(module, query, key, value, scaling, dropout, segments, position_bias):
    source, target = segments
    if not getattr(module, "is_decoder", False):
        q_bounds, k_bounds, kind = source, source, "encoder"
    elif getattr(module, "is_causal", False):
        q_bounds, k_bounds, kind = target, target, "decoder"
    else:
        # T5's cross-attention bias is zero (no relative positions between decoder and encoder tokens).
        q_bounds, k_bounds, kind, position_bias = target, source, "cross", None
    device, log, allowed = query.device, kernel_log(segments), allowed_kernels(segments, kind)
    bias = position_bias is not None
    kernel = choose_kernel(kind, device, query.dtype, dropout, bias=bias, log=log, allowed=allowed)
    if kernel == VARLEN:
        log.used(kind, VARLEN, device, query.dtype, dropout, allowed=allowed)
        q_layout = _cached(segments, ("varlen", "target"), lambda: varlen_layout(target, device))
        k_layout = _cached(segments, ("varlen", "source"), lambda: varlen_layout(source, device))
        return varlen_cross(query, key, value, q_layout, k_layout, scaling), None
    if kernel == FLEX:
        layout = _cached(
            segments,
            ("flex", kind),
            lambda: flex_layout(q_bounds, causal=kind == "decoder", device=device, log=log),
        )
        # T5's constant (128 in FLAN-T5): a bias table of one size for every row.
        distance = getattr(module, "relative_attention_max_distance", None) or position_bias.shape[-1] - 1
        out = None
        if layout is not None:
            out = flex_self_attention(
                query, key, value, layout, position_bias, max_distance=distance, scaling=scaling, log=log
            )
        if out is not None:
            log.used(kind, FLEX, device, query.dtype, dropout, allowed=allowed)
            return out, None
    log.used(kind, LOOP, device, query.dtype, dropout, allowed=allowed)
    cache = getattr(segments, "cache", None)
    cache = {} if cache is None else cache
    if kind not in cache:
        cache[kind] = _loop_plan(kind, _lengths(q_bounds), _lengths(k_bounds), device)
    plan = cache[kind]
    min_value = torch.finfo(query.dtype).min
    bias = None
    if position_bias is not None:
        # Any example's bias is the top-left block: T5's bias depends on the distance k - q only.
        bias = position_bias.to(query.dtype)
        if kind == "decoder" and position_bias is not cache.get("causal_bias"):
            # Not the hook's bias (already causal): mask the future here.
            bias = _causal(bias)
    # A group's mask depends only on the row and the bias, the same in every layer of the stack and in
    # gradient checkpointing's recompute: built once per forward. Not when it carries a gradient (full
    # fine-tuning trains the bias): sharing it across layers and recompute would tangle autograd graphs.
    keep = bias is None or not bias.requires_grad
    # (1, H, T, D) -> (T, H, D): rows are gathered along dim 0 (a view: T5 hands the heads transposed).
    q_rows, k_rows, v_rows = (t[0].transpose(0, 1) for t in (query, key, value))
    outs = []
    # One SDPA call per group of similar-sized examples padded to a common size (_buckets), not one per
    # example: each call has a fixed cost, which short examples pay more than their own attention. A group is gathered from the row with one index per tensor (padded slots
    # repeat a real row of their example, which the mask hides), not assembled by per-example pads.
    for g, group in enumerate(plan["groups"]):
        n, mq, mk = len(group.members), group.mq, group.mk
        mask = plan.get(g) if keep else None
        if mask is None:
            mask = _group_mask(kind, mq, mk, bias, group.valid, query.device, min_value)
            if keep:
                plan[g] = mask
        q = q_rows.index_select(0, group.q_index).view(n, mq, *q_rows.shape[1:]).transpose(1, 2)
        k = k_rows.index_select(0, group.k_index).view(n, mk, *k_rows.shape[1:]).transpose(1, 2)
        v = v_rows.index_select(0, group.k_index).view(n, mk, *v_rows.shape[1:]).transpose(1, 2)
        # With T5's bias on the fused backend the probe chose (lorakit.model.bias_attention).
        sdpa = bias_sdpa if bias is not None else torch.nn.functional.scaled_dot_product_attention
        out = sdpa(q, k, v, mask, dropout_p=dropout, scale=scaling)
        # (n, H, mq, D) -> (n * mq, H, D): the group's rows, padded slots included.
        outs.append(out.transpose(1, 2).reshape(n * mq, out.shape[1], out.shape[3]))
    # The groups' rows back in row order, padded slots left out: (T, H, D) -> (1, T, H, D).
    flat = outs[0] if len(outs) == 1 else torch.cat(outs)
    return flat.index_select(0, plan["inverse"]).unsqueeze(0), None


def _slots(start: int, length: int, size: int, total: int) -> list[int]:
    """Row positions of one example padded to `size`: its own, then its last one repeated (an empty
    example, which lorakit's data never holds, repeats a neighbour; the mask hides padded keys)."""
    last = min(start + max(length, 1), total) - 1
    return [min(start + t, last) for t in range(size)]


class _Group(NamedTuple):
    """One SDPA call of the loop: its examples, the row positions their padded queries and keys are
    gathered from, their padded sizes, and which padded keys are real (_padded_keys)."""

    members: list[int]
    q_index: torch.Tensor
    k_index: torch.Tensor
    mq: int
    mk: int
    valid: torch.Tensor | None


def _loop_plan(kind: str, q_lengths: list[int], k_lengths: list[int], device) -> dict:
    """How the loop attends over one packed row pair's examples for one attention `kind`: the groups
    (_buckets, as _Group: a padded slot repeats its example's last real row) and `inverse`, each query row's
    place among the groups' outputs. Built on the host and copied once per batch (cached by the caller),
    not once per layer."""
    q_starts = [0, *itertools.accumulate(q_lengths)]
    k_starts = [0, *itertools.accumulate(k_lengths)]
    groups, inverse, offset = [], [0] * q_starts[-1], 0
    for members in _buckets(q_lengths, k_lengths, _CALL_COST):
        mq, mk = max(q_lengths[i] for i in members), max(k_lengths[i] for i in members)
        q_index, k_index = [], []
        for j, i in enumerate(members):
            q_index += _slots(q_starts[i], q_lengths[i], mq, q_starts[-1])
            k_index += _slots(k_starts[i], k_lengths[i], mk, k_starts[-1])
            for t in range(q_lengths[i]):
                inverse[q_starts[i] + t] = offset + j * mq + t
        offset += len(members) * mq
        q_index, k_index = (torch.tensor(x, dtype=torch.long).to(device) for x in (q_index, k_index))
        valid = _padded_keys(kind, members, k_lengths, mk, device)
        groups.append(_Group(members, q_index, k_index, mq, mk, valid))
    return {"groups": groups, "inverse": torch.tensor(inverse).to(device)}


def _padded_keys(kind, group, k_lengths, mk, device) -> torch.Tensor | None:
    """(n, 1, 1, mk) True where a group member's key is real (None when no member is padded, or in the
    decoder, whose causal mask already hides a shorter example's padded keys)."""
    lengths = [k_lengths[i] for i in group]
    if kind == "decoder" or len(group) == 1 or min(lengths) == mk:
        return None
    valid = torch.arange(mk)[None, :] < torch.tensor(lengths)[:, None]
    return valid[:, None, None, :].to(device, non_blocking=True)


def _group_mask(kind, mq, mk, bias, valid, device, min_value):
    """The attn_mask of one group: its block of the bias, with the padded keys of shorter members masked.
    Contiguous: SDPA's fused kernels take a strided mask only through a padded copy, or not at all."""
    if kind == "decoder":
        if bias is None:
            return torch.ones(mq, mk, dtype=torch.bool, device=device).tril()
        # The bias is causal: that also masks a shorter example's padded keys, which lie after its queries.
        return bias[:, :, :mq, :mk].contiguous()
    mask = None if bias is None else bias[:, :, :mq, :mk].contiguous()
    if valid is None:
        return mask
    return valid if mask is None else mask.masked_fill(~valid, min_value)


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
    row = kwargs.pop(ROW_ATTENTION, None)
    if row is not None:
        return row.attend(module, query, key, value, scaling, dropout, kwargs.get("sliding_window"))
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
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    dropout = dropout if module.training else 0.0
    device, log = query.device, kernel_log(segments)
    choice = {"allowed": allowed_kernels(segments, "causal"), "softcap": softcap}
    if choose_kernel("causal", device, query.dtype, dropout, bias=False, log=log, **choice) == VARLEN:
        log.used("causal", VARLEN, device, query.dtype, dropout, **choice)
        layout = _cached(segments, "varlen", lambda: varlen_layout(segments, device))
        return varlen_causal(query, key, value, layout, scaling, window), None
    log.used("causal", LOOP, device, query.dtype, dropout, **choice)
    return causal_loop(module, query, key, value, _lengths(segments), scaling, dropout, window, softcap), None


def register_varlen_sdpa() -> str:
    """Make VARLEN_SDPA loadable as an attn_implementation (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    # Eager under torch.compile (lorakit.model.compile): its host-side planning reads the row's example
    # lengths, which a graph would guard on and recompile for at every new packing.
    AttentionInterface.register(VARLEN_SDPA, torch.compiler.disable(varlen_sdpa_attention))
    # Unpacked batches (eval loss, left-padded generation) need transformers' usual SDPA masks.
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN_SDPA, sdpa_mask)
    return VARLEN_SDPA


def _t5_position_bias_hook(module, args, kwargs):
    """Forward pre-hook on a T5 attention module: for packed rows whose bias is not yet computed, pass the
    bias of the longest example (or T5's zero cross-attention bias) as its `position_bias` argument."""
    segments = kwargs.get("lorakit_seq2seq_segments")
    if segments is None or kwargs.get("position_bias") is not None:
        return None
    hidden = args[0] if args else kwargs["hidden_states"]
    if kwargs.get("key_value_states") is not None or not module.has_relative_attention_bias:
        bias = torch.zeros((1, module.n_heads, 1, 1), dtype=hidden.dtype, device=hidden.device)
    else:
        longest = max(_lengths(segments[1] if module.is_decoder else segments[0]))
        bias = module.compute_bias(longest, longest, device=hidden.device)
        cache = getattr(segments, "cache", None)
        if module.is_decoder and cache is not None:
            # Decoder self-attention is causal in every layer: mask the shared bias once, here, rather than
            # in each layer (the top-left block of a causal bias is causal).
            bias = cache["causal_bias"] = _causal(bias)
    return args, {**kwargs, "position_bias": bias}


def _is_t5_attention(module: torch.nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("compute_bias", "has_relative_attention_bias", "n_heads"))


def attach_t5_position_bias(model: torch.nn.Module) -> int:
    """Register the per-example position-bias hook on every T5 attention module of `model` that lacks it
    (idempotent); returns how many modules have it. Only packed rows (`lorakit_seq2seq_segments`) use it.
    Each module keeps its hook's handle (T5_BIAS_HOOK) and the model the count, so the state lives and dies
    with the model."""
    count = getattr(model, T5_BIAS_MODULES, None)
    if count is not None:  # called for every packed batch: skip the walk over the modules
        return count
    count = 0
    for module in model.modules():
        if not _is_t5_attention(module):
            continue
        if getattr(module, T5_BIAS_HOOK, None) is None:
            handle = module.register_forward_pre_hook(_t5_position_bias_hook, with_kwargs=True)
            setattr(module, T5_BIAS_HOOK, handle)
        count += 1
    setattr(model, T5_BIAS_MODULES, count)
    return count
