"""GRPO's rewards (lorakit.objectives.rewards): the built-ins score what they say, user functions named
`module:function` are weighted and summed with them, and a function that raises or returns a non-number
stops with an error naming it and the row."""

from __future__ import annotations

import math
import sys
import types

import pytest

from lorakit.errors import RecipeError
from lorakit.objectives.grpo_settings import RewardEntry
from lorakit.objectives.rewards import RewardError, build_rewards, score


def _row(answer="", tokens=0):
    return {"prompt": "Q", "answer": answer, "completion_tokens": tokens}


@pytest.fixture
def user_module():
    mod = types.ModuleType("lk_user_rewards")
    mod.twice_len = lambda completion, row: 2.0 * len(completion)
    mod.broken = lambda completion, row: 1 / (row["answer"] != "6")  # raises on row 1 only
    mod.text = lambda completion, row: "yes"
    mod.nan = lambda completion, row: math.nan
    sys.modules[mod.__name__] = mod
    yield mod.__name__
    del sys.modules[mod.__name__]


def _score(entries, completions, rows):
    rewards = build_rewards([RewardEntry(**e) for e in entries])
    return score(rewards, completions, rows, [f"row {i}" for i in range(len(rows))])


def test_exact_match_takes_the_completion_or_its_last_line():
    total, per = _score([{"name": "exact_match"}], [" 5 ", "so:\n5\n", "15", "5 apples"], [_row("5")] * 4)
    assert total == [1.0, 1.0, 0.0, 0.0] and per == {"exact_match": total}


def test_math_checks_equivalent_answers():
    pytest.importorskip("math_verify")
    total, _ = _score(
        [{"name": "math"}], ["The answer is $\\frac{1}{2}$", "x = 0.5", "0.25"], [_row("0.5")] * 3
    )
    assert total == [1.0, 1.0, 0.0]


def test_regex_and_length():
    total, per = _score(
        [
            {"name": "regex", "pattern": r"<answer>.*</answer>", "weight": 0.5},
            {"name": "length", "target": 4},
        ],
        ["<answer>\n7</answer>", "7", "x"],
        [_row(tokens=4), _row(tokens=6), _row(tokens=8)],
    )
    assert per == {"regex": [1.0, 0.0, 0.0], "length": [1.0, 0.5, 0.0]}
    assert total == [1.5, 0.5, 0.0]


def test_user_functions_are_weighted_and_summed(user_module):
    total, per = _score(
        [{"name": f"{user_module}:twice_len", "weight": -0.25}, {"name": "exact_match", "weight": 2.0}],
        ["ab", "5"],
        [_row("5"), _row("5")],
    )
    assert per[f"{user_module}:twice_len"] == [4.0, 2.0]
    assert total == [-1.0, -0.5 + 2.0]


def test_a_function_named_twice_is_reported_twice():
    _, per = _score([{"name": "exact_match"}, {"name": "exact_match", "weight": 3}], ["5"], [_row("5")])
    assert per == {"exact_match": [1.0], "exact_match#2": [1.0]}


@pytest.mark.parametrize(
    ("fn", "said"),
    [("broken", "raised on row 1: ZeroDivisionError"), ("text", "returned 'yes' for row 0"), ("nan", "nan")],
)
def test_a_bad_function_is_named_with_its_row(user_module, fn, said):
    rows = [_row("5"), _row("6")]
    with pytest.raises(RewardError, match=f"'{user_module}:{fn}'.*{said}") as e:
        _score([{"name": f"{user_module}:{fn}"}], ["5", "6"], rows)
    assert f"{user_module}:{fn}" in str(e.value) and e.value.exit_code == 2


def test_an_unimportable_function_is_named():
    with pytest.raises(RewardError, match="'lk_no_such_module:f' cannot be imported"):
        _score([{"name": "lk_no_such_module:f"}], ["x"], [_row()])


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ({"name": "nope"}, "neither a built-in"),
        ({"name": "regex"}, "needs one"),
        ({"name": "regex", "pattern": "("}, "not a regex"),
        ({"name": "length"}, "needs one"),
        ({"name": "exact_match", "target": 3}, "length reward's"),
    ],
)
def test_entries_are_checked(entry, said):
    with pytest.raises((ValueError, RecipeError), match=said):
        RewardEntry(**entry)
