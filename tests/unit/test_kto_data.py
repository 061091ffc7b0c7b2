"""KTO's rows (lorakit.data.unpaired): (prompt, completion, label) read from a file, labels as true/false or
1/0, each row laid out as a preference pair with a mismatched completion (another row's, another prompt);
bad labels are named by row; chat-form rows render through the chat template (refused ones are bad
rows); the planner counts KTO's and ORPO's passes through Objective.passes."""

from __future__ import annotations

import pytest

from lorakit.data import prepare_data
from lorakit.data.chat import use_template
from lorakit.data.unpaired import mismatched
from lorakit.errors import DataError, RecipeError
from lorakit.objectives import objective_type
from lorakit.planner import plan
from lorakit.recipe import load_recipe
from lorakit.testing import build_tiny_tokenizer, tiny_config
from tests.conftest import RECIPES, rows_recipe, tiny_recipe

ROWS = [
    {"prompt": "Describe a cat.", "completion": "A cat sits.", "label": True},
    {"prompt": "Describe a cat.", "completion": "No.", "label": 0},
    {"prompt": "Describe a dog.", "completion": "A dog runs.", "label": 1},
    {"prompt": "Describe a bird.", "completion": "Why?", "label": False},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), kind="llama")


def _recipe(cache_dir, tmp_path, rows, **kto):
    data = {"input_column": "prompt", "prompt_template": "{input}\n"}
    return rows_recipe(cache_dir, tmp_path, rows, "kto", data=data, kto=kto)


def test_rows_carry_their_label_and_a_mismatched_completion(cache_dir, tmp_path, tokenizer):
    recipe = _recipe(cache_dir, tmp_path, ROWS)
    data = prepare_data(recipe, tokenizer, tiny_config("llama"), "unpaired")
    train = data.train
    assert train["label"] == [True, False, True, False]
    own = [tokenizer(r["completion"], add_special_tokens=False)["input_ids"] for r in ROWS]
    eos = tokenizer.eos_token_id
    assert [ids[:-1] for ids in train["chosen_ids"]] == own and all(
        ids[-1] == eos for ids in train["chosen_ids"]
    )
    # Row 0's next row has the same prompt: its mismatched completion is row 2's; the last wraps to row 0.
    assert [ids[:-1] for ids in train["rejected_ids"]] == [own[2], own[2], own[3], own[0]]
    assert data.stats["desirable_rows"] == 2
    assert mismatched(["a", "a", "a"]) == [0, 1, 2] and mismatched(["a", "b", "a"]) == [1, 2, 1]


def test_a_bad_label_is_named_with_its_row(cache_dir, tmp_path, tokenizer):
    rows = [*ROWS[:2], {"prompt": "Describe a fox.", "completion": "A fox.", "label": "yes"}]
    with pytest.raises(DataError, match=r"line 3: column 'label' is string 'yes', not a label"):
        prepare_data(_recipe(cache_dir, tmp_path, rows), tokenizer, tiny_config("llama"), "unpaired")
    with pytest.raises(DataError, match="kto.completion_column: column 'answer' not found"):
        recipe = _recipe(cache_dir, tmp_path, ROWS, completion_column="answer")
        prepare_data(recipe, tokenizer, tiny_config("llama"), "unpaired")


def test_recipe_checks_name_the_objective(cache_dir, tmp_path):
    with pytest.raises(RecipeError, match="data.train_on_inputs: kto scores completions only"):
        tiny_recipe(cache_dir, tmp_path / "r", train={"objective": "kto"}, data={"train_on_inputs": True})
    with pytest.raises(RecipeError, match="the kto section is read only with train.objective: kto"):
        tiny_recipe(cache_dir, tmp_path / "r", train={"objective": "orpo"}, kto={"beta": 0.2})
    with pytest.raises(RecipeError, match="orpo.chosen_column and orpo.rejected_column name the same"):
        tiny_recipe(cache_dir, tmp_path / "r", orpo={"chosen_column": "a", "rejected_column": "a"})


def _with(recipe, section: str, **values):
    return recipe.model_copy(update={section: getattr(recipe, section).model_copy(update=values)})


def test_the_planner_counts_each_objectives_passes():
    dpo = _with(load_recipe(RECIPES / "quickstart_dpo.yaml"), "data", packing=False, max_length=256)
    orpo = _with(load_recipe(RECIPES / "quickstart_orpo.yaml"), "data", packing=False, max_length=256)
    kto = _with(load_recipe(RECIPES / "quickstart_kto.yaml"), "data", packing=False, max_length=256)
    passes = {r.train.objective: objective_type(r).passes(r) for r in (dpo, orpo, kto)}
    assert passes["orpo"].sequences == passes["kto"].sequences == passes["dpo"].sequences == 2
    assert passes["orpo"].reference is None and passes["kto"].reference == passes["dpo"].reference == "live"
    full = _with(kto, "method", kind="full")
    assert objective_type(full).passes(full).reference == "before training"
    simpo = _with(dpo, "dpo", loss="simpo", beta=2.0)
    assert objective_type(simpo).passes(simpo).reference is None
    plans = {name: plan(r, gpu_memory="80GB") for name, r in (("dpo", dpo), ("orpo", orpo), ("kto", kto))}
    rows = {name: p.estimate.shape.rows for name, p in plans.items()}
    assert rows["orpo"] == rows["kto"] == rows["dpo"] == 2 * dpo.train.micro_batch_size
    # The same shapes: KTO's per-GPU bytes are DPO's (a live reference), ORPO's no more (no reference pass).
    assert plans["kto"].per_gpu_bytes == plans["dpo"].per_gpu_bytes >= plans["orpo"].per_gpu_bytes
    assert "no reference forward" in plans["orpo"].describe() and "KTO:" in plans["kto"].describe()


# Wants a system turn first (a prompt without one cannot be rendered: a bad row); no BOS, so a rendering's ids
# are its text's.
TEMPLATE = (
    "{% if messages[0].role != 'system' %}{{ raise_exception('a system message comes first') }}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SYSTEM = {"role": "system", "content": "Answer in a few words."}
CAT, DOG = (
    [SYSTEM, {"role": "user", "content": "Describe a cat."}],
    [SYSTEM, {"role": "user", "content": "A dog?"}],
)
CHAT_ROWS = [
    {"prompt": CAT, "completion": "A cat sits.", "label": True},
    {"prompt": CAT, "completion": [{"role": "assistant", "content": "No."}], "label": 0},
    {"prompt": "Describe a fox.", "completion": "A fox.", "label": 1},  # no system turn: refused
    {"prompt": DOG, "completion": [{"role": "assistant", "content": "A dog runs."}], "label": False},
]


def _chat_recipe(cache_dir, tmp_path, rows, **data):
    chat = {"format": "chat", "messages_column": "prompt", "chat_template": TEMPLATE, "on_bad_rows": "skip"}
    return rows_recipe(cache_dir, tmp_path, rows, "kto", data={**chat, **data})


def test_chat_rows_render_through_the_template_and_refused_rows_are_bad_rows(cache_dir, tmp_path, tokenizer):
    recipe = _chat_recipe(cache_dir, tmp_path, CHAT_ROWS)
    data = prepare_data(recipe, tokenizer, tiny_config("llama"), "unpaired")
    tok = use_template(tokenizer, TEMPLATE)
    kept = [CHAT_ROWS[i] for i in (0, 1, 3)]
    train = data.train
    assert train["label"] == [True, False, False] and data.stats["desirable_rows"] == 1
    assert train["reference"] == ["A cat sits.", "No.", "A dog runs."]
    for row, prompt, own in zip(kept, train["prompt_ids"], train["chosen_ids"], strict=True):
        reply = row["completion"]
        reply = [{"role": "assistant", "content": reply}] if isinstance(reply, str) else reply
        rendering = tok.apply_chat_template([*row["prompt"], *reply], tokenize=False)
        assert tok.decode(prompt + own) == rendering
        assert tok.decode(prompt) == tok.apply_chat_template(
            row["prompt"], tokenize=False, add_generation_prompt=True
        )
    # Partners among the kept rows, never the same prompt's: both cat rows get the dog's, the dog the first cat's.
    own = train["chosen_ids"]
    assert train["rejected_ids"] == [own[2], own[2], own[0]]
    bad = data.stats["bad_rows"]
    assert (
        bad["skipped"] == 1
        and "line 3" in bad["first"][0]
        and "system message comes first" in bad["first"][0]
    )
    with pytest.raises(DataError, match="system message comes first"):
        recipe_error = _chat_recipe(cache_dir, tmp_path, CHAT_ROWS, on_bad_rows="error")
        prepare_data(recipe_error, tokenizer, tiny_config("llama"), "unpaired")
    # A text prompt is one user turn: rendered as its message list is, so the two are one prompt to pair by.
    fox = {"prompt": [{"role": "user", "content": "Describe a fox."}], "completion": "Foxes.", "label": True}
    lenient = TEMPLATE.split("{% endif %}", 1)[1]
    recipe_text = _chat_recipe(cache_dir, tmp_path, [CHAT_ROWS[2], CHAT_ROWS[3], fox], chat_template=lenient)
    text = prepare_data(recipe_text, tokenizer, tiny_config("llama"), "unpaired").train
    assert text["prompt_ids"][0] == text["prompt_ids"][2] and text["chosen_ids"][0] != text["chosen_ids"][2]
    assert tokenizer.decode(text["prompt_ids"][0]) == "<|user|>\nDescribe a fox.<|end|>\n<|assistant|>\n"
    own = text["chosen_ids"]
    assert text["rejected_ids"] == [own[1], own[2], own[1]]
    with pytest.raises(DataError, match="encoder-decoder models"):
        prepare_data(recipe, tok, tiny_config("t5"), "unpaired")


def test_each_objective_is_made_from_its_section():
    from lorakit.objectives import make_objective
    from lorakit.objectives.kto import KtoObjective
    from lorakit.objectives.orpo import OrpoObjective

    orpo = _with(load_recipe(RECIPES / "quickstart_orpo.yaml"), "orpo", odds_ratio_weight=0.25)
    kto = _with(load_recipe(RECIPES / "quickstart_kto.yaml"), "kto", beta=0.3, undesirable_weight=1.5)
    made = make_objective(orpo, tiny_config("t5"))
    assert isinstance(made, OrpoObjective) and made.weight == 0.25 and made.encoder_decoder
    full = make_objective(_with(kto, "method", kind="full"), tiny_config("llama"))
    assert isinstance(full, KtoObjective) and (full.beta, full.undesirable_weight) == (0.3, 1.5)
    assert full.cached_reference and not full.encoder_decoder
    assert not make_objective(_with(orpo, "method", kind="full"), tiny_config("llama")).cached_reference
