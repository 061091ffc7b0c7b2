"""QLoRA without DeepSpeed: the schema, the optional dependency, and the 4-bit model lorakit builds."""

import sys
from pathlib import Path

import pytest
import torch

import lorakit
from lorakit.errors import RecipeError
from lorakit.model import build_model, count_parameters
from lorakit.model.quantize import INSTALL_HINT, is_4bit, quantization_summary, require_bitsandbytes
from lorakit.recipe import dump_recipe, load_recipe, recipe_from_dict
from tests.conftest import tiny_recipe, tiny_recipe_dict


def qlora_dict(cache: Path, out: Path, kind: str = "t5", **method) -> dict:
    return tiny_recipe_dict(
        cache,
        out,
        model={"name_or_path": f"tiny:{kind}", "dtype": "bfloat16", "gradient_checkpointing": True},
        method={"kind": "qlora", **method},
        data={"packing": False},
    )


def test_qlora_defaults_to_nf4_and_round_trips(tmp_path):
    r = recipe_from_dict(qlora_dict(tmp_path, tmp_path / "run"))
    assert r.method.quantization() == "nf4" and r.method.adapter()
    assert (
        recipe_from_dict(qlora_dict(tmp_path, tmp_path / "run", quant_type="fp4")).method.quantization()
        == "fp4"
    )
    f = tmp_path / "resolved.yaml"
    f.write_text(dump_recipe(r))
    assert load_recipe(f) == r
    lora = tiny_recipe(tmp_path, tmp_path / "run")
    assert lora.method.quantization() is None and lora.method.adapter()


@pytest.mark.parametrize(
    "kind, message",
    [
        ("full", r"method\.quant_type: full fine-tuning cannot train a 4-bit base.*use method\.kind: qlora"),
        ("lora", r"method\.quant_type: kind lora keeps the base in model\.dtype: remove method\.quant_type"),
    ],
)
def test_4bit_without_kind_qlora_is_rejected(tmp_path, kind, message):
    raw = tiny_recipe_dict(tmp_path, tmp_path / "run", method={"kind": kind, "quant_type": "nf4"})
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict(raw)


def test_missing_bitsandbytes_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    with pytest.raises(RecipeError, match=r"method\.kind qlora needs bitsandbytes") as e:
        require_bitsandbytes()
    assert 'pip install "lorakit[qlora]"' in str(e.value) and INSTALL_HINT in str(e.value)
    # lorakit.train stops before tokenizing, launching workers or writing a run directory.
    cache = tmp_path / "cache"
    recipe = recipe_from_dict(qlora_dict(cache, tmp_path / "run"))
    with pytest.raises(RecipeError, match=r"lorakit\[qlora\]"):
        lorakit.train(recipe)
    assert not (tmp_path / "run").exists() and not (cache / "datasets").exists()


def test_fp16_is_refused_for_models_with_fp32_layers(cache_dir, tmp_path):
    for kind in ("qlora", "lora"):
        raw = qlora_dict(cache_dir, tmp_path / "run")
        raw["model"]["dtype"] = "float16"
        raw["method"]["kind"] = kind
        with pytest.raises(
            RecipeError, match=r"model\.dtype float16: T5ForConditionalGeneration keeps \['wo'\]"
        ):
            build_model(recipe_from_dict(raw))


def test_t5_4bit_base_keeps_wo_in_bf16_and_nothing_is_upcast(cache_dir, tmp_path):
    recipe = recipe_from_dict(qlora_dict(cache_dir, tmp_path / "run", r=4, alpha=8))
    model = build_model(recipe).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # no fp32 upcast anywhere
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    quantized, plain = set(), set()
    for name, m in model.named_modules():
        if name.endswith(".base_layer"):
            (quantized if is_4bit(m.weight) else plain).add(name.split(".")[-2])
    # transformers quantizes every linear layer but T5's `wo` (_keep_in_fp32_modules): lorakit loads it in
    # bf16 (no fp32 copy), and it gets a LoRA adapter like the others.
    assert plain == {"wo"} and quantized == {"q", "k", "v", "o", "wi_0", "wi_1"}
    q = quantization_summary(model, recipe)
    assert q["unquantized_linear"] == ["lm_head", "wo"] and q["base_bytes"]["saved"] > 0
    trainable, total = count_parameters(model)
    base_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n and not is_4bit(p))
    assert total == base_params + q["quantized_params"] + trainable


@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_gradients_reach_every_lora_weight_with_checkpointing(cache_dir, tmp_path, kind):
    """Non-reentrant checkpointing needs none of prepare_model_for_kbit_training's input-grad hooks."""
    built = build_model(recipe_from_dict(qlora_dict(cache_dir, tmp_path / "run", kind=kind, r=4, alpha=8)))
    model = built.model.train()
    assert model.base_model.model.is_gradient_checkpointing
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)  # B starts at zero, which would zero A's gradient
    ids = torch.randint(5, 1000, (2, 12))
    if kind == "t5":
        out = model(input_ids=ids, labels=ids[:, :6].contiguous())
    else:
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all(n.split(".")[-3] in ("lora_A", "lora_B") for n in lora)
    missing = [n for n, p in lora.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing


def test_peft_kbit_preparation_still_upcasts_what_deepspeed_casts_back(cache_dir):
    """Why build.py skips peft's prepare_model_for_kbit_training: it upcasts every non-4-bit weight to fp32
    (DeepSpeed's bf16 engine then casts them back). If this fails, peft changed; revisit the choice."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    from lorakit.model.quantize import bnb_config
    from lorakit.testing import resolve_model_source

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_source("tiny:llama", cache_dir),
        dtype=torch.bfloat16,
        quantization_config=bnb_config("nf4", torch.bfloat16),
    )
    model = prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": False})
    upcast = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= upcast


def _lora_grads(model, kind: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout masks each time
    labels = ids[:, :6].contiguous() if kind == "t5" else ids
    model(input_ids=ids, labels=labels).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("avx512bf16", [True, False], ids=["avx512bf16", "no-avx512bf16"])
@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_an_evaluation_leaves_the_4bit_base_as_it_trains(cache_dir, tmp_path, monkeypatch, kind, avx512bf16):
    """bitsandbytes, on CPUs with AVX512-BF16, rewrites a 4-bit layer into an inference-only layout at its first
    no-grad eval forward; training after lorakit's first evaluation then lost the gradient through every
    frozen 4-bit layer (and ZeRO-3 checkpoints crashed). Both CPU branches are forced, whatever this CPU is."""
    from bitsandbytes.cextension import lib
    from bitsandbytes.nn import Linear4bit

    monkeypatch.setattr(lib, "has_avx512bf16_cpu", lambda: avx512bf16)
    model = build_model(
        recipe_from_dict(qlora_dict(cache_dir, tmp_path / "run", kind=kind, r=4, alpha=8))
    ).model
    layers = [m for m in model.modules() if isinstance(m, Linear4bit)]
    assert layers and not any(m.support_avx512bf16_for_cpu for m in layers)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    ids = torch.randint(5, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    before = _lora_grads(model, kind, ids)
    assert len(before) == sum(p.requires_grad for p in model.parameters())

    model.eval()
    with torch.no_grad():  # what an evaluation does
        model(input_ids=ids, **({"decoder_input_ids": ids[:, :6]} if kind == "t5" else {}))
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)

    after = _lora_grads(model, kind, ids)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n], before[n]) for n in before)
    model.state_dict()  # what every checkpoint calls
