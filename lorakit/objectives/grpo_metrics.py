"""What a GRPO step reports, and what summary.json keeps of a run's steps.

The loop sums an objective's metric values over micro-batches and ranks (engine/loop.train_window), so a
micro-batch reports sums (`sums`: of rewards and their squares, completions, completion tokens, KL and
clipped tokens, zero-variance groups, generated tokens and seconds) and the step turns the window's sums
into its record (`finish`): the mean reward and its spread over the step's completions, overall and per
reward function (`reward/NAME`), the advantages' spread, the mean k3 KL and the share of clipped tokens
over completion tokens, the mean completion length, the zero-variance groups and all groups, and the
generation's tokens per second.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lorakit.objectives.grpo_loss import group_advantages

# The engine that generated the rollouts, as the run reports it: the backend's own Engine.generate (ZeRO-3
# gathers, FSDP2 unshards).
ENGINE = "engine"


def sums(batch: dict[str, Any], group: int, kl_tokens: float, clipped_tokens: float) -> dict[str, float]:
    """A rollout micro-batch's metric sums; `kl_tokens`, `clipped_tokens`: its completion tokens' summed KL
    and its clipped completion tokens."""
    rewards = batch["rewards"].double()
    adv = batch["advantages"].double()
    out = {
        "completions": float(rewards.numel()),
        "completion_tokens": float(batch["completion_mask"].sum()),
        "reward": float(rewards.sum()),
        "reward_sq": float((rewards**2).sum()),
        "advantage": float(adv.sum()),
        "advantage_sq": float((adv**2).sum()),
        "kl": kl_tokens,
        "clipped": clipped_tokens,
        # Recounted from the rewards the batch keeps, so a rollout restored from a checkpoint counts alike.
        "zero_variance_groups": float(group_advantages(batch["rewards"], group, False)[1]),
        "groups": float(rewards.numel() // group),
        # A rollout made in this process (not restored from a checkpoint mid-passes) knows its generation time.
        "generated_tokens": float(batch["completion_mask"].sum()) if "generation_seconds" in batch else 0.0,
        "generation_seconds": float(batch.get("generation_seconds", 0.0)),
    }
    for name, values in (batch.get("reward_parts") or {}).items():
        v = torch.as_tensor(values).double()
        out[f"reward/{name}"], out[f"reward/{name}_sq"] = float(v.sum()), float((v**2).sum())
    return out


def _spread(total: float, squares: float, n: float) -> float:
    mean = total / n
    return math.sqrt(max(squares / n - mean * mean, 0.0))


def finish(window: dict[str, float]) -> dict[str, float]:
    """The step's record from the window's summed `sums` (every rank's)."""
    n, tokens = max(window["completions"], 1.0), max(window["completion_tokens"], 1.0)
    out = {
        "reward": window["reward"] / n,
        "reward_std": _spread(window["reward"], window["reward_sq"], n),
        "advantage_std": _spread(window["advantage"], window["advantage_sq"], n),
        "kl": window["kl"] / tokens,
        "clip_fraction": window["clipped"] / tokens,
        "completion_length": window["completion_tokens"] / n,
        "zero_variance_groups": window["zero_variance_groups"],
        "groups": window["groups"],
    }
    for key, value in window.items():
        if key.startswith("reward/") and not key.endswith("_sq"):
            out[key] = value / n
            out[f"{key}_std"] = _spread(value, window[f"{key}_sq"], n)
    if window["generation_seconds"] > 0:
        out["generation_tokens_per_second"] = window["generated_tokens"] / window["generation_seconds"]
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def run_summary(records: list[dict[str, Any]], engine: str = ENGINE) -> dict[str, Any]:
    """summary.json's `objective_metrics` of a GRPO run from its train records: the engine that generated,
    the mean reward (and completion length) over the first and the last quarter of the logged steps, the
    zero-variance groups of all groups, the last KL and clip fraction, the mean generation rate. `engine`:
    what generated the rollouts (`engine`, or vLLM's description)."""
    train = [r for r in records if r.get("kind") == "train" and isinstance(r.get("reward"), (int, float))]
    k = max(1, len(train) // 4)
    first, last = train[:k], train[-k:]

    def ends(key: str) -> dict[str, Any]:
        return {
            "first": _mean([r[key] for r in first if key in r]),
            "last": _mean([r[key] for r in last if key in r]),
            "steps_each": len(first),
        }

    rates = [r["generation_tokens_per_second"] for r in train if "generation_tokens_per_second" in r]
    functions = sorted({k for r in train for k in r if k.startswith("reward/") and not k.endswith("_std")})
    return {
        "generation_engine": engine,
        "logged_steps": len(train),
        "reward": ends("reward") if train else None,
        "reward_functions": {f.removeprefix("reward/"): ends(f) for f in functions},
        "completion_length": ends("completion_length") if train else None,
        "zero_variance_groups": int(sum(r.get("zero_variance_groups", 0) for r in train)),
        "groups": int(sum(r.get("groups", 0) for r in train)),
        "kl_last": train[-1].get("kl") if train else None,
        "clip_fraction_last": train[-1].get("clip_fraction") if train else None,
        "generation_tokens_per_second": _mean(rates),
    }
