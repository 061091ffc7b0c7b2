"""GRPO's rewards (grpo.rewards): functions of a completion and its row, weighted and summed.

Built-ins are verifiable: `exact_match` (the stripped completion, or its last non-empty line, equals the
row's stripped answer), `math` (the answer checked with math-verify, the rl extra, imported here only),
`regex` (1 when the pattern is found) and `length` (1 at `target` completion tokens, falling linearly to 0 at
0 and 2 x target tokens). A user function is named `module:function` and called as
fn(completion: str, row: dict) -> number, `row` holding `prompt`, `answer` and `completion_tokens`; code a
recipe read back from a run directory names runs only when its caller allows it (recipe/read_back.py).

A function that raises, or returns something that is not a finite number, stops the run with an error
naming the function and the row (RewardError, exit code 2).
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lorakit.errors import LorakitError, MissingExtraError

RewardFn = Callable[[str, dict], float]


class RewardError(LorakitError):
    """A reward function raised or returned something other than a finite number (exit code 2)."""


@dataclass(frozen=True)
class Reward:
    """One weighted reward function, named as the recipe names it."""

    name: str
    weight: float
    fn: RewardFn


def exact_match(completion: str, row: dict) -> float:
    """1 when the stripped completion, or its last non-empty line, equals the row's stripped answer."""
    answer = row["answer"].strip()
    text = completion.strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return float(text == answer or (bool(lines) and lines[-1] == answer))


def math_reward() -> RewardFn:
    """The `math` reward: 1 when math-verify finds the completion's answer equal to the row's."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise MissingExtraError(
            "grpo.rewards math checks answers with math-verify, which is not installed: "
            "pip install 'lorakit[rl]' (or pip install math-verify)"
        ) from None

    def check(completion: str, row: dict) -> float:
        gold = parse(row["answer"])
        return float(bool(gold) and verify(gold, parse(completion)))

    return check


def regex_reward(pattern: str) -> RewardFn:
    """1 when `pattern` is found in the completion (re.DOTALL), else 0."""
    compiled = re.compile(pattern, re.DOTALL)
    return lambda completion, row: float(compiled.search(completion) is not None)


def length_reward(target: int) -> RewardFn:
    """1 at `target` completion tokens, falling linearly to 0 at 0 and at 2 x target."""
    return lambda completion, row: max(0.0, 1.0 - abs(row["completion_tokens"] - target) / target)


def user_function(name: str) -> RewardFn:
    """The function `module:function` names; RewardError when it cannot be imported or is not callable."""
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module.strip()), attr.strip())
    except (ImportError, AttributeError) as e:
        raise RewardError(f"grpo.rewards {name!r} cannot be imported: {e}") from None
    if not callable(fn):
        raise RewardError(f"grpo.rewards {name!r} is not a function")
    return fn


def build_rewards(entries: Sequence) -> list[Reward]:
    """The grpo.rewards entries (lorakit.objectives.grpo_settings.RewardEntry) as callables."""
    out = []
    for e in entries:
        if e.name == "exact_match":
            fn = exact_match
        elif e.name == "math":
            fn = math_reward()
        elif e.name == "regex":
            fn = regex_reward(e.pattern)
        elif e.name == "length":
            fn = length_reward(e.target)
        else:
            fn = user_function(e.name)
        out.append(Reward(e.name, e.weight, fn))
    return out


def _checked(reward: Reward, value, where: str) -> float:
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    raise RewardError(f"grpo.rewards {reward.name!r} returned {value!r:.60} for {where}, not a finite number")


def score(
    rewards: Sequence[Reward], completions: Sequence[str], rows: Sequence[dict], wheres: Sequence[str]
) -> tuple[list[float], dict[str, list[float]]]:
    """(weighted sum, {function name: its unweighted values}) of every completion; rows[i] is completion
    i's row and wheres[i] how an error names it. A function named twice is reported as `name#2`."""
    per: dict[str, list[float]] = {}
    total = [0.0] * len(completions)
    for reward in rewards:
        key, n = reward.name, 2
        while key in per:
            key, n = f"{reward.name}#{n}", n + 1
        values = []
        for i, (completion, row) in enumerate(zip(completions, rows, strict=True)):
            try:
                value = reward.fn(completion, row)
            except Exception as e:
                raise RewardError(
                    f"grpo.rewards {reward.name!r} raised on {wheres[i]}: {type(e).__name__}: {e}"
                ) from e
            values.append(_checked(reward, value, wheres[i]))
            total[i] += reward.weight * values[-1]
        per[key] = values
    return total, per
