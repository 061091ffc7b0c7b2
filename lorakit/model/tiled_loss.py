"""Tiled loss (ALST's tiled logits + loss): a causal LM's output head and cross-entropy computed over tiles of
the sequence, so that no logits of the whole row ever exist.

Untiled, the head's logits of a row (tokens x vocabulary in model dtype: 4 GB for 16k tokens of Llama-3's
128k vocabulary in bf16) are kept for the backward, and their gradient of the same size is made at its start
(lorakit.model.loss walks them in fp32 chunks). Here the last hidden states go to `_TiledHeadLoss`, which
runs the head and the fp32 cross-entropy one tile of tokens at a time under no_grad, keeps only the hidden
states, and in the backward recomputes each tile's logits with grad and backpropagates them before the
next: at most one tile of logits (tile x vocabulary, in fp32 and model dtype) is alive, for one more head
forward per step. Tiles of about LOSS_TILE_ELEMENTS logits by default.

How it composes:
- `TiledLossHead` takes the place of the model's output embeddings (`lm_head`), adopting its parameters
  under their own names (lorakit.model.tiling), after peft (a head with LoRA runs its LoRA layers in the
  tiles). Called while `targets(labels)` is active it returns the per-token fp32 losses (0 on ignored
  tokens) instead of logits, from inside the model's own forward, so DeepSpeed sees an ordinary submodule
  call; otherwise (generation, evaluation without it) it is the head.
- The parameter gradients (the head's weight when it trains, tied to the input embeddings or not, a head's
  LoRA weights) are summed over the tiles here and handed to autograd once, as the tiled MLP does.
- ZeRO-3: the wrapper is a ZeRO-3 leaf, so the partitioned head weight is gathered once for the forward's
  tiles and once for the backward's, not per tile.
- Only families whose causal LM forward is exactly `lm_head(last hidden states)` (no logit scaling or soft
  capping): those whose lorakit.model.families.Family says `tiled_loss`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from lorakit.data.collate import IGNORE_INDEX
from lorakit.errors import RecipeError
from lorakit.model.families import family_for_type, family_of, tiled_loss_types
from lorakit.model.tiled_mlp import LONG_ROW_TOKENS
from lorakit.model.tiling import Adopting, has_dropout, replayed, rng_state
from lorakit.recipe.known_objectives import spec_of

# fp32 logits per tile by default (2**25 x 4 bytes = 128 MiB), as lorakit.model.loss's chunks: 261 tokens
# of Llama-3's 128k vocabulary, 1024 of a 32k one.
LOSS_TILE_ELEMENTS = 2**25


def _tile_losses(head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-token fp32 cross-entropy of one tile (0 on ignored tokens)."""
    return F.cross_entropy(head(x).float(), y, ignore_index=IGNORE_INDEX, reduction="none")


class _TiledHeadLoss(torch.autograd.Function):
    """(N, H) hidden states, (N,) labels -> (N,) fp32 token losses through `head`, tile by tile; backward
    recomputes each tile (module docstring). `params`: the head's trainable parameters."""

    @staticmethod
    def forward(ctx, head: nn.Module, x: torch.Tensor, y: torch.Tensor, tile: int, stochastic: bool, *params):
        ctx.head, ctx.tile, ctx.params = head, tile, params
        ctx.rng = rng_state(x.device) if stochastic else None
        ctx.save_for_backward(x, y)
        with torch.no_grad():
            return torch.cat(
                [_tile_losses(head, a, b) for a, b in zip(x.split(tile), y.split(tile), strict=True)]
            )

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, y = ctx.saved_tensors
        want_x = ctx.needs_input_grad[1]
        x_grad = torch.empty_like(x) if want_x else None
        sums: list[torch.Tensor | None] = [None] * len(ctx.params)
        start = 0
        with replayed(ctx.rng, x.device):
            for a, b, g in zip(x.split(ctx.tile), y.split(ctx.tile), grad.split(ctx.tile), strict=True):
                a = a.detach().requires_grad_(want_x)
                with torch.enable_grad():
                    losses = _tile_losses(ctx.head, a, b)
                # autograd.grad: nothing accumulates into the parameters inside the loop (lorakit.model.
                # tiled_mlp says why DeepSpeed needs that).
                got = torch.autograd.grad(
                    losses, ([a] if want_x else []) + list(ctx.params), g, allow_unused=True
                )
                if want_x:
                    x_grad.narrow(0, start, a.shape[0]).copy_(got[0])
                    start += a.shape[0]
                    got = got[1:]
                for k, gp in enumerate(got):
                    if gp is not None:
                        sums[k] = gp if sums[k] is None else sums[k].add_(gp)
        return None, x_grad, None, None, None, *sums


class TiledLossHead(Adopting):
    """The output head; while `targets(labels)` is active, its forward returns the per-token fp32 losses of
    the hidden states against `labels` (shaped like them, 0 where labels are -100), computed in tiles of
    `tile_tokens` tokens (module docstring)."""

    def __init__(self, head: nn.Module, tile_tokens: int):
        if tile_tokens < 1:
            raise ValueError(f"tile_tokens must be at least 1, got {tile_tokens}")
        super().__init__(head)
        self.tile_tokens = tile_tokens
        object.__setattr__(self, "_labels", None)

    @contextlib.contextmanager
    def targets(self, labels: torch.Tensor):
        """Within the block, a forward returns token losses against `labels` instead of logits."""
        object.__setattr__(self, "_labels", labels)
        try:
            yield
        finally:
            object.__setattr__(self, "_labels", None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        labels = self._labels
        if labels is None:
            return self.inner(hidden)
        if labels.shape != hidden.shape[:-1]:
            raise ValueError(
                f"labels {tuple(labels.shape)} do not match the hidden states {tuple(hidden.shape)}"
            )
        params = [p for p in self.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
        flat = hidden.reshape(-1, hidden.shape[-1])
        losses = _TiledHeadLoss.apply(
            self.inner, flat, labels.reshape(-1), self.tile_tokens, has_dropout(self), *params
        )
        return losses.view(labels.shape)


def _parent_of(model: nn.Module, module: nn.Module) -> tuple[nn.Module, str] | None:
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is module:
                return parent, name
    return None


def apply_tiled_loss(model: nn.Module, tile_tokens: int) -> TiledLossHead | None:
    """Put a TiledLossHead in place of `model`'s output embeddings (a peft model's or a transformers
    model's); returns it (None: the model has no head to wrap). After peft, before deepspeed.initialize."""
    head = model.get_output_embeddings()
    if head is None or isinstance(head, TiledLossHead):
        return head
    found = _parent_of(model, head)
    if found is None:
        return None
    parent, name = found
    wrapper = TiledLossHead(head, tile_tokens)
    setattr(parent, name, wrapper)
    return wrapper


def planned_loss_tile(recipe, row_tokens: int | None, vocab: int, model_type: str | None) -> int | None:
    """Tokens per loss tile for rows of `row_tokens` tokens (None: train.max_tokens) of a causal LM of
    `model_type` with a `vocab`-entry head; None: the untiled loss. model.tiled_loss auto tiles SFT with
    sequence parallelism or rows of LONG_ROW_TOKENS tokens or more, for the families whose logits are the
    head's output (Family.tiled_loss)."""
    m = recipe.model
    if m.tiled_loss is False or spec_of(recipe).no_tiled_loss is not None:
        return None
    if m.tiled_loss == "auto":
        if not family_for_type(model_type).tiled_loss:
            return None
        if recipe.distributed.sequence_parallel == 1:
            row = recipe.train.max_tokens if row_tokens is None else row_tokens
            if row is None or row < LONG_ROW_TOKENS:
                return None
    return m.loss_tile_tokens or max(1, LOSS_TILE_ELEMENTS // max(vocab, 1))


def loss_tile_tokens(recipe, config) -> int | None:
    """The loss tile size (tokens) the recipe asks for on a model of `config`; None: the untiled loss.
    RecipeError for model.tiled_loss: true on a model it cannot tile."""
    if recipe.model.tiled_loss is True and not family_of(config).tiles_loss(config):
        raise RecipeError(
            f"model.tiled_loss: true computes the head and loss in tiles for causal LMs whose logits are "
            f"the head's output ({', '.join(tiled_loss_types())}); {config.model_type!r} is not one. Set "
            "model.tiled_loss: auto or false"
        )
    if getattr(config, "is_encoder_decoder", False) or not family_of(config).tiles_loss(config):
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return planned_loss_tile(recipe, None, getattr(text, "vocab_size", 0) or 0, config.model_type)
