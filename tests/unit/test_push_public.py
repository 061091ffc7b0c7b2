"""What a push shows the world (lorakit/export/public.py, publish.collect): only the files lorakit wrote,
no absolute local path or credential in the recipe, the card or adapter_config.json, and a list of every
file with its size printed before the upload (issue 44)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from lorakit.export.public import public_path, public_recipe, upload_lines
from lorakit.export.publish import _say_what_is_pushed, collect
from lorakit.recipe import dump_recipe, recipe_from_dict
from tests.conftest import tiny_recipe_dict


def _run_dir(tmp_path: Path) -> Path:
    """A finished run under tmp_path/home/me/runs/r: its recipe names absolute local paths (and a data URL
    with a password); its adapter/ holds lorakit's files and two a user dropped there."""
    home = tmp_path / "home" / "me"
    run = home / "runs" / "r"
    raw = tiny_recipe_dict(home / "cache", run)
    raw["data"]["source"] = str(home / "data" / "train.jsonl")
    raw["distributed"]["nvme_path"] = str(home / "nvme")
    recipe = recipe_from_dict(raw)
    adapter = run / "adapter"
    adapter.mkdir(parents=True)
    (run / "recipe.yaml").write_text(dump_recipe(recipe))
    (run / "summary.json").write_text(json.dumps({"steps": 2, "method": "lora"}))
    config = {"peft_type": "LORA", "base_model_name_or_path": str(home / "cache" / "tiny-t5"), "r": 4}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    (adapter / "adapter_model.safetensors").write_bytes(b"w" * 1000)
    (adapter / "tokenizer.json").write_text("{}")
    (adapter / "notes.txt").write_text("my private notes")
    (adapter / "wandb-key.env").write_text("WANDB_API_KEY=abc")
    return run


def test_a_push_holds_only_lorakits_files_and_no_local_path(tmp_path):
    run = _run_dir(tmp_path)
    bundle = collect(run, "me/t")
    assert set(bundle.files) == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "recipe.yaml",
    }
    assert bundle.left_out == ("notes.txt", "wandb-key.env")
    texts = [bundle.card, *(f.decode() for f in bundle.files.values() if isinstance(f, bytes))]
    for text in texts:
        assert str(tmp_path) not in text
    pushed = bundle.files["recipe.yaml"].decode()
    assert pushed.startswith("# lorakit.push replaced this machine's absolute paths by their last part: ")
    recipe = yaml.safe_load(pushed)
    assert recipe["data"]["source"] == "train.jsonl" and recipe["output"]["dir"] == "r"
    assert recipe["data"]["cache_dir"] == "cache" and recipe["distributed"]["nvme_path"] == "nvme"
    assert set(bundle.shortened) == {"data.source", "data.cache_dir", "distributed.nvme_path", "output.dir"}
    assert json.loads(bundle.files["adapter_config.json"])["base_model_name_or_path"] == "tiny-t5"
    assert "## Recipe" in bundle.card and "source: train.jsonl" in bundle.card
    # The run directory itself is only read.
    assert str(tmp_path) in (run / "recipe.yaml").read_text()


def test_the_push_lists_every_file_and_its_size_first(tmp_path, capsys):
    run = _run_dir(tmp_path)
    bundle = collect(run, "me/t")
    _say_what_is_pushed("me/t", bundle)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("uploading to me/t: 5 files, ")
    listed = {line.split()[0]: line.split(None, 1)[1] for line in out[1:6]}
    assert set(listed) == {*bundle.files, "README.md"}
    assert listed["adapter_model.safetensors"].strip() == "1000 B"
    assert "not pushed (not written by lorakit): notes.txt, wandb-key.env" in out[-1]
    assert "recipe.yaml: absolute local paths shortened" in out[-2]
    assert upload_lines("me/t", {"a": b"xy"}, "c")[1:] == ["  README.md  1 B", "  a          2 B"]


def test_public_paths_and_credentials():
    assert public_path("/home/me/data/train.jsonl") == "train.jsonl"
    assert public_path("~/models/llama") == "llama"
    assert public_path("C:\\Users\\me\\llama") == "llama"
    for kept in ("meta-llama/Llama-3.1-8B", "tiny:t5", "builtin:news_summaries", "data/train.jsonl"):
        assert public_path(kept) == kept
    text, fields = public_recipe("data:\n  source: https://u:pw@host/d.jsonl\n")
    assert fields == [] and text == "data:\n  source: https://u:***@host/d.jsonl\n"


def test_an_export_card_holds_no_credential(tmp_path):
    from lorakit.export.card import model_card
    from lorakit.export.sources import MergeSource

    recipe = recipe_from_dict(tiny_recipe_dict(Path("c"), Path("o")))
    text = dump_recipe(recipe).replace("builtin:news_summaries", "https://me:pa55@host/news.jsonl?token=t0k")
    src = MergeSource(
        "adapter", tmp_path, None, recipe, text, None, base_name="tiny:t5", base_source="/m", revision=None,
        trust_remote_code=False,
    )  # fmt: skip
    card = model_card(
        src, dtype="float32", model_class="T5", is_encoder_decoder=True, shards=1, checks=[], notes=[]
    )
    assert "pa55" not in card and "t0k" not in card
    assert "https://me:***@host/news.jsonl?token=***" in card
