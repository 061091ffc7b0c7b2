import json

import pytest

from lorakit.data import Seq2SeqCollator, prepare_data
from lorakit.data.collate import IGNORE_INDEX
from lorakit.errors import DataError
from lorakit.model import load_config, load_tokenizer
from tests.conftest import tiny_recipe


def _prepare(cache_dir, tmp_path, **data):
    recipe = tiny_recipe(cache_dir, tmp_path / "run", data=data)
    source, config = load_config(recipe)
    tok = load_tokenizer(recipe, source)
    return prepare_data(recipe, tok, config), tok, config


def test_prepare_tokenizes_then_reuses_cache(tmp_path):
    cache = tmp_path / "cache"
    first, tok, _ = _prepare(cache, tmp_path, max_samples=20, max_eval_samples=5)
    assert not first.cache_hit and len(first.train) == 20 and len(first.eval) == 5
    again, _, _ = _prepare(cache, tmp_path, max_samples=20, max_eval_samples=5)
    assert again.cache_hit and again.path == first.path
    assert again.train["input_ids"] == first.train["input_ids"]
    # Lengths and stats round-trip through the cache metadata; describe() reports the overlong counts.
    assert again.lengths == first.lengths and again.lengths.max_length is None
    assert again.stats == first.stats and again.stats["overlong"]["policy"] == "truncate"
    assert "over-long examples (truncate): train " in again.describe()
    other, _, _ = _prepare(cache, tmp_path, max_samples=21, max_eval_samples=5)
    assert not other.cache_hit and other.path != first.path


def test_truncation_keeps_template_suffix_and_eos(cache_dir, tmp_path):
    data, tok, _ = _prepare(cache_dir, tmp_path, max_samples=40, max_source_length=40, max_target_length=8)
    suffix = tok("\nSummary:\n", add_special_tokens=False)["input_ids"]
    assert data.stats["truncated_sources"] > 0
    for ids, labels in zip(data.train["input_ids"], data.train["labels"], strict=True):
        assert len(ids) <= 40 and len(labels) <= 8
        assert ids[-1] == tok.eos_token_id and labels[-1] == tok.eos_token_id
        text = tok.decode(ids, skip_special_tokens=True)
        assert text.startswith("Summarize the following news article:") and text.rstrip().endswith("Summary:")
    assert suffix  # the template suffix is real tokens, not empty


def test_auto_lengths(cache_dir, tmp_path):
    data, tok, config = _prepare(
        cache_dir, tmp_path, max_samples=200, max_source_length="auto", max_target_length="auto"
    )
    src = [len(x) for x in data.train["input_ids"]]
    assert data.lengths.max_source_length == max(src) == data.stats["source_tokens_untruncated"]["max"]
    assert data.lengths.max_source_length <= 512
    # p95 of targets: about 5% of targets are cut, never more than 6%.
    assert data.stats["truncated_targets"] <= 0.06 * 200
    assert data.lengths.max_target_length < data.stats["target_tokens_untruncated"]["max"] + 1


def test_missing_column_is_named(cache_dir, tmp_path):
    with pytest.raises(DataError, match=r"data\.target_column: column 'summary' not found.*highlights"):
        _prepare(cache_dir, tmp_path, target_column="summary")


def test_non_text_cell_names_the_row(cache_dir, tmp_path):
    f = tmp_path / "rows.jsonl"
    rows = [{"input": "a b c", "target": "a"}, {"input": None, "target": "b"}]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match=r"rows\.jsonl line 2: column 'input' is null"):
        _prepare(
            cache_dir,
            tmp_path,
            source=str(f),
            input_column="input",
            target_column="target",
            prompt_template="{input}",
            max_samples=None,
            max_eval_samples=None,
            eval_split=None,
        )


def test_local_file_sources(cache_dir, tmp_path):
    f = tmp_path / "pairs.csv"
    f.write_text("question,answer\nwhat is one plus one,two\nname a colour,red\n")
    recipe_kw = dict(
        source=str(f),
        input_column="question",
        target_column="answer",
        max_samples=None,
        max_eval_samples=None,
        prompt_template="Q: {input}\nA:",
    )
    with pytest.raises(DataError, match="single file.*'train' split"):
        _prepare(cache_dir, tmp_path, eval_split="validation", **recipe_kw)
    # eval_split auto (the default) holds a row out of the single file instead.
    held, _, _ = _prepare(cache_dir, tmp_path, **recipe_kw)
    assert len(held.train) == 1 and len(held.eval) == 1 and held.stats["eval_source"]["held_out"]
    data, _, _ = _prepare(cache_dir, tmp_path, eval_split=None, **recipe_kw)
    assert len(data.train) == 2 and data.eval is None
    with pytest.raises(DataError, match="no such file"):
        _prepare(cache_dir, tmp_path, source=str(tmp_path / "missing.jsonl"))


def test_collator_pads_dynamically_and_counts_tokens(cache_dir, tmp_path):
    data, tok, config = _prepare(cache_dir, tmp_path, max_samples=8)
    rows = [data.train[i] for i in range(3)]
    batch = Seq2SeqCollator(tok.pad_token_id, config.decoder_start_token_id)(rows)
    longest = max(len(r["input_ids"]) for r in rows)
    assert batch["input_ids"].shape == (3, longest)  # padded to the batch, not to max_source_length
    assert batch["num_target_tokens"] == sum(len(r["labels"]) for r in rows)
    real = sum(len(r["input_ids"]) + len(r["labels"]) for r in rows)
    assert batch["num_real_tokens"] == real
    assert batch["num_token_slots"] == batch["input_ids"].numel() + batch["labels"].numel()
    labels, dec = batch["labels"], batch["decoder_input_ids"]
    assert (dec[:, 0] == config.decoder_start_token_id).all()
    n0 = len(rows[0]["labels"])
    assert dec[0, 1:n0].tolist() == rows[0]["labels"][: n0 - 1]
    assert (labels[batch["decoder_attention_mask"] == 0] == IGNORE_INDEX).all()


def test_packing_does_not_change_seq2seq_rows(cache_dir, tmp_path):
    packed, _, _ = _prepare(cache_dir, tmp_path, packing=True)
    padded, _, _ = _prepare(cache_dir, tmp_path, packing=False)
    assert packed.path == padded.path and packed.train["input_ids"] == padded.train["input_ids"]


def test_unreachable_sources_are_clear_errors(cache_dir, tmp_path, monkeypatch):
    import datasets
    import huggingface_hub

    # The libraries read these at import time; patch the constants so nothing waits on network retries.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match=r"data\.source 'lorakit-test/not-a-dataset'"):
        _prepare(cache_dir, tmp_path, source="lorakit-test/not-a-dataset")
    from lorakit.errors import RecipeError

    recipe = tiny_recipe(cache_dir, tmp_path / "run", model={"name_or_path": "lorakit-test/nope"})
    with pytest.raises(RecipeError, match=r"model\.name_or_path 'lorakit-test/nope'"):
        load_config(recipe)


def test_tokenizing_through_the_backend_gives_transformers_ids(cache_dir, tmp_path):
    from lorakit.data.tokenize import token_ids

    recipe = tiny_recipe(cache_dir, tmp_path / "run")
    tok = load_tokenizer(recipe, load_config(recipe)[0])
    texts = ["Summarize:\nnews </s> here", "def f(x):\n    return x  # ünïcode", "word " * 900, "x"]
    assert token_ids(tok, texts) == tok(texts)["input_ids"] and len(token_ids(tok, texts)[2]) > 900
    tok(texts, truncation=True, max_length=8, padding="max_length")  # leaves the backend cutting and padding
    assert (
        token_ids(tok, texts) == tok(texts)["input_ids"]
        and token_ids(tok, texts[:1]) == tok(texts[:1])["input_ids"]
    )
