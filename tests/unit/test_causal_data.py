"""Causal-LM data: instruction, completion and chat rows, labels, caps and the overlong policy."""

import json

import pytest

from lorakit.data import prepare_data
from lorakit.data.causal import IGNORE_INDEX, ChatTurns
from lorakit.errors import DataError
from lorakit.model import load_config, load_tokenizer
from tests.conftest import tiny_recipe

COLUMNS = {"input_ids", "labels", "length", "prompt_ids", "reference"}
CONVERSATION = [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "Where did the storm hit?"},
    {"role": "assistant", "content": "Around Cairo, 45 villages."},
    {"role": "user", "content": "How strong were the winds?"},
    {"role": "assistant", "content": "136 kilometres per hour."},
]


def _load(cache_dir, tmp_path, model="tiny:llama", train=None, **data):
    sections = {"model": {"name_or_path": model}, "data": data, "train": train or {}}
    if data.get("format") == "completion":
        sections["eval"] = {"generate": False}
    recipe = tiny_recipe(cache_dir, tmp_path / "run", **sections)
    source, config = load_config(recipe)
    return recipe, load_tokenizer(recipe, source), config


def _prepare(cache_dir, tmp_path, model="tiny:llama", train=None, **data):
    recipe, tok, config = _load(cache_dir, tmp_path, model, train, **data)
    return prepare_data(recipe, tok, config), tok


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _chat_dir(tmp_path, train_rows, eval_rows=None):
    d = tmp_path / "chat"
    _jsonl(d / "train.jsonl", [{"messages": m} for m in train_rows])
    _jsonl(d / "validation.jsonl", [{"messages": m} for m in (eval_rows or train_rows)])
    return str(d)


def _labelled_spans(tok, row) -> list[str]:
    """Decoded runs of consecutive labelled tokens."""
    spans, current = [], []
    for token, label in zip(row["input_ids"], row["labels"], strict=True):
        if label != IGNORE_INDEX:
            assert label == token  # unshifted: a label is the token at its own position
            current.append(token)
        elif current:
            spans.append(tok.decode(current))
            current = []
    if current:
        spans.append(tok.decode(current))
    return spans


# --- instruction -------------------------------------------------------------------------------------


def test_instruction_rows_label_the_response_and_eos_only(cache_dir, tmp_path):
    data, tok = _prepare(cache_dir, tmp_path, max_samples=16, max_eval_samples=4)
    assert set(data.train.column_names) == set(data.eval.column_names) == COLUMNS
    assert data.lengths.max_source_length is None and data.lengths.max_target_length is None
    assert data.lengths.max_length == max(list(data.train["length"]) + list(data.eval["length"]))
    for split in (data.train, data.eval):
        for row in split:
            ids, labels, prompt = row["input_ids"], row["labels"], row["prompt_ids"]
            n = len(prompt)
            assert len(labels) == len(ids) == row["length"]
            assert prompt[0] == tok.bos_token_id and ids[:n] == prompt and ids[-1] == tok.eos_token_id
            assert labels[:n] == [IGNORE_INDEX] * n and labels[n:] == ids[n:]
            assert _labelled_spans(tok, row) == [row["reference"] + tok.eos_token]
            text = tok.decode(prompt, skip_special_tokens=True)
            assert text.startswith("Summarize the following news article:\n") and text.endswith("Summary:\n")
    answers = [len(r["input_ids"]) - len(r["prompt_ids"]) for r in data.train]
    assert data.stats["loss_tokens"] == sum(answers)
    assert data.stats["rows_without_loss"] == 0


def test_train_on_inputs_labels_every_token_and_misses_the_cache(cache_dir, tmp_path):
    first, _ = _prepare(cache_dir, tmp_path, max_samples=8, eval_split=None)
    again, _ = _prepare(cache_dir, tmp_path, max_samples=8, eval_split=None)
    assert not first.cache_hit and again.cache_hit and again.path == first.path
    assert again.train["labels"] == first.train["labels"] and again.lengths == first.lengths
    assert again.stats == first.stats and again.describe().startswith("data: reused cached 8 train")
    all_in, _ = _prepare(cache_dir, tmp_path, max_samples=8, eval_split=None, train_on_inputs=True)
    assert not all_in.cache_hit and all_in.path != first.path
    assert all_in.train["input_ids"] == first.train["input_ids"]
    assert all_in.train["labels"] == all_in.train["input_ids"]


# --- completion --------------------------------------------------------------------------------------


def test_completion_rows_train_on_every_token(cache_dir, tmp_path):
    texts = ["The council voted on Monday.", "Winds reached 136 kilometres per hour.", "Short."]
    src = _jsonl(tmp_path / "docs.jsonl", [{"body": t} for t in texts])
    data, tok = _prepare(
        cache_dir, tmp_path, source=src, format="completion", text_column="body", eval_split=None
    )
    assert set(data.train.column_names) == COLUMNS and data.eval is None
    for row, text in zip(data.train, texts, strict=True):
        assert row["labels"] == row["input_ids"] and row["length"] == len(row["input_ids"])
        assert row["input_ids"][0] == tok.bos_token_id and row["input_ids"][-1] == tok.eos_token_id
        assert tok.decode(row["input_ids"], skip_special_tokens=True) == text
        assert row["prompt_ids"] == [] and row["reference"] == ""


def test_completion_errors_name_the_field_and_row(cache_dir, tmp_path):
    src = _jsonl(tmp_path / "docs.jsonl", [{"text": "fine"}, {"text": 7}])
    with pytest.raises(DataError, match=r"docs\.jsonl line 2: column 'text' is int"):
        _prepare(cache_dir, tmp_path, source=src, format="completion", eval_split=None)
    with pytest.raises(DataError, match=r"data\.text_column: column 'body' not found.*\['text'\]"):
        _prepare(cache_dir, tmp_path, source=src, format="completion", text_column="body", eval_split=None)


# --- chat --------------------------------------------------------------------------------------------


def test_chat_labels_assistant_turns_only(cache_dir, tmp_path):
    single = CONVERSATION[:3]
    src = _chat_dir(tmp_path, [CONVERSATION, single])
    data, tok = _prepare(cache_dir, tmp_path, source=src, format="chat")
    assert set(data.train.column_names) == set(data.eval.column_names) == COLUMNS
    multi, one = data.train[0], data.train[1]
    full = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert multi["input_ids"] == tok(full, add_special_tokens=False)["input_ids"]
    # Both assistant turns, each with the end-of-turn tokens the template emits; nothing else.
    assert _labelled_spans(tok, multi) == [
        f"{m['content']}</s>\n" for m in CONVERSATION if m["role"] == "assistant"
    ]
    assert _labelled_spans(tok, one) == ["Around Cairo, 45 villages.</s>\n"]
    unlabelled = tok.decode(
        [t for t, y in zip(multi["input_ids"], multi["labels"], strict=True) if y == IGNORE_INDEX]
    )
    for m in CONVERSATION:
        assert (m["content"] in unlabelled) == (m["role"] != "assistant")
    for row, conv in zip(data.eval, [CONVERSATION, single], strict=True):
        prompt = tok.apply_chat_template(conv[:-1], tokenize=False, add_generation_prompt=True)
        assert row["prompt_ids"] == tok(prompt, add_special_tokens=False)["input_ids"]
        assert row["input_ids"][: len(row["prompt_ids"])] == row["prompt_ids"]
        assert row["reference"] == conv[-1]["content"]


def test_chat_edge_rows(cache_dir, tmp_path):
    ends_with_user = CONVERSATION[:2]
    leading_newlines = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\n\nHello."}]
    src = _chat_dir(tmp_path, [ends_with_user, leading_newlines])
    data, tok = _prepare(cache_dir, tmp_path, source=src, format="chat")
    no_answer, newlines = data.eval[0], data.eval[1]
    assert set(no_answer["labels"]) == {IGNORE_INDEX} and no_answer["reference"] == ""
    prompt = tok.apply_chat_template(ends_with_user, tokenize=False, add_generation_prompt=True)
    assert no_answer["prompt_ids"] == tok(prompt, add_special_tokens=False)["input_ids"]
    assert "".join(_labelled_spans(tok, newlines)).endswith("Hello.</s>\n")
    assert data.stats["rows_without_loss"] == 1
    all_in, _ = _prepare(cache_dir, tmp_path, source=src, format="chat", train_on_inputs=True)
    assert all(r["labels"] == r["input_ids"] for r in all_in.train)


class _SlowTokenizer:
    """A tokenizer without character offsets, like transformers' Python (slow) tokenizers."""

    is_fast = False

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *args, return_offsets_mapping=False, **kwargs):
        assert not return_offsets_mapping, "offsets asked of a tokenizer that has none"
        return self._tok(*args, **kwargs)


def test_chat_spans_without_offsets_match(cache_dir, tmp_path):
    _, tok, _ = _load(cache_dir, tmp_path)
    fast = ChatTurns(tok, 0).labels(CONVERSATION, train_on_inputs=False)
    assert ChatTurns(_SlowTokenizer(tok), 0).labels(CONVERSATION, train_on_inputs=False) == fast


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_chat_on_other_tiny_causal_models(cache_dir, tmp_path, kind):
    src = _chat_dir(tmp_path, [CONVERSATION])
    data, tok = _prepare(cache_dir, tmp_path, model=f"tiny:{kind}", source=src, format="chat")
    assert _labelled_spans(tok, data.train[0]) == [
        "Around Cairo, 45 villages.</s>\n",
        "136 kilometres per hour.</s>\n",
    ]
    assert data.eval[0]["reference"] == "136 kilometres per hour."


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ("just text", r"non-empty list of \{role, content\} messages, got str"),
        ([], "non-empty list"),
        (["hello"], "message 0 is str"),
        ([{"role": "user", "content": None}], "message 0 needs a text 'content', got NoneType"),
        ([{"role": 3, "content": "x"}], "message 0 needs a text 'role', got int"),
    ],
)
def test_malformed_messages_name_the_column_and_row(cache_dir, tmp_path, messages, problem):
    path = tmp_path / "conv.jsonl"
    path.write_text(json.dumps({"conv": CONVERSATION}) + "\n" + json.dumps({"conv": messages}) + "\n")
    with pytest.raises(DataError, match=rf"conv\.jsonl line 2: column 'conv' .*{problem}"):
        _prepare(
            cache_dir, tmp_path, source=str(path), format="chat", messages_column="conv", eval_split=None
        )


def test_chat_template_problems(cache_dir, tmp_path):
    src = _chat_dir(tmp_path, [CONVERSATION])
    recipe, tok, config = _load(cache_dir, tmp_path, source=src, format="chat")
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        prepare_data(recipe, tok, config)
    # Renders the last message differently from earlier ones: not prefix-stable, yet every turn is found.
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if loop.last %} (last){% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    data = prepare_data(recipe, tok, config)
    assert _labelled_spans(tok, data.train[0]) == [" Around Cairo, 45 villages.", " 136 kilometres per hour."]
    # Leaves the assistant's words out: nothing to train on is found, a bad row (not a stopped run under skip).
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    with pytest.raises(DataError, match="train.jsonl line 1: assistant message 2 was not found"):
        prepare_data(recipe, tok, config)
    skip = recipe.model_copy(update={"data": recipe.data.model_copy(update={"on_bad_rows": "skip"})})
    with pytest.raises(DataError, match="refused every row"):
        prepare_data(skip, tok, config)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(DataError, match="train.jsonl line 1: the chat template failed: roles must alternate"):
        prepare_data(recipe, tok, config)


def test_missing_messages_column_is_named(cache_dir, tmp_path):
    src = _chat_dir(tmp_path, [CONVERSATION])
    with pytest.raises(DataError, match=r"data\.messages_column: column 'conv' not found.*\['messages'\]"):
        _prepare(cache_dir, tmp_path, source=src, format="chat", messages_column="conv")


# --- caps and the overlong policy --------------------------------------------------------------------


@pytest.fixture(scope="module")
def news_lengths(cache_dir, tmp_path_factory):
    """Untruncated lengths of the first 24 train and 8 eval news rows on tiny:llama."""
    data, _ = _prepare(cache_dir, tmp_path_factory.mktemp("auto"), max_samples=24, max_eval_samples=8)
    assert data.stats["overlong"]["truncated"] == data.stats["overlong"]["dropped"] == 0
    return list(data.train["length"]), list(data.eval["length"])


def test_overlong_truncate_and_drop_count_rows(cache_dir, tmp_path, news_lengths):
    train_len, eval_len = news_lengths
    cap = sorted(train_len)[len(train_len) // 2]
    over, eval_over = sum(n > cap for n in train_len), sum(n > cap for n in eval_len)
    assert over > 0
    cut, _ = _prepare(cache_dir, tmp_path, max_samples=24, max_eval_samples=8, max_length=cap)
    assert len(cut.train) == 24 and max(cut.train["length"]) == cap == cut.lengths.max_length
    assert cut.train["length"] == [min(n, cap) for n in train_len]
    assert all(len(r["labels"]) == len(r["input_ids"]) == r["length"] for r in cut.train)
    assert cut.stats["overlong"] == {
        "policy": "truncate",
        "cap": cap,
        "cap_from": "data.max_length",
        "truncated": over,
        "dropped": 0,
        "eval_truncated": eval_over,
        "eval_dropped": 0,
    }
    assert f"train {over} truncated, 0 dropped; eval {eval_over} truncated, 0 dropped" in cut.describe()
    # Cut at the median, the news rows lose their whole summary: said, not silent.
    targetless = sum(all(t == IGNORE_INDEX for t in r["labels"]) for r in cut.train)
    assert 0 < targetless == cut.stats["rows_without_loss"]
    assert f"warning: {targetless} train row(s) have no target tokens" in cut.describe()
    dropped, _ = _prepare(
        cache_dir, tmp_path, max_samples=24, max_eval_samples=8, max_length=cap, overlong="drop"
    )
    assert dropped.train["length"] == [n for n in train_len if n <= cap]
    assert len(dropped.eval) == 8 - eval_over
    assert (dropped.stats["overlong"]["dropped"], dropped.stats["overlong"]["truncated"]) == (over, 0)
    assert f"train 0 truncated, {over} dropped" in dropped.describe()
    assert dropped.stats["rows_without_loss"] == 0 and "no target tokens" not in dropped.describe()


def test_overlong_error_names_row_length_and_setting(cache_dir, tmp_path, news_lengths):
    train_len, _ = news_lengths
    cap = sorted(train_len)[len(train_len) // 2]
    first = next(i for i, n in enumerate(train_len) if n > cap)
    # The builtin train.jsonl has one row per line: row i is line i + 1.
    match = rf"train\.jsonl line {first + 1} is {train_len[first]} tokens.*cap of {cap} \(data\.max_length\)"
    with pytest.raises(DataError, match=match):
        _prepare(cache_dir, tmp_path, max_samples=24, max_eval_samples=8, max_length=cap, overlong="error")
    with pytest.raises(DataError, match=r"every row of \S*train\.jsonl is longer"):
        _prepare(cache_dir, tmp_path, max_samples=24, eval_split=None, max_length=8, overlong="drop")


def test_packing_budget_lowers_the_cap(cache_dir, tmp_path, news_lengths):
    train_len, _ = news_lengths
    budget = min(train_len) + 1
    data, _ = _prepare(
        cache_dir, tmp_path, max_samples=24, eval_split=None, packing=True, train={"max_tokens": budget}
    )
    assert data.lengths.max_length == budget and data.stats["overlong"]["cap_from"] == "train.max_tokens"
    assert max(data.train["length"]) == budget
    with pytest.raises(DataError, match=rf"cap of {budget} \(train\.max_tokens\)"):
        _prepare(
            cache_dir,
            tmp_path,
            max_samples=24,
            eval_split=None,
            packing=True,
            overlong="error",
            train={"max_tokens": budget},
        )
    bigger, _ = _prepare(
        cache_dir, tmp_path, max_samples=24, eval_split=None, packing=True, train={"max_tokens": 100_000}
    )
    assert bigger.lengths.max_length == max(train_len)


# --- encoder-decoder -----------------------------------------------------------------------------------


def test_seq2seq_overlong_drop_and_error(cache_dir, tmp_path):
    kw = dict(model="tiny:t5", max_samples=24, max_eval_samples=8, max_source_length=90, max_target_length=24)
    cut, _ = _prepare(cache_dir, tmp_path, **kw)
    over = cut.stats["overlong"]["truncated"]
    assert over > 0 and cut.stats["truncated_sources"] > 0 and len(cut.train) == 24
    assert cut.lengths.max_length is None
    dropped, _ = _prepare(cache_dir, tmp_path, overlong="drop", **kw)
    assert len(dropped.train) == 24 - over and dropped.stats["overlong"]["dropped"] == over
    assert dropped.stats["truncated_sources"] == dropped.stats["truncated_targets"] == 0
    assert all(len(r["input_ids"]) <= 90 and len(r["labels"]) <= 24 for r in dropped.train)
    assert f"{over} dropped" in dropped.describe()
    with pytest.raises(
        DataError, match=r"train\.jsonl line \d+ has a \d+-token source.*data\.overlong: truncate"
    ):
        _prepare(cache_dir, tmp_path, overlong="error", **kw)


def test_seq2seq_auto_target_fits_every_row_unless_truncating(cache_dir, tmp_path):
    kw = dict(
        model="tiny:t5", max_samples=40, eval_split=None, max_source_length="auto", max_target_length="auto"
    )
    p95, _ = _prepare(cache_dir, tmp_path, **kw)
    longest, _ = _prepare(cache_dir, tmp_path, overlong="error", **kw)
    assert longest.lengths.max_target_length == longest.stats["target_tokens_untruncated"]["max"]
    assert p95.lengths.max_target_length <= longest.lengths.max_target_length
    assert longest.stats["overlong"]["dropped"] == 0 and len(longest.train) == 40


@pytest.mark.parametrize("fmt", ["chat", "completion"])
def test_seq2seq_takes_the_instruction_format_only(cache_dir, tmp_path, fmt):
    with pytest.raises(DataError, match=f"data.format {fmt}: encoder-decoder models.*instruction"):
        _prepare(cache_dir, tmp_path, model="tiny:t5", format=fmt, eval_split=None)
