"""Data as it comes: Alpaca files, data.data_files (globs, per split), sharded parquet directories, CSV lines
the parser rejects, data.transform (and its source in the cache key), hub revisions in the cache key,
in-memory datasets, and ShareGPT / Alpaca / conversational preference files training as they are."""

import json
import os
import secrets
import subprocess
import sys

import datasets
import huggingface_hub
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lorakit
from lorakit.data import prepare_data
from lorakit.data.rows import alpaca_prompt
from lorakit.data.source_files import with_datasets
from lorakit.data.sources import source_fingerprint
from lorakit.errors import DataError
from lorakit.testing import resolve_model_source
from tests.conftest import tiny_recipe, tiny_recipe_dict
from tests.fake_hub import TOKEN, FakeHubServer, client_env
from tests.unit.test_causal_data import CONVERSATION, _jsonl, _labelled_spans, _load

ALPACA = [
    {"instruction": "Name the capital of France.", "input": "", "output": "Paris."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5."},
    {"instruction": "Say hello.", "output": "Hello."},  # no input at all
]


def _with(recipe, **data):
    return recipe.model_copy(update={"data": recipe.data.model_copy(update=data)})


@pytest.fixture(scope="module")
def tiny(cache_dir, tmp_path_factory):
    plain = {"input_column": "input", "target_column": "target", "prompt_template": "{input}"}
    return _load(cache_dir, tmp_path_factory.mktemp("src"), eval_split=None, **plain)


def test_alpaca_rows_take_the_two_standard_prompts(tiny, tmp_path):
    recipe, tok, config = tiny
    path = _jsonl(tmp_path / "alpaca.jsonl", ALPACA)
    data = prepare_data(_with(recipe, source=path, format="alpaca"), tok, config)
    assert len(data.train) == 3 and data.stats["format"] == "alpaca"
    prompts = [tok.decode(r["prompt_ids"], skip_special_tokens=True) for r in data.train]
    assert prompts[0] == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\nName the capital of France.\n\n### Response:\n"
    )
    assert "paired with an input" in prompts[1] and "### Input:\n2 and 3\n\n### Response:\n" in prompts[1]
    assert prompts[2] == alpaca_prompt({"instruction": "Say hello."})
    assert [_labelled_spans(tok, r) for r in data.train] == [["Paris.</s>"], ["5.</s>"], ["Hello.</s>"]]
    bad = _jsonl(tmp_path / "bad.jsonl", [*ALPACA, {"instruction": "x", "input": 3, "output": "y"}])
    with pytest.raises(DataError, match=r"bad\.jsonl line 4: column 'input' is int"):
        prepare_data(_with(recipe, source=bad, format="alpaca"), tok, config)


def test_data_files_globs_per_split_and_sharded_parquet(tiny, tmp_path):
    recipe, tok, config = tiny
    rows = [{"input": f"question {i}", "target": f"answer {i}"} for i in range(6)]
    d = tmp_path / "files"
    _jsonl(d / "part-a.jsonl", rows[:2])
    _jsonl(d / "part-b.jsonl", [rows[2], {"input": "no target"}, rows[3]])
    _jsonl(d / "held.jsonl", rows[4:])
    files = {"train": "part-*.jsonl", "validation": ["held.jsonl"]}
    r = _with(recipe, source=str(d), data_files=files, eval_split="auto", on_bad_rows="skip")
    data = prepare_data(r, tok, config)
    assert data.train["reference"] == [f"answer {i}" for i in range(4)]
    assert data.eval["reference"] == ["answer 4", "answer 5"]
    assert data.stats["bad_rows"]["first"] == [f"{d / 'part-b.jsonl'} line 2: column 'target' is missing"]
    with pytest.raises(DataError, match="matches no file"):
        prepare_data(_with(r, data_files="nothing-*.jsonl", eval_split=None), tok, config)
    # The hub's layout: data/train-0000k-of-0000n.parquet shards.
    hub = tmp_path / "hub" / "data"
    hub.mkdir(parents=True)
    for k in range(2):
        pq.write_table(pa.Table.from_pylist(rows[3 * k : 3 * k + 3]), hub / f"train-0000{k}-of-00002.parquet")
    pq.write_table(
        pa.Table.from_pylist([{"input": "x", "target": None}]), hub / "validation-00000-of-00001.parquet"
    )
    data = prepare_data(_with(recipe, source=str(hub.parent)), tok, config)
    assert data.train["reference"] == [f"answer {i}" for i in range(6)]
    with pytest.raises(DataError, match=r"validation-00000-of-00001\.parquet row 0: column 'target' is null"):
        prepare_data(_with(recipe, source=str(hub.parent), eval_split="validation"), tok, config)


def test_csv_lines_the_parser_rejects_are_bad_rows(tiny, tmp_path):
    recipe, tok, config = tiny
    path = tmp_path / "qa.csv"
    path.write_text('input,target\nfirst,one\nsecond,2,extra\n"bad"quote,x\nthird,3\n')
    with pytest.raises(DataError, match=r"qa\.csv line 3: 3 fields, the header has 2"):
        prepare_data(_with(recipe, source=str(path)), tok, config)
    data = prepare_data(_with(recipe, source=str(path), on_bad_rows="skip"), tok, config)
    assert data.train["reference"] == ["one", "3"]
    assert data.stats["bad_rows"]["first"][1].startswith(f"{path} line 4: not valid CSV")


def test_transform_runs_in_prepare_and_its_source_keys_the_cache(tiny, tmp_path, monkeypatch):
    recipe, tok, config = tiny
    module = tmp_path / "mytransforms.py"
    module.write_text("def qa(row):\n    return {'input': row['q'], 'target': row['a'].upper()}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _jsonl(tmp_path / "qa.jsonl", [{"q": "Capital of France?", "a": "Paris."}, {"q": "skip", "a": ""}])
    r = _with(recipe, source=path, transform="mytransforms:qa", on_bad_rows="skip")
    first = prepare_data(r, tok, config)
    assert first.train["reference"] == ["PARIS."] and first.stats["bad_rows"]["skipped"] == 1
    assert prepare_data(r, tok, config).cache_hit
    module.write_text(
        "def qa(row):\n    return None if not row['a'] else {'input': row['q'], 'target': row['a']}\n"
    )
    sys.modules.pop("mytransforms", None)
    again = prepare_data(r, tok, config)
    assert (
        not again.cache_hit
        and again.train["reference"] == ["Paris."]
        and again.stats["bad_rows"]["skipped"] == 0
    )
    with pytest.raises(DataError, match="data.transform: cannot import"):
        prepare_data(_with(r, transform="mytransforms:nothing"), tok, config)


def test_the_cache_key_follows_the_commit_a_revision_resolves_to(tiny, monkeypatch, tmp_path):
    recipe, _, _ = tiny
    with FakeHubServer() as server:
        server.hub.datasets["alice/chats"] = {"main": "a" * 40, "v2": "b" * 40}
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        r = _with(recipe, source="alice/chats")
        before = source_fingerprint(r.data, "train")
        assert "a" * 40 in before and source_fingerprint(r.data, "train") == before
        server.hub.datasets["alice/chats"]["main"] = "c" * 40  # an upstream update of the main branch
        assert "c" * 40 in source_fingerprint(r.data, "train")
        assert "b" * 40 in source_fingerprint(_with(r, revision="v2").data, "train")
        assert server.hub.calls("GET", "/api/datasets/alice/chats/revision/v2")


# One child process (huggingface_hub and datasets read the hub's address when imported): prepare at main, at
# v2, and at main again, printing what each prepare got.
_PREPARE_REVISIONS = """
import json, sys
import lorakit
from lorakit.recipe import recipe_from_dict
recipe = json.loads(sys.argv[1])
for revision in (None, "v2", None):
    recipe["data"]["revision"] = revision
    data = lorakit.prepare(recipe_from_dict(recipe))
    print(json.dumps({"hit": data.cache_hit, "references": list(data.train["reference"]), "path": str(data.path)}))
"""


@pytest.mark.slow
def test_a_new_hub_revision_is_prepared_again(cache_dir, monkeypatch, tmp_path):
    data = {
        "source": "alice/qa",
        "input_column": "input",
        "target_column": "target",
        "prompt_template": "{input}",
    }
    data.update(max_samples=None, eval_split=None, cache_dir=str(tmp_path / "cache"))
    recipe = tiny_recipe_dict(cache_dir, tmp_path / "run", data=data, eval={"enabled": False})
    recipe["model"]["name_or_path"] = resolve_model_source("tiny:t5", str(cache_dir))
    main, v2 = (
        secrets.token_hex(20),
        secrets.token_hex(20),
    )  # commits of this test only: no cache from another run
    rows = {main: [("one", "1"), ("two", "2")], v2: [("three", "3")]}
    with FakeHubServer() as server:
        server.hub.datasets["alice/qa"] = {"main": main, "v2": v2}
        for sha, pairs in rows.items():
            lines = "".join(json.dumps({"input": i, "target": t}) + "\n" for i, t in pairs)
            server.hub.dataset_files[sha] = {"train.jsonl": lines.encode()}
        env = client_env(os.environ, server.url, tmp_path / "hf-home")
        cmd = [sys.executable, "-c", _PREPARE_REVISIONS, json.dumps(recipe)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        first, other, again = (json.loads(line) for line in done.stdout.splitlines()[-3:])
        # Each commit's file was downloaded once: main's rows on the first run, v2's on the second.
        assert [
            len(server.hub.calls("GET", f"/datasets/alice/qa/resolve/{s}/train.jsonl")) for s in rows
        ] == [1, 1]
    assert not first["hit"] and first["references"] == ["1", "2"]
    assert not other["hit"] and other["references"] == ["3"] and other["path"] != first["path"]
    assert again == {**first, "hit": True}  # main again: served from its cache


def test_in_memory_datasets_are_read_as_a_source(tiny):
    recipe, tok, config = tiny
    train = datasets.Dataset.from_list([{"messages": CONVERSATION}, {"messages": CONVERSATION[1:3]}])
    held = datasets.Dataset.from_list([{"messages": CONVERSATION[:3]}])
    r = with_datasets(_with(recipe, format="chat", eval_split="auto"), train, held)
    data = prepare_data(r, tok, config)
    assert len(data.train) == 2 and len(data.eval) == 1
    assert with_datasets(r, train, held).data.source == r.data.source  # written once


def test_sharegpt_alpaca_and_conversational_pairs_train_as_they_come(cache_dir, tmp_path):
    sharegpt = [
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
        for q, a in [("Where did the storm hit?", "Around Cairo."), ("How strong?", "136 km/h.")] * 4
    ]
    pairs = [
        {
            "prompt": [{"role": "user", "content": "Where did the storm hit?"}],
            "chosen": [{"role": "assistant", "content": "Around Cairo."}],
            "rejected": [{"role": "assistant", "content": "Nowhere."}],
        }
    ] * 8
    common = dict(model={"name_or_path": "tiny:llama"}, eval={"generate": False})
    train = {"max_steps": 2, "micro_batch_size": 4, "lr": 1e-2}
    runs = {
        "sharegpt": dict(data={"source": _jsonl(tmp_path / "sg.jsonl", sharegpt), "format": "chat"}),
        "alpaca": dict(data={"source": _jsonl(tmp_path / "al.jsonl", ALPACA * 3), "format": "alpaca"}),
        "dpo": dict(
            data={
                "source": _jsonl(tmp_path / "pairs.jsonl", pairs),
                "format": "chat",
                "messages_column": "prompt",
            },
            train={**train, "objective": "dpo"},
        ),
    }
    for name, sections in runs.items():
        sections = {**common, **sections, "train": sections.get("train", train)}
        sections["data"] = {**sections["data"], "eval_split": None, "max_samples": None}
        result = lorakit.train(tiny_recipe(cache_dir, tmp_path / name, **sections))
        losses = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        losses = [m["loss"] for m in losses if "loss" in m and m.get("step")]
        assert len(losses) == 2 and all(loss == loss for loss in losses), name  # trained, finite


def test_conversational_pairs_render_through_the_template(cache_dir, tmp_path):
    recipe, tok, config = _load(cache_dir, tmp_path, format="chat", messages_column="prompt", eval_split=None)
    rows = [
        {"prompt": "Where did the storm hit?", "chosen": "Around Cairo.", "rejected": "Nowhere."},
        {
            "prompt": CONVERSATION[:4],
            "chosen": [{"role": "assistant", "content": "136 km/h."}],
            "rejected": "Calm.",
        },
    ]
    r = _with(recipe, source=_jsonl(tmp_path / "p.jsonl", rows))
    r = r.model_copy(update={"train": r.train.model_copy(update={"objective": "dpo"})})
    data = prepare_data(r, tok, config, "pairs")
    row = data.train[1]
    whole = tok.apply_chat_template(
        [*CONVERSATION[:4], {"role": "assistant", "content": "136 km/h."}], tokenize=False
    )
    assert tok.decode(row["prompt_ids"] + row["chosen_ids"]) == whole
    assert (
        tok.decode(row["chosen_ids"]) == "136 km/h.</s>\n"
        and tok.decode(row["rejected_ids"]) == "Calm.</s>\n"
    )
    assert tok.decode(data.train[0]["prompt_ids"]) == tok.apply_chat_template(
        [{"role": "user", "content": "Where did the storm hit?"}], tokenize=False, add_generation_prompt=True
    )


def test_prepare_show_prints_rows_with_the_loss_tokens_marked(cache_dir, tmp_path, capsys):
    import yaml

    from lorakit.prepare import main
    from tests.conftest import tiny_recipe_dict

    conv = [{"from": "human", "value": "Where did the storm hit?"}, {"from": "gpt", "value": "Around Cairo."}]
    data = {"source": _jsonl(tmp_path / "sg.jsonl", [{"conversations": conv}] * 2), "format": "chat"}
    raw = tiny_recipe_dict(
        cache_dir,
        tmp_path / "run",
        model={"name_or_path": "tiny:llama"},
        data={**data, "eval_split": None, "max_samples": None},
        eval={"generate": False},
    )
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    assert main([str(tmp_path / "r.yaml"), "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert "--- row 0 of 2:" in out and "--- row 1" not in out
    assert "<|user|>\nWhere did the storm hit?</s>\n<|assistant|>\n⟦Around Cairo.</s>\n⟧" in out
