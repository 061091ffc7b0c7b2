from pathlib import Path

import pytest
import yaml

from lorakit.errors import RecipeError
from lorakit.recipe import apply_overrides, dump_recipe, load_recipe, recipe_from_dict
from tests.conftest import RECIPES, tiny_recipe, tiny_recipe_dict


def test_every_shipped_recipe_validates():
    files = sorted(RECIPES.glob("*.yaml"))
    shipped = {"quickstart.yaml", "quickstart_causal.yaml", "llama3_8b_lora.yaml"}
    shipped |= {"llama3_70b_qlora.yaml", "llama3_70b_qlora_zero2.yaml", "flan_t5_xxl_qlora.yaml"}
    shipped |= {"flan_t5_xxl_full.yaml"}
    assert shipped | {"flan_t5_xl_lora.yaml", "flan_t5_xxl_lora.yaml"} <= {f.name for f in files}
    for f in files:
        recipe = load_recipe(f)
        assert f.read_text().splitlines()[0] == f"# python -m lorakit.run recipes/{f.name}"
        assert recipe.output.dir


def test_flan_t5_recipes_are_the_headline_setup():
    for name in ("flan_t5_xl_lora.yaml", "flan_t5_xxl_lora.yaml"):
        r = load_recipe(RECIPES / name)
        assert r.model.dtype == "bfloat16" and r.model.gradient_checkpointing
        assert r.method.kind == "lora" and r.method.target_modules == "all-linear"
        assert r.distributed.zero_stage == 3 and r.distributed.num_processes == 8
        assert (r.data.source, r.data.config) == ("abisee/cnn_dailymail", "3.0.0")
        assert r.data.prompt_template == "Summarize the following news article:\n{input}\nSummary:\n"


def test_causal_recipes_pack_on_zero3():
    big = load_recipe(RECIPES / "llama3_8b_lora.yaml")
    assert (
        big.model.attention == "auto" and big.model.dtype == "bfloat16" and big.model.gradient_checkpointing
    )
    assert big.method.kind == "lora" and big.method.target_modules == "all-linear"
    assert big.distributed.zero_stage == 3 and big.distributed.num_processes == 8
    assert big.data.packing and big.data.format == "chat" and big.train.max_tokens
    small = load_recipe(RECIPES / "quickstart_causal.yaml")
    assert small.model.name_or_path == "tiny:llama" and small.data.packing
    assert small.distributed.zero_stage == 3 and small.distributed.num_processes == 2


def test_qlora_recipes_quantize_the_base_on_zero2_and_zero3():
    for name, stage in (("llama3_70b_qlora.yaml", 3), ("llama3_70b_qlora_zero2.yaml", 2)):
        r = load_recipe(RECIPES / name)
        assert r.model.name_or_path == "meta-llama/Llama-3.1-70B-Instruct"
        assert r.method.kind == "qlora" and r.method.quantization() == "nf4"
        assert r.method.target_modules == "all-linear" and r.model.gradient_checkpointing
        assert r.model.dtype == "bfloat16" and r.model.attention == "auto"
        assert r.distributed.zero_stage == stage and r.distributed.num_processes == 8
        assert r.data.format == "chat" and r.data.packing is True and r.train.max_tokens
    z3, z2 = (
        load_recipe(RECIPES / "llama3_70b_qlora.yaml"),
        load_recipe(RECIPES / "llama3_70b_qlora_zero2.yaml"),
    )
    # The same tokens per optimizer step on both stages.
    assert z3.train.max_tokens * z3.train.gradient_accumulation_steps == (
        z2.train.max_tokens * z2.train.gradient_accumulation_steps
    )
    t5 = load_recipe(RECIPES / "flan_t5_xxl_qlora.yaml")
    lora = load_recipe(RECIPES / "flan_t5_xxl_lora.yaml")
    assert t5.model.name_or_path == "google/flan-t5-xxl" and t5.model.dtype == "bfloat16"
    assert t5.method.kind == "qlora" and t5.method.quantization() == "nf4"
    assert t5.method.target_modules == "all-linear" and t5.distributed.zero_stage == 3
    assert t5.data == lora.data  # the same data, so QLoRA and LoRA runs compare like for like
    examples_per_step = {
        name: r.train.micro_batch_size * r.train.gradient_accumulation_steps * r.distributed.num_processes
        for name, r in (("qlora", t5), ("lora", lora))
    }
    assert examples_per_step["qlora"] == examples_per_step["lora"]


def test_completion_data_cannot_be_scored_by_generation():
    raw = tiny_recipe_dict(Path("c"), Path("o"), data={"format": "completion"})
    with pytest.raises(RecipeError, match=r"eval\.generate: data\.format completion"):
        recipe_from_dict(raw)
    raw["eval"]["generate"] = False
    assert recipe_from_dict(raw).data.format == "completion"


def test_dotted_overrides_are_typed():
    r = load_recipe(
        RECIPES / "quickstart.yaml",
        [
            "train.lr=2e-4",
            "method.target_modules=[q, v]",
            "data.max_samples=10",
            "model.gradient_checkpointing=false",
        ],
    )
    assert r.train.lr == 2e-4 and isinstance(r.train.lr, float)
    assert r.method.target_modules == ["q", "v"]
    assert r.data.max_samples == 10
    assert r.model.gradient_checkpointing is False


def test_overrides_do_not_mutate_input():
    raw = {"train": {"lr": 1.0}}
    out = apply_overrides(raw, ["train.lr=2.0", "eval.num_beams=4"])
    assert raw == {"train": {"lr": 1.0}} and out["train"]["lr"] == 2.0 and out["eval"]["num_beams"] == 4


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.lrr=1e-3", "train.lrr"),
        ("train.lr=fast", "train.lr"),
        ("distributed.zero_stage=5", "distributed.zero_stage"),
        ("method.kind=prefix", "method.kind"),
        ("data.prompt_template=no placeholder", "data.prompt_template"),
        ("distributed.offload_params=cpu", "distributed.offload_params"),
    ],
)
def test_bad_values_name_the_field(tmp_path, override, field):
    if field == "distributed.offload_params":
        override_list = [override, "distributed.zero_stage=2"]
    else:
        override_list = [override]
    with pytest.raises(RecipeError, match=field.replace(".", r"\.")):
        load_recipe(RECIPES / "quickstart.yaml", override_list)


def test_missing_required_section(tmp_path):
    with pytest.raises(RecipeError, match=r"data: required key is missing"):
        recipe_from_dict({"model": {"name_or_path": "x"}, "output": {"dir": "o"}})


def test_recipe_is_frozen(tmp_path):
    r = tiny_recipe(tmp_path, tmp_path / "run")
    with pytest.raises(Exception, match="frozen"):
        r.train.lr = 1.0


def test_resolved_dump_round_trips(tmp_path):
    r = load_recipe(RECIPES / "quickstart.yaml")
    f = tmp_path / "resolved.yaml"
    f.write_text(dump_recipe(r))
    assert load_recipe(f) == r
    assert "warmup_ratio" in yaml.safe_load(f.read_text())["train"]  # defaults are written out


def test_unreadable_recipe_files(tmp_path):
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="KEY=VALUE"):
        load_recipe(RECIPES / "quickstart.yaml", ["train.lr"])
    assert Path(RECIPES / "quickstart.yaml").exists()


def test_every_problem_is_reported_in_one_message():
    with pytest.raises(RecipeError) as err:
        load_recipe(
            RECIPES / "quickstart.yaml",
            [
                "train.lr=fast",
                "distributed.zero_stage=5",
                "trian.lr=1",
                "data.max_source_length=big",
                "method.target_modules=5",
                "oops",
            ],
        )
    lines = str(err.value).splitlines()
    assert lines[0] == "invalid recipe (6 problems):"
    assert lines[1:] == [
        "  override 'oops': expected KEY=VALUE, e.g. train.lr=2e-4",
        "  method.target_modules: Input should be 'all-linear' or a valid list (got 5)",
        # A union's alternatives are one line for the field, not one per alternative.
        "  data.max_source_length: Input should be a valid integer or 'auto' (got 'big')",
        "  train.lr: Input should be a valid number, unable to parse string as a number (got 'fast')",
        "  distributed.zero_stage: Input should be 0, 1, 2 or 3 (got 5)",
        "  trian: unknown key (did you mean train? see docs/recipes.md for every key)",
    ]


def test_cross_field_checks_of_several_sections_are_reported_together():
    raw = tiny_recipe_dict(Path("c"), Path("o"))
    raw["data"]["prompt_template"] = "no placeholder"
    raw["distributed"] = {"zero_stage": 2, "offload_params": "cpu"}
    raw["output"]["merge"], raw["output"]["save_adapter"] = True, False
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(raw)
    assert str(err.value).splitlines() == [
        "invalid recipe (3 problems):",
        "  data.prompt_template names no column: put one in braces, e.g. {input} or {premise}",
        "  distributed.offload_params needs zero_stage 3",
        "  output.merge needs output.save_adapter: true (the merge reads the saved adapter or model)",
    ]


def test_bad_rows_policy_is_validated():
    raw = tiny_recipe_dict(Path("c"), Path("o"), data={"on_bad_rows": "ignore"})
    with pytest.raises(RecipeError, match=r"data\.on_bad_rows: Input should be 'error' or 'skip'"):
        recipe_from_dict(raw)
    assert tiny_recipe(Path("c"), Path("o")).data.on_bad_rows == "error"


def test_flan_t5_xxl_full_is_the_guide_setup_on_the_lora_recipe_data():
    full = load_recipe(RECIPES / "flan_t5_xxl_full.yaml")
    lora = load_recipe(RECIPES / "flan_t5_xxl_lora.yaml")
    assert full.method.kind == "full" and full.model == lora.model and full.data == lora.data
    assert full.model.dtype == "bfloat16"
    assert (full.distributed.zero_stage, full.distributed.num_processes) == (3, 8)
    assert (full.train.micro_batch_size, full.train.lr, full.train.epochs) == (8, 1e-4, 3)
