"""DPO's recipe checks, preference data (columns, bad rows, chat prompts, caps) and pair batches."""

from __future__ import annotations

import json

import pytest

from lorakit.data import prepare_data
from lorakit.data.pair_collate import PackedCausalPairCollator, Seq2SeqPairCollator
from lorakit.errors import DataError, RecipeError
from lorakit.testing import build_tiny_tokenizer, tiny_config
from tests.conftest import tiny_recipe

DPO = {"objective": "dpo", "max_steps": 2}
NO_GEN = {"generate": False}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), kind="llama")


def _recipe(cache_dir, tmp_path, source, **sections):
    data = {"source": str(source), "input_column": "question", "eval_split": None, **sections.pop("data", {})}
    return tiny_recipe(
        cache_dir,
        tmp_path / "run",
        model={"name_or_path": "tiny:llama"},
        data=data,
        train=DPO,
        eval={**NO_GEN, **sections.pop("eval", {})},
        **sections,
    )


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = {"question": "Describe the scene: a man reading.", "chosen": "A man is reading.", "rejected": "No."}


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"method": {"init": "pissa"}}, "method.init pissa rewrites the base"),
        ({"eval": {"generate": True}, "data": {"eval_split": "auto"}}, "eval.generate"),
        ({"dpo": {"loss": "ipo", "label_smoothing": 0.1}}, "label_smoothing applies to loss sigmoid"),
        ({"data": {"train_on_inputs": True}}, "train_on_inputs"),
    ],
)
def test_recipe_refuses_what_dpo_cannot_do(cache_dir, tmp_path, sections, message):
    with pytest.raises(RecipeError, match=message):
        _recipe(cache_dir, tmp_path, "builtin:preference_pairs", **sections)


def test_a_dpo_section_needs_the_dpo_objective(cache_dir, tmp_path):
    with pytest.raises(RecipeError, match="train.objective: dpo"):
        tiny_recipe(cache_dir, tmp_path, dpo={"beta": 0.2})


def test_instruction_pairs_and_bad_rows(cache_dir, tmp_path, tokenizer):
    source = _write(tmp_path / "pairs.jsonl", [GOOD, {**GOOD, "chosen": None}, "{not json", GOOD])
    with pytest.raises(DataError, match=r"pairs.jsonl line 2: column 'chosen' is null"):
        prepare_data(_recipe(cache_dir, tmp_path, source), tokenizer, tiny_config("llama"), "pairs")
    recipe = _recipe(cache_dir, tmp_path, source, data={"on_bad_rows": "skip"})
    data = prepare_data(recipe, tokenizer, tiny_config("llama"), "pairs")
    assert len(data.train) == 2 and data.stats["bad_rows"]["skipped"] == 2
    row = data.train[0]
    eos = tokenizer.eos_token_id
    assert row["prompt_ids"][0] == tokenizer.bos_token_id and row["prompt_ids"][-1] != eos
    assert row["chosen_ids"][-1] == eos and row["rejected_ids"][-1] == eos
    assert tokenizer.decode(row["chosen_ids"], skip_special_tokens=True) == GOOD["chosen"]
    assert row["length"] == 2 * len(row["prompt_ids"]) + len(row["chosen_ids"]) + len(row["rejected_ids"])


def test_a_missing_response_column_names_the_field(cache_dir, tmp_path, tokenizer):
    source = _write(tmp_path / "pairs.jsonl", [GOOD, GOOD])
    recipe = _recipe(cache_dir, tmp_path, source, dpo={"rejected_column": "worse"})
    with pytest.raises(DataError, match="dpo.rejected_column: column 'worse' not found"):
        prepare_data(recipe, tokenizer, tiny_config("llama"), "pairs")


def test_chat_prompts_use_the_template_and_overlong_pairs_are_capped(cache_dir, tmp_path, tokenizer):
    messages = [{"role": "user", "content": "Describe the scene: a man reading."}]
    rows = [{"messages": messages, "chosen": "A man is reading a book at home today.", "rejected": "No."}]
    source = _write(tmp_path / "chat.jsonl", rows * 2)
    recipe = _recipe(cache_dir, tmp_path, source, data={"format": "chat", "max_length": 20})
    data = prepare_data(recipe, tokenizer, tiny_config("llama"), "pairs")
    row = data.train[0]
    assert tokenizer.decode(row["prompt_ids"]).endswith("<|assistant|>\n")
    assert len(row["prompt_ids"]) + len(row["chosen_ids"]) <= 20
    assert data.stats["overlong"]["truncated"] == 2
    with pytest.raises(DataError, match="data.overlong is error"):
        recipe = _recipe(
            cache_dir, tmp_path, source, data={"format": "chat", "max_length": 20, "overlong": "error"}
        )
        prepare_data(recipe, tokenizer, tiny_config("llama"), "pairs")


def test_packed_pairs_keep_sequences_apart():
    rows = [
        {"prompt_ids": [5, 6], "chosen_ids": [7, 1], "rejected_ids": [8, 9, 1]},
        {"prompt_ids": [10], "chosen_ids": [11, 1], "rejected_ids": [1]},
    ]
    batch = PackedCausalPairCollator(max_tokens=32)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 1, 5, 6, 8, 9, 1, 10, 11, 1, 10, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 0, 1]]
    assert batch["sequence_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 3, 3]]
    # Shifted per sequence: the last prompt token predicts the first response token; no cross-sequence target.
    ignore = -100
    expected = [ignore, 7, 1, ignore, ignore, 8, 9, 1, ignore, 11, 1, ignore, 1, ignore]
    assert batch["labels"].tolist() == [expected]
    assert batch["num_pairs"] == 2 and batch["num_target_tokens"] == 8


def test_seq2seq_pairs_share_one_source_row():
    rows = [{"input_ids": [5, 6, 1], "chosen_ids": [7, 1], "rejected_ids": [8, 9, 1]}]
    batch = Seq2SeqPairCollator(0, 0)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 1]]
    assert batch["chosen_decoder_input_ids"].tolist() == [[0, 7]]
    assert batch["rejected_decoder_input_ids"].tolist() == [[0, 8, 9]]
    assert batch["rejected_labels"].tolist() == [[8, 9, 1]] and batch["num_pairs"] == 1


def test_the_shipped_preference_pairs_are_the_generators_output():
    from lorakit.data.samples import builtin_dataset_dir
    from lorakit.data.samples.make_preference_pairs import SAMPLES

    for split, rows in SAMPLES.generate().items():
        path = builtin_dataset_dir("preference_pairs") / f"{split}.jsonl"
        shipped = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        assert shipped == rows
        for r in rows:
            # The chosen answer describes the question's scene in its words (what makes it learnable).
            scene = r["chosen"].rstrip(".").replace(" is ", " ", 1).replace(" are ", " ", 1)
            assert scene.lower() in r["question"].lower() and r["rejected"] != r["chosen"], r


TRL_PAIRS = [
    {
        "prompt": [{"role": "user", "content": f"Where did storm {i} hit?"}],
        "chosen": [{"role": "assistant", "content": "Around Cairo."}],
        "rejected": [{"role": "assistant", "content": "Nowhere."}],
    }
    for i in range(4)
]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_trl_conversational_pairs_train_as_they_come(cache_dir, tmp_path, tokenizer, suffix):
    # TRL's standard conversational preference columns (prompt, chosen, rejected: lists of messages) need no
    # data.messages_column: the prompt is read from `prompt` when the source has no `messages` column.
    from lorakit.objectives import prepare_data as prepare_rows

    path = tmp_path / f"trl.{suffix}"
    if suffix == "jsonl":
        _write(path, TRL_PAIRS)
    else:
        import datasets

        datasets.Dataset.from_list(TRL_PAIRS).to_parquet(str(path))

    def rows(**data):
        recipe = _recipe(cache_dir, tmp_path, path, data={"format": "chat", **data})
        return prepare_rows(recipe, tokenizer, tiny_config("llama")).train.to_list()

    as_they_come = rows()
    assert len(as_they_come) == 4 and as_they_come == rows(messages_column="prompt")
    assert tokenizer.decode(as_they_come[0]["chosen_ids"]).startswith("Around Cairo.")
    # A source with neither column is still a wrong column name, named by its recipe field.
    _write(path, [{k: v for k, v in r.items() if k != "prompt"} | {"question": "q"} for r in TRL_PAIRS])
    if suffix == "jsonl":
        with pytest.raises(DataError, match="data.messages_column: column 'messages' not found"):
            rows()
