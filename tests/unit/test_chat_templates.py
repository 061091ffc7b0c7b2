"""The loss falls on exactly the assistant turns of the whole conversation's rendering, under templates that
behave as Llama 3's, Qwen3's (earlier turns' thinking dropped), Mistral v0.3's (system folded into a user
turn) and Gemma 3's, with or without `{% generation %}` blocks; messages as they come (ShareGPT, tool calls,
content parts, Arrow's None keys, weight 0)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lorakit.data import prepare_data
from lorakit.data.chat import IGNORE_INDEX, ChatTurns, normalize_messages, use_template
from lorakit.errors import DataError
from tests.unit.test_causal_data import CONVERSATION, _jsonl, _labelled_spans, _load

# Each template is written with {% generation %} blocks around what an assistant turn is; lorakit reads the
# same template without them (G and E empty) by locating the turns, and must mark the same tokens.
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{G}{{ m['content'] | trim }}<|eot_id|>{E}"
    "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN3 = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}"
    "{% set content = m.content %}{% set reasoning = '' %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>assistant\n{G}{% if loop.index0 > ns.last_query and reasoning %}"
    "<think>\n{{ reasoning.strip('\\n') }}\n</think>\n\n{% endif %}{{ content }}<|im_end|>\n{E}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# As the issue has it: the system prompt folded into the first user turn.
MISTRAL_FIRST = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] "
    "{% if loop.index0 == 1 and messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "{{ m.content }}[/INST]{% elif m.role == 'assistant' %} {G}{{ m.content | trim }}{{ eos_token }}{E}"
    "{% endif %}{% endfor %}"
)
# As Mistral-7B-Instruct-v0.3 ships it: the system prompt goes into the user turn that is the last message
# (so a conversation ending with the assistant loses it, and prefixes are not prefixes of the whole).
MISTRAL_V03 = (
    "{% if messages[0].role == 'system' %}{% set system_message = messages[0].content %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}"
    "{{ bos_token }}{% for m in loop_messages %}{% if m.role == 'user' %}"
    "{% if loop.last and system_message is defined %}[INST] {{ system_message }}\n\n{{ m.content }}[/INST]"
    "{% else %}[INST] {{ m.content }}[/INST]{% endif %}"
    "{% elif m.role == 'assistant' %} {G}{{ m.content | trim }}{{ eos_token }}{E}{% endif %}{% endfor %}"
)
GEMMA3 = (
    "{{ bos_token }}{% if messages[0].role == 'system' %}"
    "{% set first_user_prefix = messages[0].content + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}{% set role = 'model' if m.role == 'assistant' else m.role %}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{% if role == 'model' %}{G}{{ m.content | trim }}<end_of_turn>\n{E}"
    "{% else %}{{ (first_user_prefix if loop.first else '') + m.content | trim }}<end_of_turn>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
TEMPLATES = {
    "llama3": LLAMA3,
    "qwen3": QWEN3,
    "mistral_first": MISTRAL_FIRST,
    "mistral_v03": MISTRAL_V03,
    "gemma3": GEMMA3,
}
THINKING = [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "Where did the storm hit?"},
    {
        "role": "assistant",
        "content": "<think>\nThe report names Cairo.\n</think>\n\nAround Cairo, 45 villages.",
    },
    {"role": "user", "content": "How strong were the winds?"},
    {"role": "assistant", "content": "<think>The report says 136.</think>136 kilometres per hour."},
]
CONVERSATIONS = [CONVERSATION, THINKING, CONVERSATION[1:3], CONVERSATION[:3]]


def _template(name: str, tagged: bool) -> str:
    g, e = ("{% generation %}", "{% endgeneration %}") if tagged else ("", "")
    return TEMPLATES[name].replace("{G}", g).replace("{E}", e)


def _oracle(tok, template: str, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, labels) from transformers' assistant mask of the template's {% generation %} blocks."""
    out = tok.apply_chat_template(
        messages, chat_template=template, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = list(out["input_ids"])
    return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, out["assistant_masks"], strict=True)]


@pytest.fixture(scope="module")
def tiny(cache_dir, tmp_path_factory):
    return _load(cache_dir, tmp_path_factory.mktemp("chat"), format="chat")


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_masked_tokens_are_the_assistant_turns_of_the_whole_rendering(tiny, tmp_path, name):
    recipe, tok, config = tiny
    path = _jsonl(tmp_path / "chat" / "train.jsonl", [{"messages": m} for m in CONVERSATIONS])
    expected = [_oracle(tok, _template(name, True), m) for m in CONVERSATIONS]
    for tagged in (False, True):
        data = recipe.data.model_copy(
            update={"source": path, "eval_split": None, "chat_template": _template(name, tagged)}
        )
        prepared = prepare_data(recipe.model_copy(update={"data": data}), tok, config)
        assert len(prepared.train) == len(CONVERSATIONS)  # every row kept
        got = [(r["input_ids"], r["labels"]) for r in prepared.train]
        assert got == expected, (name, tagged)
    for ids, labels in expected:  # the oracle itself marks every assistant turn, and only them
        assert 2 <= sum(label != IGNORE_INDEX for label in labels) < len(ids)
    whole = tok.decode(expected[1][0])
    if name == "qwen3":  # the earlier turn's thinking is gone from the whole rendering; the last one's kept
        assert "Cairo.\n" not in whole and "The report says 136." in whole
        last = _labelled_spans(tok, {"input_ids": expected[1][0], "labels": expected[1][1]})[-1]
        assert last.startswith("<think>\nThe report says 136.\n</think>")
    if name == "mistral_v03":
        assert "Answer in one line." not in whole  # the system prompt is dropped when the assistant is last


def test_weight_zero_and_roles_from_sharegpt(tiny, tmp_path):
    recipe, tok, config = tiny
    conv = [
        {"from": "system", "value": "Answer in one line."},
        {"from": "human", "value": "Where did the storm hit?"},
        {"from": "gpt", "value": "Around Cairo, 45 villages.", "weight": 0},
        {"from": "human", "value": "How strong were the winds?"},
        {"from": "gpt", "value": "136 kilometres per hour."},
    ]
    path = _jsonl(tmp_path / "sg" / "train.jsonl", [{"conversations": conv, "id": "x1"}])
    data = recipe.data.model_copy(update={"source": path, "eval_split": None})
    row = prepare_data(recipe.model_copy(update={"data": data}), tok, config).train[0]
    assert _labelled_spans(tok, row) == ["136 kilometres per hour.</s>\n"]
    assert tok.decode(row["input_ids"]) == tok.apply_chat_template(CONVERSATION, tokenize=False)


def test_tool_calls_content_parts_and_arrow_keys_render_through_the_template(tiny, tmp_path):
    recipe, tok, config = tiny
    tok_template = (
        "{% for m in messages %}<|{{ m.role }}|>\n{% if m.tool_calls %}"
        "{% for c in m.tool_calls %}call {{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}"
        "{% else %}{{ m.content }}{% endif %}{% if m.tool_call_id is defined %} [{{ m.tool_call_id }}]{% endif %}"
        "</s>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Cairo"}}}
    rows = [
        [
            {"role": "user", "content": "Weather in Cairo?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "31 C, dry", "tool_call_id": "c1"},
            {"role": "assistant", "content": "Hot and dry: 31 C."},
        ],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
    ]
    # Parquet, as a hub dataset comes: Arrow gives every message every key (None where a message had none).
    d = tmp_path / "tools"
    d.mkdir()
    pq.write_table(pa.table({"messages": [json.loads(json.dumps(r)) for r in rows]}), d / "train.parquet")
    data = recipe.data.model_copy(
        update={"source": str(d), "eval_split": None, "chat_template": tok_template}
    )
    prepared = prepare_data(recipe.model_copy(update={"data": data}), tok, config)
    assert _labelled_spans(tok, prepared.train[0]) == [
        'call weather({"city": "Cairo"})</s>\n',
        "Hot and dry: 31 C.</s>\n",
    ]
    text = tok.decode(prepared.train[0]["input_ids"])
    assert "[c1]" in text and "None" not in text and "null" not in text
    assert _labelled_spans(tok, prepared.train[1]) == ["Hello.</s>\n"]
    # Content as a list of text parts (JSON lines: Arrow cannot hold text and lists in one column).
    parts = [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Cairo?"}]
    path = _jsonl(
        tmp_path / "parts.jsonl", [{"messages": [{"role": "user", "content": parts}, *rows[0][1:]]}]
    )
    data = data.model_copy(update={"source": path})
    row = prepare_data(recipe.model_copy(update={"data": data}), tok, config).train[0]
    assert "Weather in\nCairo?" in tok.decode(row["input_ids"]) and len(_labelled_spans(tok, row)) == 2


def test_turns_not_found_are_bad_rows(tiny, tmp_path):
    recipe, tok, config = tiny
    # A template that writes no assistant text: the row cannot be trained on, and under skip it is counted.
    template = "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}\n{% endif %}{% endfor %}"
    path = _jsonl(
        tmp_path / "bad" / "train.jsonl",
        [{"messages": CONVERSATION}, {"messages": [{"role": "user", "content": "x"}]}],
    )
    data = recipe.data.model_copy(
        update={"source": path, "eval_split": None, "chat_template": template, "on_bad_rows": "skip"}
    )
    prepared = prepare_data(recipe.model_copy(update={"data": data}), tok, config)
    assert len(prepared.train) == 1 and prepared.stats["bad_rows"]["skipped"] == 1
    assert "line 1: assistant message 2 was not found" in prepared.stats["bad_rows"]["first"][0]


def test_message_layouts(tiny):
    normal, problem = normalize_messages(
        [{"speaker": "USER", "text": "hi"}, {"speaker": "BOT", "text": "hello"}],
        {"role": "speaker", "content": "text"},
        {"USER": "user", "BOT": "assistant"},
    )
    assert problem is None and normal == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    assert "not text" in normalize_messages([{"role": "user", "content": [{"type": "image"}]}], None, {})[1]
    assert "weight" in normalize_messages([{"role": "user", "content": "x", "weight": 0.5}], None, {})[1]
    _, tok, _ = tiny
    with pytest.raises(DataError, match="neither Jinja"):
        prepare_data(*_with_template(tiny, "no/such/template.jinja"))
    ChatTurns(tok).labels(CONVERSATION, train_on_inputs=False)


def _with_template(tiny, template):
    recipe, tok, config = tiny
    data = recipe.data.model_copy(update={"chat_template": template})
    return recipe.model_copy(update={"data": data}), tok, config


def test_a_template_that_needs_a_system_message_still_learns_its_turn_end(tiny):
    _, tok, _ = tiny
    template = (
        "{% if messages[0].role != 'system' %}{{ raise_exception('a system message comes first') }}{% endif %}"
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    ids, labels = ChatTurns(use_template(tok, template)).labels(CONVERSATION, train_on_inputs=False)
    spans = _labelled_spans(tok, {"input_ids": ids, "labels": labels})
    # (the space after "[assistant]" is inside the first answer token, which belongs to the turn)
    assert spans == [" Around Cairo, 45 villages.<|end|>\n", " 136 kilometres per hour.<|end|>\n"]
