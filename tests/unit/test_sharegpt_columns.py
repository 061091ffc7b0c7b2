"""ShareGPT's `conversations` column where lorakit reads `messages`: lorakit.generate reads it as training
does, and a bad row is named by the column the file has, not by `messages`."""

from __future__ import annotations

import pytest

from lorakit.data.rows import RowCollector
from lorakit.errors import DataError
from lorakit.inference.prompts import Prompter
from lorakit.recipe import load_recipe
from tests.conftest import RECIPES

TURNS = [{"from": "human", "value": "What is 2 plus 2?"}, {"from": "gpt", "value": "4."}]


def _chat():
    return load_recipe(RECIPES / "gemma3_12b_lora.yaml").data


def test_generate_reads_a_sharegpt_conversations_column():
    (row,) = Prompter(_chat()).rows([{"conversations": TURNS[:1]}])
    assert row.columns["messages"] == TURNS[:1]


@pytest.mark.parametrize("bad", [[], "hello", [{"from": "human"}]])
def test_a_bad_sharegpt_row_is_named_by_its_own_column(bad):
    with pytest.raises(DataError, match=r"column 'conversations' "):
        Prompter(_chat()).rows([{"conversations": bad}])
    rows = RowCollector(_chat(), "chat.jsonl", "line", None)
    reason, _ = rows.problem({"conversations": bad})
    assert reason.startswith("column 'conversations' "), reason
    # A file with the default column is named by it, as before.
    reason, _ = RowCollector(_chat(), "chat.jsonl", "line", None).problem({"messages": bad})
    assert reason.startswith("column 'messages' "), reason
