"""Learning-rate schedule: a pure function of the step, wrapped in a LambdaLR for the backend's optimizer."""

from __future__ import annotations

import math


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    """Warmup length in optimizer steps."""
    return math.ceil(total_steps * warmup_ratio)


def lr_multiplier(step: int, total_steps: int, warmup: int, kind: str) -> float:
    """Fraction of the peak LR used at optimizer step `step` (0-based)."""
    if step < warmup:
        # (step + 1) so the very first update is not wasted at lr = 0.
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    progress = min((step - warmup) / max(1, total_steps - warmup), 1.0)
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress


def lambda_lr_factory(total_steps: int, warmup_ratio: float, kind: str):
    """A callable(optimizer) -> LambdaLR: what a Backend's wrap takes as the schedule."""
    from torch.optim.lr_scheduler import LambdaLR

    warmup = warmup_steps(total_steps, warmup_ratio)
    return lambda optimizer: LambdaLR(optimizer, lambda s: lr_multiplier(s, total_steps, warmup, kind))
