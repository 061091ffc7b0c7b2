"""Batches -> the keyword arguments of the model's forward, with per-example attention for packed rows.

A packed row holds several examples one after another, with position_ids restarting at 0 for each. How
attention is kept inside each example depends on the backend:

- flash_attention_2: no mask at all. transformers derives cu_seqlens from the restarting position_ids and
  calls the varlen kernel, which never computes attention across examples (and skips the padding work).
- lorakit_varlen_sdpa (what packed recipes load instead of sdpa, see lorakit.model.varlen): the example
  boundaries go to the attention function as `lorakit_segments`, which runs SDPA per example. The
  all-ones 2-D mask passed alongside keeps transformers from building a T x T mask it would not use.
- sdpa / eager: an explicit 4-D block-diagonal causal mask, built here on the device (boolean for sdpa,
  additive float for eager). transformers uses a 4-D mask as given. We do not rely on its detection of
  packed position_ids: that detection is skipped whenever a KV cache is present, and in train mode with
  `use_cache` left on, transformers 5.x let the second example attend to the first. An explicit mask
  holds whatever the cache setting (tests/integration/test_packed_attention.py checks both).

Sliding-window models (Mistral) get the window inside each example; models whose layers mix full and
sliding attention (`config.layer_types`: Gemma 2 and 3) get one mask per layer type, the form their forward
accepts, read from the language model's config (a multimodal checkpoint's text_config). Per-example kernels
take only what the model's family allows (`Family.packed`, carried by the segments).

Encoder-decoder rows (T5) carry `source_segments` / `target_segments` instead. With lorakit_varlen_sdpa
they become segment boundaries (`lorakit_seq2seq_segments`) and `logits` makes sure the model's T5
attention modules carry the hook that computes the relative position bias per example instead of over the
whole row (lorakit.model.varlen). Otherwise they become three 4-D masks: encoder self-attention within an
example, decoder self-attention within an example and causal, and cross-attention from each decoder token
to its own example's encoder tokens only. T5's relative position bias is computed from token distances in
the row, which inside one (contiguous) example are the example's own distances; pairs across examples are
masked. The encoder-self and cross masks have different shapes but T5ForConditionalGeneration takes one
`attention_mask` for both, so `logits` runs the encoder first with its mask and hands the decoder the cross
mask through `encoder_outputs` + `attention_mask`, using only the model's public forward arguments.
"""

from __future__ import annotations

from typing import Any

import torch

from lorakit.data.sequence_split import SEGMENTS
from lorakit.model.families import family_of
from lorakit.model.families.base import text_config
from lorakit.model.fused_attention import KernelLog
from lorakit.model.sequence_parallel import SEQUENCE_PARALLEL, SequenceShard
from lorakit.model.stacked_masks import has_stacked_configs, stacked_packed_kwargs
from lorakit.model.varlen import VARLEN_SDPA, Segments, Seq2SeqSegments, attach_t5_position_bias

MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "decoder_input_ids", "decoder_attention_mask")
# Backends that take a packed row's example boundaries (the sequence-parallel one, for a row not split).
PER_EXAMPLE = (VARLEN_SDPA, SEQUENCE_PARALLEL)
# Passed from __call__ to logits for packed encoder-decoder rows; not a model argument.
CROSS_MASK = "lorakit_cross_attention_mask"


def example_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Index of the example each token belongs to, from position_ids that restart at 0 per example."""
    return (position_ids == 0).cumsum(-1)


def packed_attention_mask(
    position_ids: torch.Tensor, *, attention: str, dtype: torch.dtype, sliding_window: int | None = None
) -> torch.Tensor:
    """(B, 1, T, T) mask letting token q see token k only if both are in one example and k <= q
    (and q - k < sliding_window when given). Boolean (True = attend) for sdpa, additive for eager."""
    seq = example_ids(position_ids)
    t = position_ids.shape[-1]
    idx = torch.arange(t, device=position_ids.device)
    allowed = (seq[:, :, None] == seq[:, None, :]) & (idx[None, :] <= idx[:, None])[None]
    if sliding_window is not None:
        allowed &= (idx[None, :] > idx[:, None] - sliding_window)[None]
    return _as_mask(allowed, attention, dtype)


def _as_mask(allowed: torch.Tensor, attention: str, dtype: torch.dtype) -> torch.Tensor:
    """(B, T, S) boolean -> the (B, 1, T, S) mask the backend takes: boolean for sdpa, additive for eager."""
    allowed = allowed[:, None]
    if attention == "sdpa":
        return allowed
    # eager adds the mask to the scores: 0 where allowed, the dtype's most negative value elsewhere.
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


def seq2seq_packed_masks(
    source_segments: torch.Tensor, target_segments: torch.Tensor, *, attention: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(encoder self, decoder self, cross) masks for packed encoder-decoder rows (segment ids per token)."""
    t = target_segments.shape[-1]
    idx = torch.arange(t, device=target_segments.device)
    encoder = source_segments[:, :, None] == source_segments[:, None, :]
    causal = (idx[None, :] <= idx[:, None])[None]
    decoder = (target_segments[:, :, None] == target_segments[:, None, :]) & causal
    cross = target_segments[:, :, None] == source_segments[:, None, :]
    return tuple(_as_mask(m, attention, dtype) for m in (encoder, decoder, cross))


def _bounds(segments: torch.Tensor) -> tuple[int, ...]:
    """Example boundaries (0, end of example 1, ..., T) of a CPU row of segment ids."""
    change = torch.nonzero(segments[1:] != segments[:-1]).flatten() + 1
    return (0, *change.tolist(), segments.numel())


def _window(config, layer_type: str | None) -> int | None:
    if layer_type is None:
        return getattr(config, "sliding_window", None)
    return getattr(config, "sliding_window", None) if layer_type == "sliding_attention" else None


class ModelInputs:
    """Callable: batch dict -> forward kwargs on `device` (labels excluded: the loss is computed by us).

    Built once per model from its config, attention backend and compute dtype.
    """

    def __init__(
        self, config, attention: str, dtype: torch.dtype, *, sp_group=None, sp_world: int = 1, loss_head=None
    ):
        self.attention, self.dtype = attention, dtype
        # model.tiled_loss: the model's TiledLossHead (lorakit.model.tiled_loss); None: the loss takes logits.
        self.loss_head = loss_head
        # Sequence parallelism: split rows (lorakit.data.sequence_split) attend over this group.
        self.sp_group, self.sp_world = sp_group, sp_world
        # Layer types and windows are the language model's (Gemma 3's multimodal config keeps them in
        # text_config).
        self.config = text_config(config)
        self.layer_types = sorted(set(getattr(self.config, "layer_types", None) or [])) or None
        # The fused kernels each packed attention call kind of this family may take.
        self.packed = family_of(config).packed
        # Which kernel each packed attention call of this model took (summary.json's attention_kernels).
        self.kernels = KernelLog()

    def packed_mask(self, position_ids: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """The attention-mask argument for a packed batch (None for flash attention: varlen from positions)."""
        if self.attention.startswith("flash"):
            return None

        def build(layer_type: str | None) -> torch.Tensor:
            return packed_attention_mask(
                position_ids,
                attention=self.attention,
                dtype=self.dtype,
                sliding_window=_window(self.config, layer_type),
            )

        if self.layer_types is None:
            return build(None)
        return {layer_type: build(layer_type) for layer_type in self.layer_types}

    def __call__(self, batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
        out: dict[str, Any] = {k: batch[k].to(device) for k in MODEL_KEYS if k in batch}
        if SEGMENTS in batch:
            # A shard of a row split over the sequence-parallel group: attention sees the whole row's
            # example boundaries after its all-to-all; no mask is built for the shard.
            out[SEQUENCE_PARALLEL] = SequenceShard(
                Segments(batch[SEGMENTS], self.kernels, self.packed), self.sp_group, self.sp_world
            )
            out["attention_mask"] = torch.ones_like(out["input_ids"])
        elif "source_segments" in batch and self.attention == VARLEN_SDPA:
            out["lorakit_seq2seq_segments"] = Seq2SeqSegments(
                _bounds(batch["source_segments"][0]),
                _bounds(batch["target_segments"][0]),
                self.kernels,
                self.packed,
            )
        elif "source_segments" in batch and has_stacked_configs(self.config):
            # T5Gemma: per layer type, positions restarting per example (lorakit.model.stacked_masks).
            kw = stacked_packed_kwargs(self.config, batch["source_segments"].to(device),
                                       batch["target_segments"].to(device),
                                       lambda m: _as_mask(m, self.attention, self.dtype))  # fmt: skip
            out.update(kw, **{CROSS_MASK: kw.pop("cross")})
        elif "source_segments" in batch:
            encoder, decoder, cross = seq2seq_packed_masks(
                batch["source_segments"].to(device),
                batch["target_segments"].to(device),
                attention=self.attention,
                dtype=self.dtype,
            )
            out.update({"attention_mask": encoder, "decoder_attention_mask": decoder, CROSS_MASK: cross})
        elif "position_ids" in out and "attention_mask" not in out and self.attention in PER_EXAMPLE:
            bounds = _bounds(example_ids(batch["position_ids"])[0])
            out["lorakit_segments"] = Segments(bounds, self.kernels, self.packed)
            out["attention_mask"] = torch.ones_like(out["input_ids"])
        elif "position_ids" in out and "attention_mask" not in out:
            mask = self.packed_mask(out["position_ids"])
            if mask is not None:
                out["attention_mask"] = mask
        return out

    def logits(self, model, batch: dict[str, Any], device: torch.device | str) -> torch.Tensor:
        """Forward `batch` through `model` (a module or a DeepSpeed engine) the way training does."""
        # No KV cache in training or eval loss: it is useless there and changes how transformers builds
        # attention masks (the packed-sequence trap described above).
        kwargs = self(batch, device)
        if "lorakit_seq2seq_segments" in kwargs:
            # T5's position bias per example, not over the whole row (idempotent; see lorakit.model.varlen).
            attach_t5_position_bias(getattr(model, "module", model))
        cross = kwargs.pop(CROSS_MASK, None)
        if cross is not None:
            module = getattr(model, "module", model)  # a DeepSpeed engine wraps the (peft) model
            positions = {"position_ids": kwargs.pop("position_ids")} if "position_ids" in kwargs else {}
            encoder_outputs = module.get_encoder()(
                input_ids=kwargs.pop("input_ids"), attention_mask=kwargs.pop("attention_mask"), **positions
            )
            kwargs.update(encoder_outputs=encoder_outputs, attention_mask=cross)
        return model(**kwargs, use_cache=False).logits

    def token_losses(self, model, batch: dict[str, Any], device: torch.device | str) -> torch.Tensor:
        """Per-token fp32 cross-entropy of `batch` (shaped like its labels, 0 where they are -100) through
        the tiled loss head: the forward of `logits` with no logits of the whole row (model.tiled_loss)."""
        if self.loss_head is None:
            raise ValueError("token_losses needs the tiled loss head (model.tiled_loss)")
        with self.loss_head.targets(batch["labels"].to(device)):
            return self.logits(model, batch, device)
