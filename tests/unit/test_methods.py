"""method.kind ia3 and the LoRA options (DoRA, rsLoRA, init, LoRA+, modules_to_save) without training:
schema errors, peft's refusal behind one of them, LoRA+'s optimizer groups, the planner's counts against
the parameters peft creates, the compare label, and the merge's checks of IA3 adapters.
(tests/integration/test_methods.py trains each method under ZeRO-3.)"""

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from lorakit.errors import AdapterError, RecipeError
from lorakit.model.adapter import optimizer_groups, peft_config
from lorakit.planner.arch import arch_from_config, resolve_config
from lorakit.planner.states import adapter_params
from lorakit.recipe.schema import MethodSection
from lorakit.report.runs import RunRow
from lorakit.testing import resolve_model_source
from tests.conftest import tiny_recipe


@pytest.mark.parametrize(
    "method, message",
    [
        ({"kind": "qlora", "init": "pissa"}, "method.init: pissa decomposes the base weights"),
        ({"kind": "ia3", "use_dora": True}, "method.use_dora: a LoRA option, and kind ia3"),
        ({"kind": "full", "lr_ratio_b": 16}, "method.lr_ratio_b: a LoRA option, and kind full"),
        ({"kind": "ia3", "init": "olora"}, "method.init: a LoRA option"),
        ({"kind": "ia3", "quant_type": "nf4"}, "method.quant_type: kind ia3 keeps the base"),
        ({"kind": "full", "modules_to_save": ["lm_head"]}, "kind full trains every module already"),
        ({"modules_to_save": []}, "method.modules_to_save: give at least one"),
        ({"feedforward_modules": ["wo"]}, "method.feedforward_modules: only kind ia3"),
        ({"kind": "ia3", "feedforward_modules": ["wo"]}, "must be a subset of a method.target_modules list"),
        ({"kind": "ia3", "target_modules": ["k"], "feedforward_modules": ["wo"]}, "must be a subset"),
        ({"lr_ratio_b": 0}, "greater than 0"),
    ],
)
def test_impossible_combinations_are_schema_errors(method, message):
    with pytest.raises(ValidationError, match=message):
        MethodSection(**method)


def test_dora_on_a_4bit_base_under_zero3_is_a_recipe_error(cache_dir, tmp_path):
    """Found by trying: 2-process ZeRO-3 QLoRA + DoRA fails in the first forward ('Params4bit' object has no
    attribute 'ds_status'); ZeRO-2 trains it."""
    with pytest.raises(
        RecipeError, match="recipe: method.use_dora: DoRA on a 4-bit base .* fails under ZeRO-3"
    ):
        tiny_recipe(
            cache_dir, tmp_path, method={"kind": "qlora", "use_dora": True}, distributed={"zero_stage": 3}
        )
    assert tiny_recipe(
        cache_dir, tmp_path, method={"kind": "qlora", "use_dora": True}, distributed={"zero_stage": 2}
    ).method.use_dora


def test_allowed_combinations_validate_and_label():
    m = MethodSection(kind="qlora", use_dora=True, use_rslora=True, init="olora", lr_ratio_b=16)
    assert m.options() == ["dora", "rslora", "olora", "lora+ x16"] and m.lora() and m.mutates_base()
    assert MethodSection(use_dora=True, init="pissa").mutates_base()
    ia3 = MethodSection(kind="ia3", target_modules=["k", "v", "wo"], feedforward_modules=["wo"])
    assert ia3.adapter() and not ia3.lora() and ia3.options() == []
    assert MethodSection(modules_to_save=["embed_tokens"]).options() == ["full embed_tokens"]


def test_peft_refuses_pissa_on_a_4bit_base(cache_dir):
    """Why kind qlora + init pissa is a schema error (and olora is not): peft's PiSSA init decomposes the packed
    4-bit storage (in bf16, lorakit's quant storage dtype) and fails; OLoRA dequantizes first."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lorakit.model.quantize import bnb_config

    def load():
        source = resolve_model_source("tiny:llama", cache_dir)
        q = bnb_config("nf4", torch.bfloat16)
        return AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16, quantization_config=q)

    with pytest.raises(RuntimeError, match="non-finite values"):
        get_peft_model(load(), LoraConfig(r=4, target_modules="all-linear", init_lora_weights="pissa"))
    get_peft_model(load(), LoraConfig(r=4, target_modules="all-linear", init_lora_weights="olora"))


def _peft_model(cache_dir, family: str, method: MethodSection):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    source = resolve_model_source(f"tiny:{family}", cache_dir)
    cls = AutoModelForSeq2SeqLM if family == "t5" else AutoModelForCausalLM
    torch.manual_seed(0)
    return get_peft_model(cls.from_pretrained(source), peft_config(method, family == "t5"))


def test_loraplus_groups_put_b_at_lr_times_the_ratio(cache_dir):
    method = MethodSection(r=4, use_dora=True, lr_ratio_b=16, modules_to_save=["lm_head"])
    model = _peft_model(cache_dir, "llama", method)
    groups = optimizer_groups(model, method, lr=1e-3, weight_decay=0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    by_lr = {g["lr"]: [names[id(p)] for p in g["params"]] for g in groups}
    assert set(by_lr) == {1e-3, 16e-3} and all(g["params"] for g in groups)  # no empty group
    assert all("lora_A" in n or "modules_to_save" in n for n in by_lr[1e-3])
    assert all("lora_B" in n or "lora_magnitude_vector" in n for n in by_lr[16e-3])
    grouped = [n for ns in by_lr.values() for n in ns]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(grouped) == sorted(trainable)  # every trainable parameter, once
    # Without the ratio: the plain list of trainable parameters, as before.
    plain = MethodSection(r=4)
    assert optimizer_groups(model, plain, lr=1e-3, weight_decay=0.0) == [
        p for p in model.parameters() if p.requires_grad
    ]


@pytest.mark.parametrize("family", ["t5", "llama"])
@pytest.mark.parametrize(
    "method",
    [
        {"use_dora": True},
        {"kind": "ia3"},
        {"kind": "ia3", "target_modules": ["q", "v", "wi", "down_proj", "gate_proj"]},
        {"modules_to_save": ["lm_head"], "use_rslora": True},
    ],
)
def test_planner_counts_what_peft_creates(cache_dir, tmp_path, family, method):
    if "feedforward_modules" not in method and isinstance(method.get("target_modules"), list):
        method["feedforward_modules"] = [m for m in method["target_modules"] if m in ("wi", "down_proj")]
    recipe = tiny_recipe(cache_dir, tmp_path, model={"name_or_path": f"tiny:{family}"}, method=method)
    model = _peft_model(cache_dir, family, recipe.method)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    arch = arch_from_config(resolve_config(recipe))
    assert sum(adapter_params(arch, recipe.method)) == trainable > 0


def test_compare_labels_the_method_with_its_options():
    row = RunRow(Path("r"), "r", method="qlora", quantization="bitsandbytes-nf4", method_options=["dora"])
    assert row.method_label() == "qlora (nf4, dora)"
    assert RunRow(Path("r"), "r", method="lora", method_options=["pissa", "lora+ x16"]).method_label() == (
        "lora (pissa, lora+ x16)"
    )
    assert RunRow(Path("r"), "r", method="ia3").method_label() == "ia3"


def _ia3_adapter(cache_dir, out: Path, value: float) -> Path:
    model = _peft_model(cache_dir, "llama", MethodSection(kind="ia3"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ia3_l" in name:
                p.fill_(value)
    model.save_pretrained(str(out))
    return out


def test_ia3_adapter_merges_and_an_untrained_one_is_refused(cache_dir, tmp_path):
    import lorakit

    trained = _ia3_adapter(cache_dir, tmp_path / "trained", 1.5)
    result = lorakit.merge(trained, tmp_path / "merged", dtype="float32")
    assert result.checks[0].passed and result.checks[0].effect_visible
    assert "an IA3 adapter" in (tmp_path / "merged" / "README.md").read_text()
    untrained = _ia3_adapter(cache_dir, tmp_path / "untrained", 1.0)
    with pytest.raises(AdapterError, match="every one of its 6 IA3 vectors is all ones"):
        lorakit.merge(untrained, tmp_path / "out")
    assert not (tmp_path / "out").exists()
