"""Sequence parallelism's model side (DeepSpeed Ulysses): attention over a row split across ranks.

Every layer outside attention works token by token, so each rank of a sequence-parallel group runs them
on its own slice of the row (lorakit.data.sequence_split). Attention needs the whole row: before it, an
all-to-all turns (all heads, 1/N of the tokens) into (1/N of the heads, all tokens) on every rank; the
rank attends its heads over the whole row with lorakit's per-example kernel (lorakit.model.varlen: the
example boundaries of the whole row, so packed examples stay isolated); a second all-to-all turns the
output back into (all heads, its tokens). The backward of an all-to-all is the same exchange of the
gradients, so every rank's parameter gradients are its share of the whole row's.

Registered through transformers' AttentionInterface under SEQUENCE_PARALLEL (no monkeypatching). A call
without `lorakit_sequence_parallel` (evaluation, generation: whole rows on one rank) is plain attention.

Why not DeepSpeed's UlyssesSPAttentionHF: its `register_with_transformers` replaces the model's entry in
transformers' ALL_ATTENTION_FUNCTIONS for the whole process, builds its groups in DeepSpeed's global state
(parallel_state_sp), all-gathers the position ids in every layer and drops the attention mask, relying on
the core kernel to find example boundaries from the gathered positions; here the boundaries are computed
once per row and the core kernel is lorakit's, which the packed tests already hold to exactness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lorakit.errors import RecipeError

SEQUENCE_PARALLEL = "lorakit_sequence_parallel"


@dataclass(frozen=True)
class SequenceShard:
    """What attention needs to see a split row whole: the example boundaries of the whole (padded) row and
    the sequence-parallel group (`lorakit_sequence_parallel` forward argument)."""

    bounds: tuple[int, ...]
    group: Any
    world: int


class _Exchange(torch.autograd.Function):
    """all_to_all_single over dim 0 (one block per rank); its gradient is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    # Both buffers contiguous: empty_like of a permuted view would keep its strides, and the collective
    # reads and writes raw memory in dim-0 blocks.
    x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x, group=group)
    return out


def sequence_to_heads(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """(B, H, T/N, D) on each rank -> (B, H/N, T, D): this rank's heads over the whole row."""
    b, h, t, d = x.shape
    blocks = x.reshape(b, world, h // world, t, d).permute(1, 0, 2, 3, 4)
    got = _Exchange.apply(blocks, group)  # [source rank] -> its slice of the row, for this rank's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * t, d)


def heads_to_sequence(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """(B, T, H/N, D) (an attention output) -> (B, T/N, H, D): every head over this rank's tokens."""
    b, t, h, d = x.shape
    blocks = x.reshape(b, world, t // world, h, d).permute(1, 0, 2, 3, 4)
    got = _Exchange.apply(blocks, group)  # [source rank] -> its heads, for this rank's tokens
    return got.permute(1, 2, 0, 3, 4).reshape(b, t // world, world * h, d)


def sequence_parallel_attention(module: torch.nn.Module, query, key, value, attention_mask, **kwargs):
    """transformers attention function: (B, H, T/N, D) inputs of a split row -> ((B, T/N, H, D), None);
    dropout, scaling and the rest go to varlen_sdpa_attention as transformers passes them."""
    from lorakit.model.varlen import varlen_sdpa_attention

    shard: SequenceShard | None = kwargs.pop(SEQUENCE_PARALLEL, None)
    if shard is None:
        return varlen_sdpa_attention(module, query, key, value, attention_mask, **kwargs)
    g, n = shard.group, shard.world
    q, k, v = (sequence_to_heads(t, g, n) for t in (query, key, value))
    out, _ = varlen_sdpa_attention(module, q, k, v, None, lorakit_segments=shard.bounds, **kwargs)
    return heads_to_sequence(out, g, n), None


def register_sequence_parallel() -> str:
    """Make SEQUENCE_PARALLEL loadable as an attn_implementation (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(SEQUENCE_PARALLEL, sequence_parallel_attention)
    # Whole rows (eval loss, left-padded generation) take transformers' usual SDPA masks.
    ALL_MASK_ATTENTION_FUNCTIONS.register(SEQUENCE_PARALLEL, sdpa_mask)
    return SEQUENCE_PARALLEL


def check_sequence_parallel(sequence_parallel: int, config) -> None:
    """Refuse a sequence-parallel degree the model cannot split: encoder-decoders, and head counts it does
    not divide (each rank attends H/N query heads with their own key/value heads)."""
    if sequence_parallel == 1:
        return
    field = f"distributed.sequence_parallel {sequence_parallel}"
    if getattr(config, "is_encoder_decoder", False):
        raise RecipeError(
            f"{field}: sequence parallelism splits causal LMs' packed rows; {config.model_type!r} is an "
            "encoder-decoder (see docs/long-context.md for what its encoder would need). Set it to 1",
            doc="docs/long-context.md#encoder-decoders",
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads is None:
        raise RecipeError(f"{field}: the model config names no num_attention_heads to split over ranks")
    if heads % sequence_parallel or kv_heads % sequence_parallel:
        usable = [n for n in range(1, kv_heads + 1) if heads % n == 0 and kv_heads % n == 0]
        raise RecipeError(
            f"{field}: must divide the model's attention heads ({heads}) and key/value heads ({kv_heads}), "
            f"since each rank attends 1/N of them over the whole row; use one of {usable}",
            doc="docs/long-context.md#choosing-n",
        )
