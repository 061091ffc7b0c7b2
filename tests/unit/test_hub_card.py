"""output.push_to_hub in the schema, and the Hub's model card and file list (lorakit/export/card.py hub_card,
publish.collect) for what the end-to-end push (tests/e2e/test_push.py, an MNLI classifier) does not show: a
ROUGE run on a Hub base, a causal LM, a merged export pushed without its run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorakit.errors import LorakitError, RecipeError
from lorakit.export.card import HubFacts, hub_card, model_card
from lorakit.export.publish import collect
from lorakit.export.sources import MergeSource
from lorakit.export.verify import Check
from lorakit.recipe import apply_overrides, dump_recipe, recipe_from_dict
from tests.conftest import tiny_recipe_dict


def test_push_to_hub_is_off_by_default_and_takes_its_four_keys():
    raw = tiny_recipe_dict(Path("c"), Path("o"))
    assert recipe_from_dict(raw).output.push_to_hub is None
    raw = apply_overrides(raw, ["output.push_to_hub.repo_id=me/tiny", "output.push_to_hub.create_pr=true"])
    p = recipe_from_dict(raw).output.push_to_hub
    assert (p.repo_id, p.private, p.revision, p.create_pr) == ("me/tiny", False, None, True)


@pytest.mark.parametrize("repo_id", ["tiny", "me/", "me/tiny/x", "me /tiny", "-me/tiny"])
def test_a_repo_id_is_owner_slash_name(repo_id):
    raw = tiny_recipe_dict(Path("c"), Path("o"), output={"push_to_hub": {"repo_id": repo_id}})
    with pytest.raises(RecipeError, match=r"output\.push_to_hub\.repo_id: String should match pattern"):
        recipe_from_dict(raw)


def test_a_push_needs_the_saved_adapter():
    raw = tiny_recipe_dict(
        Path("c"), Path("o"), output={"push_to_hub": {"repo_id": "me/t", "wrong": 1}, "save_adapter": False}
    )
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(raw)
    assert "output.push_to_hub.wrong: unknown key" in str(err.value)
    raw["output"]["push_to_hub"].pop("wrong")
    with pytest.raises(RecipeError, match="output.push_to_hub needs output.save_adapter: true"):
        recipe_from_dict(raw)


ROUGE_SUMMARY = {
    "method": "lora",
    "world_size": 8,
    "zero_stage": 3,
    "dtype": "bfloat16",
    "attention": "flash_attention_2",
    "plan": {"device": "cuda", "nodes": 1},
    "steps": 1200,
    "epochs": 3,
    "train_samples": 76800,
    "train_tokens": 30_000_000,
    "stop_reason": "epochs",
    "train_seconds": 5400.0,
    "tokens_per_second": 5555.5,
    "peak_memory_bytes": {"gpu": 30e9, "cpu_rss": 12e9},
    "loss": {"first": 2.5, "last": 1.25},
    "eval": {"loss": 1.3, "rouge1": 44.5, "rougeL": 37.25},
    "data": {
        "train_rows": 25600,
        "eval_rows": 512,
        "eval_source": {"split": "validation", "held_out": False},
    },
    "versions": {"lorakit": "0.1.0", "torch": "2.13.0"},
}


def test_the_card_of_an_adapter_on_a_hub_base_with_rouge_scores():
    raw = tiny_recipe_dict(
        Path("c"), Path("o"), model={"name_or_path": "google/flan-t5-xl", "revision": "v1"}
    )
    raw["method"].update(use_dora=True)
    recipe = recipe_from_dict(raw)
    facts = HubFacts(
        repo_id="me/xl-news",
        layout="adapter",
        method="lora",
        base_name="google/flan-t5-xl",
        base_load="google/flan-t5-xl",
        is_encoder_decoder=True,
        recipe=recipe,
        recipe_text=dump_recipe(recipe),
        summary=ROUGE_SUMMARY,
        images=("loss.png",),
    )
    card = hub_card(facts)
    assert card.startswith("---\nbase_model: google/flan-t5-xl\nlibrary_name: peft\n")
    assert "pipeline_tag: text2text-generation" in card
    assert 'base = AutoModelForSeq2SeqLM.from_pretrained("google/flan-t5-xl", revision="v1")' in card
    assert 'model = PeftModel.from_pretrained(base, "me/xl-news")\n' in card and "not on the Hub" not in card
    # The prompt of the snippet is the run's template with "..." for its column.
    assert "inputs = tokenizer('Summarize the following news article:\\n...\\nSummary:\\n'," in card
    assert "- method: lora: r=4, alpha=8, dropout=0, target_modules=all-linear, dora" in card
    assert (
        "- data: `builtin:news_summaries`, format instruction: 25,600 training rows, 512 evaluation rows"
        in card
    )
    assert "- trained: 1200 optimizer steps (3 epochs, stopped by epochs), 76,800 examples" in card
    assert "- hardware: 8 processes on cuda, ZeRO-3, bfloat16, attention flash_attention_2" in card
    assert "5400.0 s of training, 5,556 tokens/s, peak GPU memory 30.00 GB, peak CPU memory 12.00 GB" in card
    assert "| rouge1 | 44.5000 |\n| rougeL | 37.2500 |" in card and "Confusion matrix" not in card
    assert "![training loss per step](loss.png)" in card and "## Verification" not in card


def test_the_card_of_a_merged_causal_model_without_its_run():
    facts = HubFacts("me/m", "merged", "lora", "./llama", "./llama", is_encoder_decoder=False)
    card = hub_card(facts)
    assert "library_name: transformers" in card and "pipeline_tag: text-generation" in card
    assert "base_model:" not in card  # a local path is not a Hub id
    assert 'model = AutoModelForCausalLM.from_pretrained("me/m")' in card and "PeftModel" not in card
    # Nothing recorded, nothing claimed.
    assert "## Evaluation" not in card and "- hardware" not in card and "loss.png" not in card


def test_a_merged_export_on_its_own_pushes_the_recipe_its_card_holds(tmp_path):
    recipe = recipe_from_dict(tiny_recipe_dict(Path("c"), Path("o")))
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"is_encoder_decoder": True}))
    (export / "model.safetensors").write_bytes(b"weights")
    src = MergeSource(
        "adapter",
        export,
        None,
        recipe,
        dump_recipe(recipe),
        None,
        base_name="tiny:t5",
        base_source="/m",
        revision=None,
        trust_remote_code=False,
    )
    check = Check("merged vs the adapter model", 0.01, 5.0, 0.1, 0.5)
    (export / "README.md").write_text(
        model_card(
            src,
            dtype="float32",
            model_class="T5",
            is_encoder_decoder=True,
            shards=1,
            checks=[check],
            notes=[],
        )
    )
    bundle = collect(export, "me/t")
    assert bundle.layout == "merged"
    assert set(bundle.files) == {"config.json", "model.safetensors", "recipe.yaml"}
    assert bundle.files["recipe.yaml"] == dump_recipe(recipe).encode()
    assert f"- {check.describe()}" in bundle.card and "## Recipe" in bundle.card
    assert 'AutoModelForSeq2SeqLM.from_pretrained("me/t")' in bundle.card


def test_collect_refuses_what_is_not_a_run_or_an_export(tmp_path):
    with pytest.raises(LorakitError, match="neither a run directory") as err:
        collect(tmp_path, "me/t")
    assert err.value.exit_code == 2 and err.value.doc_link() == "docs/publish.md#what-is-pushed"


def _hardware_line(summary: dict) -> str:
    raw = tiny_recipe_dict(Path("c"), Path("o"), distributed={"strategy": "fsdp", "zero_stage": 3})
    recipe = recipe_from_dict(raw)
    facts = HubFacts(
        repo_id="me/fsdp", layout="adapter", method="lora", base_name="b", base_load="b",
        is_encoder_decoder=True, recipe=recipe, recipe_text=dump_recipe(recipe), summary=summary, images=(),
    )  # fmt: skip
    (line,) = [x for x in hub_card(facts).splitlines() if x.startswith("- hardware:")]
    return line


def test_the_card_of_an_fsdp2_run_names_fsdp2_not_a_zero_stage():
    """summary.json records the recipe's zero_stage (3 by default) for every run; an FSDP2 run's card said
    "ZeRO-3" from it. The card now reads the backend's own description, and an older summary's strategy."""
    from lorakit.backends.fsdp import FsdpBackend

    raw = tiny_recipe_dict(Path("c"), Path("o"), distributed={"strategy": "fsdp", "zero_stage": 3})
    recipe = recipe_from_dict(raw)
    written = {**ROUGE_SUMMARY, "strategy": "fsdp", "backend": FsdpBackend(recipe, "cpu").describe_run()}
    assert _hardware_line(written) == (
        "- hardware: 8 processes on cuda, FSDP2 full sharding, bfloat16, attention flash_attention_2"
    )
    older = {**ROUGE_SUMMARY, "strategy": "fsdp"}  # a run directory from before summary.json's `backend`
    assert "ZeRO" not in _hardware_line(older) and ", FSDP2, bfloat16" in _hardware_line(older)


def test_the_card_names_the_objective_summary_json_records():
    def card(summary):
        return hub_card(HubFacts("me/m", "adapter", "lora", "./llama", "./llama", False, summary=summary))

    assert "- objective: orpo\n" in card({**ROUGE_SUMMARY, "objective": "orpo"})
    assert "- objective:" not in card(ROUGE_SUMMARY)  # an older summary: nothing recorded, nothing claimed
