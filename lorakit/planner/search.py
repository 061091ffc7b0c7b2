"""The setups the planner tries, what each is expected to cost in speed, and the best one that fits.

Speed costs are coarse multipliers on step time, stated so a user can weigh them, not measurements:

- gradient checkpointing repeats each layer's forward in the backward: +1/3 of the step for full
  fine-tuning (forward 1 + backward 2, plus 1), +1/2 for LoRA (a frozen base needs no weight gradients, so
  the backward costs about one forward); selective checkpointing of every k-th block, 1/k of that;
- ZeRO-3 gathers every layer's weights in the forward and again in the backward: x1.15 within a node,
  x1.5 across nodes (inter-node links are 10x slower than NVLink);
- offloading the optimizer runs Adam on the CPU and moves gradients and weights over PCIe: x1.5 for full
  fine-tuning, x1.05 for adapters (few trainable parameters);
- offloading parameters moves every layer's weights over PCIe twice per step: x2;
- each halving of the micro-batch (gradient accumulation doubled, so the optimizer batch is unchanged)
  leaves the GPU less work per kernel: x1.1.
"""

from __future__ import annotations

import math
from dataclasses import replace

from lorakit.backends import Backend
from lorakit.backends.facts import Layout
from lorakit.model.checkpointing import DEFAULT_EVERY
from lorakit.planner.states import Setup


def recipe_setup(recipe, backend: Backend) -> Setup:
    """The setup a recipe asks for: its backend's layout (FSDP2 is planned as ZeRO-3's, its cpu_offload as
    offloading both the optimizer and the parameters)."""
    layout = backend.layout()
    return Setup(
        zero_stage=layout.zero_stage,
        offload_optimizer=layout.offload_optimizer,
        offload_params=layout.offload_params,
        micro_batch_size=recipe.train.micro_batch_size,
        max_tokens=None,
        # auto: whole until the planner chooses (lorakit.planner.checkpointing).
        gradient_checkpointing=recipe.model.gradient_checkpointing is not False,
        checkpoint_every=(recipe.model.checkpoint_every or DEFAULT_EVERY)
        if recipe.model.gradient_checkpointing == "selective"
        else None,
    )


def slowdown(setup: Setup, reference: Setup, *, adapter: bool, nodes: int) -> float:
    """Expected step time of `setup` relative to the fastest one (ZeRO-2, nothing offloaded, no
    checkpointing, the reference micro-batch or packed row); see the module docstring."""
    factor = 1.0
    if setup.gradient_checkpointing:
        factor *= 1 + (0.5 if adapter else 1 / 3) / (setup.checkpoint_every or 1)
    if setup.zero_stage == 3:
        factor *= 1.5 if nodes > 1 else 1.15
    if setup.offload_optimizer != "none":
        factor *= 1.05 if adapter else 1.5
    if setup.offload_params != "none":
        factor *= 2.0
    size, ref = (setup.max_tokens, reference.max_tokens) if reference.max_tokens else (
        setup.micro_batch_size, reference.micro_batch_size)  # fmt: skip
    if size < ref:
        factor *= 1.1 ** math.log2(ref / size)
    return factor


def candidates(base: Setup, *, min_tokens: int | None, layouts: list[Layout]) -> list[Setup]:
    """Every setup the planner tries: each of the backend's `layouts` (DeepSpeed: ZeRO-2 and 3 with each
    offload level; FSDP2: nothing or everything offloaded), with and without checkpointing, and
    micro-batches (or packed rows) halved down to 1 (or to the longest example)."""
    sizes: list[tuple[int, int | None]] = []
    if base.max_tokens:
        n = base.max_tokens
        while n >= (min_tokens or 1):
            sizes.append((base.micro_batch_size, n))
            n //= 2
        if not sizes:
            sizes.append((base.micro_batch_size, base.max_tokens))
    else:
        n = base.micro_batch_size
        while n >= 1:
            sizes.append((n, None))
            n //= 2
    out = []
    for layout in layouts:
        for ckpt in (False, True):
            for mb, tokens in sizes:
                out.append(
                    replace(base, zero_stage=layout.zero_stage, offload_optimizer=layout.offload_optimizer,
                            offload_params=layout.offload_params, micro_batch_size=mb, max_tokens=tokens,
                            gradient_checkpointing=ckpt, checkpoint_every=None)
                )  # fmt: skip
    return out


def recommend(estimate, base: Setup, ways, limit: float, min_tokens: int | None, layouts: list[Layout]):
    """The fastest setup that fits in `limit` bytes per GPU and in the CPU RAM, and the overrides its recipe
    adds, or (None, []): `estimate(setup, recipe)` of `base` (first: it wins a tie) and its candidates, for
    each (recipe, overrides) of `ways` in turn until one fits."""
    options = candidates(base, min_tokens=min_tokens, layouts=layouts)
    for recipe, extra in ways:
        tried = [estimate(base, recipe)] + [
            e for e in (estimate(o, recipe) for o in options) if e.setup != base
        ]
        fitting = [e for e in tried if e.fits and e.per_gpu_bytes <= limit]
        if fitting:
            return min(fitting, key=lambda e: round(e.slowdown, 6)), extra
    return None, []


def overrides(setup: Setup, recipe, base: Setup, backend: Backend) -> list[str]:
    """The dotted recipe overrides that turn `recipe` (whose own setup is `base`) into `setup` (empty when
    nothing changes): the backend's for its layout, then the micro-batch's, keeping the optimizer batch (a
    smaller micro-batch or packed row gets proportionally more accumulation steps)."""
    t = recipe.train
    out = backend.layout_overrides(setup.layout)
    if setup.checkpointing != base.checkpointing:
        # The candidates are off or whole; a recipe's checkpoint_every goes with its selective.
        out.append(f"model.gradient_checkpointing={str(setup.gradient_checkpointing).lower()}")
        if recipe.model.checkpoint_every is not None:
            out.append("model.checkpoint_every=null")
    shrink = 1
    if setup.max_tokens is None and setup.micro_batch_size != base.micro_batch_size:
        out.append(f"train.micro_batch_size={setup.micro_batch_size}")
        shrink = base.micro_batch_size // setup.micro_batch_size
    elif setup.max_tokens is not None and setup.max_tokens != base.max_tokens:
        out.append(f"train.max_tokens={setup.max_tokens}")
        shrink = base.max_tokens // setup.max_tokens
        if t.max_target_tokens is not None:
            # Packed encoder-decoder rows: the decoder row shrinks with the encoder row (as planned).
            out.append(
                f"train.max_target_tokens={max(1, t.max_target_tokens * setup.max_tokens // base.max_tokens)}"
            )
    if shrink > 1:
        out.append(f"train.gradient_accumulation_steps={t.gradient_accumulation_steps * shrink}")
    return out


# The longest row is searched in multiples of this many tokens (per sequence-parallel rank), up to MAX_ROW.
ROW_STEP = 1024
MAX_ROW = 2**24


def longest_row(fits, step: int = ROW_STEP, limit: int = MAX_ROW) -> int | None:
    """The largest multiple of `step` up to `limit` for which `fits(tokens)` holds (memory grows with the
    row, so `fits` turns false once and stays false); None when not even `step` tokens fit."""
    if not fits(step):
        return None
    lo, hi = 1, 2
    while hi * step <= limit and fits(hi * step):
        lo, hi = hi, hi * 2
    hi = min(hi, limit // step + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step
