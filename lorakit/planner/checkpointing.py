"""model.gradient_checkpointing auto: the planner's choice of off, selective (every k-th block) or whole.

The cheapest in compute that fits with headroom (HEADROOM of the GPU's memory, what the planner's
recommendations keep) wins, in that order: off (no recompute), selective with the largest k that fits
(1/k of the blocks recomputed), whole (every block recomputed). The run's other settings (ZeRO stage,
offload, micro-batch) stay the recipe's: when not even whole fits, the choice is whole and the plan's
recommendation says what else to change. Without a GPU memory to plan against (CPU runs, lorakit.plan
without --gpu-memory) the choice is whole, what the default was before auto: the memory-safe one, and on CPU
the runs whose memory the planner is checked against keep the setup they had.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from lorakit.model.checkpointing import OFF, SELECTIVE, WHOLE, Checkpointing, from_recipe, ordinal
from lorakit.planner.states import Setup
from lorakit.planner.units import HEADROOM, format_bytes


def with_checkpointing(setup: Setup, choice: Checkpointing) -> Setup:
    """`setup` with `choice`'s checkpointing."""
    every = choice.every_n_blocks if choice.mode == SELECTIVE else None
    return replace(setup, gradient_checkpointing=choice.enabled, checkpoint_every=every)


def choose(
    model_section, base: Setup, estimate: Callable, gpu_memory: int | None, blocks: int
) -> Checkpointing:
    """The run's checkpointing: the recipe's when it says true, false or selective with a k; for auto (and
    selective without a k) the first of off, selective, whole whose `estimate(setup)` (an Estimate) fits
    `gpu_memory` with headroom; `blocks`: the model's transformer blocks (both stacks of an encoder-decoder)."""
    value = model_section.gradient_checkpointing
    if value not in ("auto", "selective") or (value == "selective" and model_section.checkpoint_every):
        return from_recipe(model_section)
    if gpu_memory is None:
        return from_recipe(model_section)
    cap = HEADROOM * gpu_memory

    def need(mode: str, every: int | None = None) -> int:
        return estimate(with_checkpointing(base, Checkpointing(mode, every))).per_gpu_bytes

    def fits(mode: str, every: int | None = None) -> bool:
        e = estimate(with_checkpointing(base, Checkpointing(mode, every)))
        return bool(e.fits) and e.per_gpu_bytes <= cap

    of = f"of {format_bytes(gpu_memory)} per GPU ({HEADROOM:.0%} usable)"
    off = need(OFF)
    if value == "auto" and fits(OFF):
        return Checkpointing(OFF, None, f"auto: off fits, {format_bytes(off)} {of}")
    # Memory falls as k falls (more blocks checkpointed): the largest k that fits, by bisection.
    lo, hi = 1, max(blocks, 2)
    if fits(SELECTIVE, hi):
        lo = hi
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(SELECTIVE, mid) else (lo, mid)
    said = "auto" if value == "auto" else "selective without model.checkpoint_every"
    if lo >= 2:
        got = need(SELECTIVE, lo)
        return Checkpointing(
            SELECTIVE,
            lo,
            f"{said}: off needs {format_bytes(off)} {of}; every {ordinal(lo)} block checkpointed, "
            f"{format_bytes(got)}",
        )
    whole = need(WHOLE)
    if value == "selective":
        # Asked for selective: the most it can save (every 2nd block), even when that does not fit.
        return Checkpointing(
            SELECTIVE, 2, f"{said}: no k fits {of}; every 2nd block, {format_bytes(need(SELECTIVE, 2))}"
        )
    verdict = "fits" if fits(WHOLE) else "does not fit either (see the recommendation)"
    return Checkpointing(
        WHOLE,
        None,
        f"auto: off needs {format_bytes(off)} and every 2nd block {format_bytes(need(SELECTIVE, 2))} {of}; "
        f"whole, {format_bytes(whole)}, {verdict}",
    )
