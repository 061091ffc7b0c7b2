"""Packed encoder-decoder rows of models whose stacks are configured apart (T5Gemma: `config.encoder`,
`config.decoder`, each with rotary positions and a `layer_types` list of full and sliding-window attention).

Such a model's forward takes, instead of one mask per stack, a mapping from layer type to mask, and the
positions of each token. For a packed row lorakit gives it: positions restarting at 0 in every example
(`position_ids`, `decoder_position_ids`), per layer type an encoder mask (same example, within the window:
|q - k| <= window, transformers' bidirectional sliding window) and a decoder mask (same example, causal,
k > q - window), and a cross-attention mask (each decoder token to its own example's encoder tokens) under
"full_attention", which is the key the decoder's cross-attention reads. Inside one example the distances
in the row are the example's own, so each example sees exactly what it would see alone.
"""

from __future__ import annotations

import torch


def has_stacked_configs(config) -> bool:
    """Whether `config` configures its encoder and decoder stacks apart, with layer types (T5Gemma)."""
    return all(getattr(getattr(config, s, None), "layer_types", None) for s in ("encoder", "decoder"))


def segment_positions(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) position of each token inside its example, from example ids per token."""
    idx = torch.arange(segments.shape[-1], device=segments.device).expand_as(segments)
    start = torch.ones_like(segments, dtype=torch.bool)
    start[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return idx - torch.where(start, idx, torch.zeros_like(idx)).cummax(-1).values


def _window(stack, layer_type: str) -> int | None:
    return getattr(stack, "sliding_window", None) if layer_type == "sliding_attention" else None


def stacked_packed_kwargs(
    config,
    source_segments: torch.Tensor,
    target_segments: torch.Tensor,
    as_mask,
) -> dict:
    """The forward keywords of a packed row (module docstring); the cross mask under `cross`. `as_mask`
    turns a (B, T, S) boolean (True: attend) into the backend's mask (lorakit.model.inputs._as_mask)."""
    s_idx = torch.arange(source_segments.shape[-1], device=source_segments.device)
    t_idx = torch.arange(target_segments.shape[-1], device=target_segments.device)
    same_src = source_segments[:, :, None] == source_segments[:, None, :]
    same_tgt = (target_segments[:, :, None] == target_segments[:, None, :]) & (
        t_idx[None, :] <= t_idx[:, None]
    )
    encoder, decoder = {}, {}
    for layer_type in set(config.encoder.layer_types):
        w = _window(config.encoder, layer_type)
        near = (s_idx[None, :] - s_idx[:, None]).abs() <= w if w is not None else True
        encoder[layer_type] = as_mask(same_src & near)
    for layer_type in set(config.decoder.layer_types):
        w = _window(config.decoder, layer_type)
        near = t_idx[None, :] > t_idx[:, None] - w if w is not None else True
        decoder[layer_type] = as_mask(same_tgt & near)
    cross = target_segments[:, :, None] == source_segments[:, None, :]
    return {
        "attention_mask": encoder,
        "position_ids": segment_positions(source_segments),
        "decoder_attention_mask": decoder,
        "decoder_position_ids": segment_positions(target_segments),
        "cross": {"full_attention": as_mask(cross)},
    }
