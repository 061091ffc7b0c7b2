"""GRPO's prompt rows (lorakit.data.prompts): text prompts through data.prompt_template, chat prompts through
the chat template with its generation prompt, the reference answer carried as text, over-long prompts cut at
their start (causal) under data.overlong, and batches left-padded for a causal LM, right-padded for T5."""

from __future__ import annotations

import json

import pytest

from lorakit.data import prepare_data
from lorakit.data.chat import use_template
from lorakit.data.layouts import layout_named
from lorakit.errors import DataError
from lorakit.objectives.grpo_settings import GRPO, GrpoSection
from lorakit.recipe.known_objectives import register_spec, settings_model, unregister_spec
from lorakit.testing import build_tiny_tokenizer, tiny_config
from tests.conftest import rows_recipe

ROWS = [
    {"question": "What is 2 + 3?", "answer": "5"},
    {"question": "What is 10 - 4? Think about it carefully before answering.", "answer": "6"},
    {"question": "What is 3 x 3?", "answer": "9"},
]


@pytest.fixture(autouse=True)
def grpo_section():
    # The section validates once grpo's settings are registered (as the built-ins register them).
    registered = settings_model("grpo") is not None
    if not registered:
        register_spec(GRPO, GrpoSection)
    yield
    if not registered:
        unregister_spec("grpo")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), kind="llama")


def _recipe(cache_dir, tmp_path, rows, model="tiny:llama", data=None, **grpo):
    section = {"answer_column": "answer", "rewards": [{"name": "exact_match"}]} | grpo
    data = {"input_column": "question", "prompt_template": "Q: {input}\nA:"} | (data or {})
    return rows_recipe(cache_dir, tmp_path, rows, "grpo", model, data=data, grpo=section)


def test_text_prompts_carry_their_ids_and_answers(cache_dir, tmp_path, tokenizer):
    recipe = _recipe(cache_dir, tmp_path, ROWS)
    data = prepare_data(recipe, tokenizer, tiny_config("llama"), "prompts")
    texts = [f"Q: {r['question']}\nA:" for r in ROWS]
    assert data.train["prompt"] == texts
    assert data.train["answer"] == ["5", "6", "9"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    assert data.train["prompt_ids"] == [x[:-1] if x[-1] == tokenizer.eos_token_id else x for x in ids]
    assert data.train["length"] == [len(x) for x in data.train["prompt_ids"]]


def test_over_long_prompts_keep_their_end_or_are_refused(cache_dir, tmp_path, tokenizer):
    full = prepare_data(_recipe(cache_dir, tmp_path, ROWS), tokenizer, tiny_config("llama"), "prompts")
    cap = min(full.train["length"]) + 1
    cut = _recipe(cache_dir, tmp_path, ROWS, data={"max_length": cap, "overlong": "truncate"})
    data = prepare_data(cut, tokenizer, tiny_config("llama"), "prompts")
    assert all(len(x) <= cap for x in data.train["prompt_ids"])
    assert [x[-3:] for x in data.train["prompt_ids"]] == [x[-3:] for x in full.train["prompt_ids"]]
    assert data.stats["overlong"]["truncated"] == sum(n > cap for n in full.train["length"])
    with pytest.raises(DataError, match="line 2: its prompt is longer than data.max_length"):
        prepare_data(
            _recipe(cache_dir, tmp_path, ROWS, data={"max_length": cap, "overlong": "error"}),
            tokenizer,
            tiny_config("llama"),
            "prompts",
        )


def test_chat_prompts_end_with_the_generation_prompt(cache_dir, tmp_path, tokenizer):
    rows = [{"messages": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in ROWS]
    recipe = _recipe(cache_dir, tmp_path, rows, data={"format": "chat"})
    tok = use_template(tokenizer, recipe.data.chat_template)
    data = prepare_data(recipe, tok, tiny_config("llama"), "prompts")
    first = tok.apply_chat_template(rows[0]["messages"], tokenize=False, add_generation_prompt=True)
    assert data.train["prompt"][0] == first
    assert data.train["prompt_ids"][0] == tok(first, add_special_tokens=False)["input_ids"]
    assert data.train["answer"] == ["5", "6", "9"]


def test_batches_left_pad_causal_prompts_and_right_pad_sources(cache_dir, tmp_path, tokenizer):
    data = prepare_data(_recipe(cache_dir, tmp_path, ROWS), tokenizer, tiny_config("llama"), "prompts")
    rows = [data.train[i] for i in range(3)]
    layout = layout_named("prompts")
    batch = layout.collators(tokenizer, tiny_config("llama")).padded(rows)
    pad, width = tokenizer.pad_token_id, max(data.train["length"])
    for i, r in enumerate(rows):
        n = len(r["prompt_ids"])
        assert batch["input_ids"][i, width - n :].tolist() == r["prompt_ids"]
        assert batch["attention_mask"][i].tolist() == [0] * (width - n) + [1] * n
        assert set(batch["input_ids"][i, : width - n].tolist()) <= {pad}
    assert batch["answer"] == ["5", "6", "9"] and batch["num_examples"] == 3
    t5 = layout.collators(tokenizer, tiny_config("t5")).padded(rows)
    n = len(rows[0]["prompt_ids"])
    assert t5["input_ids"][0, :n].tolist() == rows[0]["prompt_ids"]
    assert t5["attention_mask"][0].tolist() == [1] * n + [0] * (width - n)


def test_rewards_reading_answers_need_an_answer_column(cache_dir, tmp_path):
    from lorakit.errors import RecipeError

    with pytest.raises(RecipeError, match="set grpo.answer_column"):
        _recipe(cache_dir, tmp_path, ROWS, answer_column=None)


def test_packing_is_refused(cache_dir, tmp_path, tokenizer):
    from lorakit.errors import RecipeError

    with pytest.raises((DataError, RecipeError), match="data.packing"):
        recipe = _recipe(cache_dir, tmp_path, ROWS, data={"packing": True})
        prepare_data(recipe, tokenizer, tiny_config("llama"), "prompts")


def test_eval_generate_is_refused_in_grpo_s_own_words(cache_dir, tmp_path):
    from lorakit.errors import RecipeError
    from tests.conftest import tiny_recipe

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS * 4))
    with pytest.raises(RecipeError, match="eval.generate") as err:
        tiny_recipe(
            cache_dir,
            tmp_path / "run",
            model={"name_or_path": "tiny:llama"},
            train={"objective": "grpo"},
            data={"source": str(path), "input_column": "question", "eval_split": "auto"},
            eval={"enabled": True, "generate": True},
            grpo={"answer_column": "answer", "rewards": [{"name": "exact_match"}]},
        )
    # A grpo evaluation generates: it scores one greedy completion per eval prompt, with no margins.
    assert "margins" not in str(err.value) and "greedy completion" in str(err.value), str(err.value)
