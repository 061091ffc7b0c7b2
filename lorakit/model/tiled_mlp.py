"""Tiled MLP (ALST's TiledMLP): a decoder layer's MLP computed over tiles of the sequence, so that only one
tile's intermediate activations are alive at a time.

A long row's MLP is the largest activation of a causal LM: Llama-3-8B's gate and up projections of a
16k-token row are 16k x 14336 each, several GB with the activation and product autograd keeps. The MLP
works token by token, so its output over a row is the concatenation of its outputs over tiles of the row.
`TiledMLP` runs the tiles one after another without keeping any graph (forward under no_grad), keeps only
its input, and in the backward recomputes each tile with grad and backpropagates it before the next: the
intermediate is one tile's, the input and its gradient stay whole. The cost is one more MLP forward.

How it composes:
- It replaces each decoder layer's `mlp` module by a wrapper that adopts the MLP's children under their own
  names (parameter names, saved adapters and checkpoints are unchanged) and calls the MLP's own forward on
  each tile; transformers is not patched. It wraps after peft, so the tiles run peft's LoRA layers.
- Dropout inside the MLP (LoRA's): the backward replays the forward's random stream, so the recomputed
  tiles drop what the forward dropped.
- Gradient checkpointing: the checkpointed layer's recompute runs the tiled forward again (three MLP
  forwards per step in all); nothing else changes.
- DeepSpeed ZeRO-3: the wrapper is a ZeRO-3 leaf module (deepspeed.utils.set_z3_leaf_module): its
  parameters are gathered once when the wrapper's forward (or backward) starts and released when it ends,
  not once per tile, and the number of tiles may differ between ranks (rows of different lengths) without
  the ranks' all-gathers falling out of step.
- Gradients: the backward sums each trainable parameter's gradient over the tiles itself and hands the
  sum to autograd, which accumulates it once, so ZeRO-2's and ZeRO-3's per-parameter reduction hooks fire
  once per backward, as for an untiled MLP. (Accumulating tile by tile, as DeepSpeed's own TiledMLP does
  with its `ds_grad_is_ready` flag, failed here under ZeRO-2 with DeepSpeed 0.19.8: "The parameter ... has
  already been reduced" in the first backward; ZeRO-2 counts its hooks per backward phase.)
"""

from __future__ import annotations

import torch
from torch import nn

from lorakit.errors import RecipeError
from lorakit.model.families import family_of
from lorakit.model.families.base import dense_decoder_mlp
from lorakit.model.tiling import Adopting, has_dropout, replayed, rng_state

# auto: tile when one packed row (per rank) holds at least this many tokens, or with sequence parallelism.
LONG_ROW_TOKENS = 32768


class _TiledForward(torch.autograd.Function):
    """mlp(x) tile by tile along dim -2; backward recomputes each tile (module docstring). `params`: the
    MLP's trainable parameters, inputs of the function: their gradients are summed over the tiles here and
    returned, so autograd accumulates each once per backward, as for any other operation."""

    @staticmethod
    def forward(ctx, mlp: nn.Module, x: torch.Tensor, tile: int, stochastic: bool, *params) -> torch.Tensor:
        ctx.mlp, ctx.tile, ctx.params = mlp, tile, params
        ctx.rng = rng_state(x.device) if stochastic else None
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([mlp(t) for t in x.split(tile, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[1]
        x_grad = torch.empty_like(x) if want_x else None
        sums: list[torch.Tensor | None] = [None] * len(ctx.params)
        start = 0
        with replayed(ctx.rng, x.device):
            for t, g in zip(x.split(ctx.tile, dim=-2), grad.split(ctx.tile, dim=-2), strict=True):
                t = t.detach().requires_grad_(want_x)
                with torch.enable_grad():
                    out = ctx.mlp(t)
                # autograd.grad, not backward: nothing is accumulated into the parameters inside the loop,
                # so DeepSpeed's per-parameter gradient hooks (ZeRO-2's and ZeRO-3's reductions) fire once,
                # when autograd accumulates what this function returns.
                got = torch.autograd.grad(
                    out, ([t] if want_x else []) + list(ctx.params), g, allow_unused=True
                )
                if want_x:
                    n = t.shape[-2]
                    x_grad.narrow(-2, start, n).copy_(got[0])
                    start += n
                    got = got[1:]
                for k, gp in enumerate(got):
                    if gp is not None:
                        sums[k] = gp if sums[k] is None else sums[k].add_(gp)
        return None, x_grad, None, None, *sums


class TiledMLP(Adopting):
    """A decoder layer's MLP computed over tiles of `tile_tokens` tokens along the sequence (module
    docstring). Its children are the wrapped MLP's, under the same names (lorakit.model.tiling)."""

    def __init__(self, mlp: nn.Module, tile_tokens: int):
        if tile_tokens < 1:
            raise ValueError(f"tile_tokens must be at least 1, got {tile_tokens}")
        super().__init__(mlp)
        self.tile_tokens = tile_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] <= self.tile_tokens:
            return self.inner(x)
        if not torch.is_grad_enabled():
            # Evaluation: tiles without a graph, the same working set.
            return torch.cat([self.inner(t) for t in x.split(self.tile_tokens, dim=-2)], dim=-2)
        params = [p for p in self.parameters() if p.requires_grad]
        return _TiledForward.apply(self.inner, x, self.tile_tokens, has_dropout(self), *params)


def apply_tiled_mlp(model: nn.Module, tile_tokens: int, tiles=dense_decoder_mlp) -> int:
    """Replace every decoder layer's `mlp` in `model` that `tiles` accepts (the model family's choice,
    lorakit.model.families.Family.tiled_mlp; by default the dense ones) by a TiledMLP; returns how many were
    wrapped. Call it after peft (the tiles run peft's layers) and before deepspeed.initialize (ZeRO-3
    hooks)."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "mlp", None), nn.Module)]
    wrapped = 0
    for layer in layers:
        if tiles(layer.mlp) and not isinstance(layer.mlp, TiledMLP):
            layer.mlp = TiledMLP(layer.mlp, tile_tokens)
            wrapped += 1
    return wrapped


def planned_tile(recipe, row_tokens: int | None, hidden_size: int | None) -> int | None:
    """Tokens per MLP tile for rows of `row_tokens` tokens (None: the recipe's train.max_tokens) of a causal
    LM with `hidden_size`; None: no tiling. model.tiled_mlp auto tiles with sequence parallelism or rows of
    LONG_ROW_TOKENS tokens or more."""
    m = recipe.model
    if m.tiled_mlp is False:
        return None
    if m.tiled_mlp == "auto" and recipe.distributed.sequence_parallel == 1:
        row = recipe.train.max_tokens if row_tokens is None else row_tokens
        if row is None or row < LONG_ROW_TOKENS:
            return None
    tile = m.mlp_tile_tokens or hidden_size
    if tile is None:
        raise RecipeError("model.mlp_tile_tokens: the model config names no hidden_size; set the tile size")
    return tile


def tile_tokens(recipe, config) -> int | None:
    """The MLP tile size (tokens) the recipe asks for on a model of `config`; None: no tiling (a family
    whose MLPs are never tiled: the encoder-decoders)."""
    if family_of(config).tiled_mlp is None:
        if recipe.model.tiled_mlp is True:
            raise RecipeError(
                f"model.tiled_mlp: true tiles causal LMs' decoder MLPs; {config.model_type!r} is an "
                "encoder-decoder. Set model.tiled_mlp: auto or false"
            )
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return planned_tile(recipe, None, getattr(text, "hidden_size", None))
