"""Bad rows (data.on_bad_rows): malformed JSON lines, missing columns, null/empty/non-text fields and
malformed chat messages stop the run naming the file and line (error) or are left out and counted (skip)."""

import json
import re

import pytest

from lorakit.data import prepare_data
from lorakit.data.rows import MAX_QUOTED
from lorakit.data.sources import load_split
from lorakit.errors import DataError
from lorakit.model import load_config, load_tokenizer
from lorakit.recipe import recipe_from_dict
from tests.conftest import tiny_recipe, tiny_recipe_dict

GOOD = {"input": "what is two plus two", "target": "four"}
# (line as written in train.jsonl, why it is bad); the good lines around them are rows.
BAD_LINES = [
    ('{"input": "a", "target" "b"}', "invalid JSON (Expecting ':' delimiter at column 25)"),
    ('{"input": "no target here"}', "column 'target' is missing"),
    ('{"input": null, "target": "b"}', "column 'input' is null"),
    ('{"input": "   ", "target": "b"}', "column 'input' is empty"),
    (
        '{"input": "a", "target": 4}',
        "column 'target' is the class id 4, not text; give data.label_names to turn class ids into words",
    ),
    ('{"input": 4.5, "target": "b"}', "column 'input' is float, not text: 4.5"),
    ('["input", "target"]', "a JSON array, not an object of columns"),
]


def _data(tmp_path, **data):
    """The data section of the tiny recipe, reading the instruction columns `input` and `target`."""
    fields = {"input_column": "input", "target_column": "target", "prompt_template": "{input}"}
    return tiny_recipe(tmp_path, tmp_path / "run", data={**fields, **data}).data


def _write(path, lines: list[str]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _mixed_file(tmp_path) -> tuple[str, list[int]]:
    """train.jsonl with a good row, then each bad line followed by a good row, and a blank line (which is no
    row at all); returns the path and the lines of the good rows."""
    lines, good = [json.dumps(GOOD)], [1]
    for bad, _ in BAD_LINES:
        lines += [bad, json.dumps({"input": f"row after line {len(lines) + 1}", "target": "ok"})]
        good.append(len(lines))
    lines.insert(3, "")
    good = [n + 1 if n > 3 else n for n in good]
    return _write(tmp_path / "data" / "train.jsonl", lines), good


def test_a_malformed_json_line_stops_the_run_naming_file_and_line(tmp_path):
    path, _ = _mixed_file(tmp_path)
    with pytest.raises(DataError) as err:
        load_split(_data(tmp_path, source=path), "train")
    message = str(err.value)
    assert f"{path} line 2: invalid JSON (Expecting ':' delimiter at column 25)" in message
    assert "data.on_bad_rows is error" in message and "data.on_bad_rows: skip" in message


@pytest.mark.parametrize(("bad", "reason"), BAD_LINES)
def test_each_kind_of_bad_row_is_named(tmp_path, bad, reason):
    path = _write(tmp_path / "train.jsonl", [json.dumps(GOOD), json.dumps(GOOD), bad, json.dumps(GOOD)])
    with pytest.raises(DataError, match=re.escape(f"train.jsonl line 3: {reason}")):
        load_split(_data(tmp_path, source=path), "train")


def test_skip_leaves_bad_rows_out_and_keeps_their_lines(tmp_path):
    path, good_lines = _mixed_file(tmp_path)
    src = load_split(_data(tmp_path, source=path, on_bad_rows="skip"), "train")
    assert src.rows.column_names == ["input", "target"]  # only what data.format reads
    assert len(src.rows) == len(good_lines) and src.skipped == len(BAD_LINES)
    assert src.rows[0] == GOOD and src.rows[1]["input"] == "row after line 2"
    # Row i is named by its line in the file, blank lines and skipped rows included.
    assert [src.where(i) for i in range(len(src.rows))] == [f"{path} line {n}" for n in good_lines]
    assert src.quoted == [
        f"{path} line {n}: {reason}"
        for n, (_, reason) in zip([2, 5, 7, 9, 11], BAD_LINES[:MAX_QUOTED], strict=True)
    ]


def test_a_column_no_row_has_is_a_recipe_mistake_not_bad_rows(tmp_path):
    path = _write(tmp_path / "train.jsonl", [json.dumps(GOOD)] * 3)
    for policy in ("error", "skip"):
        data = _data(tmp_path, source=path, target_column="summary", on_bad_rows=policy)
        with pytest.raises(
            DataError, match=r"data\.target_column: column 'summary' not found.*\['input', 'target'\]"
        ):
            load_split(data, "train")


def test_error_names_a_row_missing_a_column_that_later_rows_have(tmp_path):
    lines = [json.dumps({"input": "first"}), json.dumps({"input": "x"}), json.dumps(GOOD)]
    path = _write(tmp_path / "train.jsonl", lines)
    with pytest.raises(DataError, match=r"train\.jsonl line 1: column 'target' is missing"):
        load_split(_data(tmp_path, source=path), "train")


def test_max_samples_takes_the_first_good_rows_and_reads_no_further(tmp_path):
    lines = [json.dumps(GOOD), "{broken", json.dumps(GOOD), json.dumps(GOOD), "{broken too"]
    path = _write(tmp_path / "train.jsonl", lines)
    src = load_split(_data(tmp_path, source=path, on_bad_rows="skip"), "train", limit=2)
    assert len(src.rows) == 2 and src.skipped == 1 and src.where(1).endswith("line 3")
    # Under error, a bad row past the rows used is never read.
    lines[1] = json.dumps(GOOD)
    _write(tmp_path / "train.jsonl", lines)
    assert len(load_split(_data(tmp_path, source=path), "train", limit=4).rows) == 4


def test_a_split_of_bad_rows_only_is_an_error_even_under_skip(tmp_path):
    path = _write(tmp_path / "train.jsonl", ['{"input": null, "target": "a"}', "not json"])
    with pytest.raises(DataError, match=r"on_bad_rows is skip, but all 2 rows of .*train\.jsonl are bad"):
        load_split(_data(tmp_path, source=path, on_bad_rows="skip"), "train")


def test_csv_values_stay_text_and_rows_are_named_by_line(tmp_path):
    path = tmp_path / "pairs.csv"
    path.write_text('input,target\nagent number,007\n"a quoted\nanswer",yes\nempty target,\nshort row\n')
    src = load_split(_data(tmp_path, source=str(path), on_bad_rows="skip"), "train")
    assert src.rows["target"] == ["007", "yes"] and src.rows["input"][1] == "a quoted\nanswer"
    assert src.where(0).endswith("pairs.csv line 2")
    assert src.quoted == [
        f"{path} line 5: column 'target' is empty",
        f"{path} line 6: column 'target' is missing",
    ]


def test_json_arrays_and_parquet_name_rows_by_index(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [GOOD, {"input": "x", "target": None}, GOOD]
    array = tmp_path / "array.json"
    array.write_text(json.dumps(rows, indent=1))
    with pytest.raises(DataError, match=r"array\.json row 1: column 'target' is null"):
        load_split(_data(tmp_path, source=str(array)), "train")
    (tmp_path / "broken.json").write_text('[{"input": "a", "target": "b"},\n {"input": ]')
    with pytest.raises(
        DataError, match=r"broken\.json is not valid JSON \(Expecting value at line 2 column 12\)"
    ):
        load_split(_data(tmp_path, source=str(tmp_path / "broken.json")), "train")
    table = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows + [{"input": "", "target": "z"}]), table)
    src = load_split(_data(tmp_path, source=str(table), on_bad_rows="skip"), "train")
    assert len(src.rows) == 2 and [src.where(i) for i in range(2)] == [f"{table} row 0", f"{table} row 2"]
    assert src.quoted == [
        f"{table} row 1: column 'target' is null",
        f"{table} row 3: column 'input' is empty",
    ]


# --- through the data pipeline (tokenizer of tiny:llama) ---------------------------------------------------


def _prepare(cache_dir, tmp_path, **data):
    raw = tiny_recipe_dict(
        cache_dir,
        tmp_path / "run",
        model={"name_or_path": "tiny:llama"},
        data={"input_column": "input", "target_column": "target", "prompt_template": "{input}", **data},
    )
    recipe = recipe_from_dict(raw)
    source, config = load_config(recipe)
    return prepare_data(recipe, load_tokenizer(recipe, source), config)


def test_skips_are_counted_in_stats_printed_and_part_of_the_cache_key(cache_dir, tmp_path):
    path, good_lines = _mixed_file(tmp_path)
    data_dir = str(tmp_path / "data")
    _write(tmp_path / "data" / "validation.jsonl", [json.dumps(GOOD), "{oops"])
    kw = dict(source=data_dir, max_samples=None, max_eval_samples=None, on_bad_rows="skip")
    data = _prepare(cache_dir, tmp_path, **kw)
    assert len(data.train) == len(good_lines) and len(data.eval) == 1
    bad = data.stats["bad_rows"]
    assert bad["policy"] == "skip" and bad["skipped"] == len(BAD_LINES) and bad["eval_skipped"] == 1
    assert bad["first"] == [
        f"{data_dir}/train.jsonl line {n}: {r}"
        for n, (_, r) in zip([2, 5, 7, 9, 11], BAD_LINES[:MAX_QUOTED], strict=True)
    ]
    text = data.describe()
    assert f"bad rows left out (data.on_bad_rows skip): train {len(BAD_LINES)}, eval 1; the first:" in text
    assert f"\n  {data_dir}/train.jsonl line 2: invalid JSON" in text
    again = _prepare(cache_dir, tmp_path, **kw)
    assert again.cache_hit and again.stats["bad_rows"] == bad  # the counts survive the cache
    # The policy is part of the cache key: an error run must not reuse rows that skip left out.
    with pytest.raises(DataError, match=r"train\.jsonl line 2: invalid JSON"):
        _prepare(cache_dir, tmp_path, **{**kw, "on_bad_rows": "error"})


def test_later_errors_name_the_file_line_after_skipped_rows(cache_dir, tmp_path):
    long_row = {"input": "a much longer question " * 20, "target": "and its answer"}
    lines = [json.dumps(GOOD), "{broken", json.dumps(GOOD), json.dumps(long_row)]
    path = _write(tmp_path / "train.jsonl", lines)
    kw = dict(source=path, eval_split=None, max_samples=None, on_bad_rows="skip", max_length=40)
    with pytest.raises(DataError, match=r"train\.jsonl line 4 is \d+ tokens, longer than the cap of 40"):
        _prepare(cache_dir, tmp_path, overlong="error", **kw)


CHAT = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Red."},
]


def test_rows_the_chat_template_refuses_follow_the_policy(cache_dir, tmp_path):
    # Like the templates of chat models that insist on alternating user/assistant turns.
    refusing = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
        "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    rows = [CHAT, [{"role": "system", "content": "Be brief."}, *CHAT], CHAT, {"not": "a list"}, CHAT]
    path = _write(tmp_path / "chat.jsonl", [json.dumps({"messages": m}) for m in rows])
    recipe = tiny_recipe(
        cache_dir,
        tmp_path / "run",
        model={"name_or_path": "tiny:llama"},
        data={
            "source": path,
            "format": "chat",
            "eval_split": None,
            "max_samples": None,
            "on_bad_rows": "skip",
        },
    )
    source, config = load_config(recipe)
    tok = load_tokenizer(recipe, source)
    tok.chat_template = refusing
    data = prepare_data(recipe, tok, config)
    assert len(data.train) == 3 and data.stats["bad_rows"]["skipped"] == 2
    assert data.stats["bad_rows"]["first"] == [
        f"{path} line 4: column 'messages' must be a non-empty list of {{role, content}} messages, got dict: "
        "{'not': 'a list'}",
        f"{path} line 2: the chat template failed: no system role",
    ]
    # Under error, the first refused row stops the run (the malformed line 4 is left out of this file: it
    # would stop the run sooner, while reading).
    strict_path = _write(tmp_path / "strict.jsonl", [json.dumps({"messages": m}) for m in rows[:3]])
    strict_data = recipe.data.model_copy(update={"on_bad_rows": "error", "source": strict_path})
    strict = recipe.model_copy(update={"data": strict_data})
    with pytest.raises(
        DataError, match=r"on_bad_rows is error: \S+strict\.jsonl line 2: the chat template failed"
    ):
        prepare_data(strict, tok, config)
