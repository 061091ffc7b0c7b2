"""lorakit.model.families: the registry, each family's recognition and tiny builder, the generic path for
architectures no family claims, and the callers that ask the family (planner, tiling, packing, ZeRO-3)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from transformers import AutoConfig

from lorakit.errors import RecipeError
from lorakit.model.attention import packing_enabled
from lorakit.model.families import FAMILIES, family_for_type, family_named, family_of, model_class, tiny_kinds
from lorakit.model.families.base import (
    FLEX,
    LOOP,
    PACKED_ISOLATION,
    PLANNER_SHAPES,
    TILED_LOSS,
    TILED_MLP,
    VARLEN,
)
from lorakit.planner.arch import arch_from_config, known_config
from lorakit.testing import SPECIAL_TOKENS, TINY_VOCAB_SIZE, build_tiny_tokenizer, tiny_config
from tests.conftest import tiny_recipe

# Tiny configs of architectures no family claims, built locally (no download).
UNCLAIMED = {
    "gpt_neox": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=TINY_VOCAB_SIZE,
    ),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=TINY_VOCAB_SIZE, bos_token_id=3, eos_token_id=1),
}


def _unclaimed(model_type: str):
    return AutoConfig.for_model(model_type, **UNCLAIMED[model_type])


# --- registry ----------------------------------------------------------------------------------------


def test_every_model_type_is_claimed_by_one_family():
    names = [f.name for f in FAMILIES]
    types = [t for f in FAMILIES for t in f.model_types]
    assert len(set(names)) == len(names) and len(set(types)) == len(types)
    assert {"t5", "bart", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2"} <= set(
        names
    )
    assert tiny_kinds()[:5] == ("t5", "llama", "mistral", "qwen2", "bart")
    assert {"qwen3", "gemma2", "gemma3", "phi3", "olmo2"} <= set(tiny_kinds())
    assert {"mixtral", "qwen3_moe", "olmoe", "t5gemma"} <= set(names) and {"mixtral", "t5gemma"} <= set(
        tiny_kinds()
    )
    assert all(not f.unproven and f.caveat() is None for f in FAMILIES)
    assert all(family_for_type(t) is f for f in FAMILIES for t in f.model_types)


@pytest.mark.parametrize("kind", tiny_kinds())
def test_each_tiny_config_is_recognised_as_its_family(kind):
    family = family_of(tiny_config(kind))
    assert family is family_named(kind)
    assert family.encoder_decoder is bool(getattr(tiny_config(kind), "is_encoder_decoder", False))


def test_mt5_is_t5():
    config = AutoConfig.for_model("mt5", d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16)
    assert family_of(config).name == "t5"


def test_unknown_family_name_is_a_recipe_error():
    with pytest.raises(RecipeError, match="kind: unknown model family 'gpt9'.*t5, llama"):
        family_named("gpt9")


def test_kernel_names_are_fused_attentions():
    from lorakit.model import fused_attention

    assert (VARLEN, FLEX, LOOP) == (fused_attention.VARLEN, fused_attention.FLEX, fused_attention.LOOP)
    kinds = {k for f in FAMILIES for k in f.packed.kernels}
    assert kinds <= set(fused_attention.KINDS)
    assert family_named("t5").packed.kernels_for("encoder") == (FLEX, LOOP)
    assert family_named("llama").packed.kernels_for("causal") == (VARLEN, LOOP)
    assert family_named("bart").packed.kernels_for("cross") == (LOOP,)


def test_packing_is_the_familys():
    assert packing_enabled("auto", "sdpa", True, "bart") is False
    assert packing_enabled("auto", "eager", True, "mt5") is True
    assert packing_enabled("auto", "flash_attention_2", False, "qwen2") is True
    # A causal LM no family claims packs as before; an unclaimed encoder-decoder never does.
    assert packing_enabled("auto", "sdpa", False, "gpt_neox") is True
    with pytest.raises(RecipeError, match="'pegasus' models"):
        packing_enabled(True, "sdpa", True, "pegasus")


# --- tiny builders -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.tiny is not None], ids=lambda f: f.name)
def test_every_tiny_builder_builds_and_runs_a_forward(family):
    config = family.tiny.config(TINY_VOCAB_SIZE, bos=SPECIAL_TOKENS.index("<s>"))
    assert family_of(config) is family
    torch.manual_seed(0)
    model = family.tiny.model(config).eval()
    ids = torch.randint(4, TINY_VOCAB_SIZE, (2, 12))
    extra = {"decoder_input_ids": ids[:, :5]} if family.encoder_decoder else {}
    with torch.no_grad():
        logits = model(input_ids=ids, **extra).logits
    assert logits.shape == (2, 5 if family.encoder_decoder else 12, config.vocab_size)
    assert torch.isfinite(logits).all()


# --- the planner's shapes ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", tiny_kinds())
def test_the_planner_reads_shapes_from_the_family(kind):
    config = tiny_config(kind)
    arch = arch_from_config(config)
    family = family_of(config)
    shape = family.shape(config, [lin.name for lin in arch.linears])
    assert arch.family == kind and arch.unproven == ()
    for field in dataclasses.fields(shape):
        if field.name != "tied_head":
            assert getattr(arch, field.name) == getattr(shape, field.name), field.name
    assert shape.tied_head in (None, arch.tied_head) and (shape.experts is None) == (family.moe is None)


def test_planner_shapes_of_known_models_and_bart():
    t5 = arch_from_config(known_config("google/flan-t5-xl"))
    assert (t5.family, t5.hidden, t5.ffn, t5.layers, t5.decoder_layers, t5.head_dim) == (
        "t5",
        2048,
        5120,
        24,
        24,
        64,
    )
    assert t5.tied_head is False
    llama = arch_from_config(known_config("meta-llama/Meta-Llama-3-8B"))
    assert (llama.family, llama.hidden, llama.kv_heads, llama.head_dim, llama.vocab) == (
        "llama",
        4096,
        8,
        128,
        128256,
    )
    # BART's sizes have their own names (the T5 reading raised an AttributeError on its config).
    bart = arch_from_config(tiny_config("bart"))
    assert (bart.hidden, bart.ffn, bart.layers, bart.decoder_layers, bart.heads, bart.head_dim) == (
        32,
        64,
        1,
        1,
        2,
        16,
    )


# --- the generic path --------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", sorted(UNCLAIMED))
def test_an_unclaimed_architecture_takes_the_generic_family(model_type):
    config = _unclaimed(model_type)
    family = family_of(config)
    assert family.name == "generic" and family.model_types == (model_type,)
    assert set(family.unproven) == {PACKED_ISOLATION, TILED_LOSS, TILED_MLP, PLANNER_SHAPES}
    assert f"no model family for {model_type!r}" in family.caveat() and "not proven" in family.caveat()
    arch = arch_from_config(config)
    assert (arch.family, arch.hidden, arch.layers, arch.heads, arch.head_dim) == ("generic", 64, 2, 4, 16)
    assert arch.ffn == (128 if model_type == "gpt_neox" else 256) and arch.unproven == family.unproven
    assert arch.caveat() == family.caveat()


def test_an_unclaimed_encoder_decoder_never_packs_nor_tiles():
    config = AutoConfig.for_model("umt5", d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16)
    family = family_of(config)
    assert family.name == "generic" and family.encoder_decoder and family.unproven == (PLANNER_SHAPES,)
    assert not family.packed.backends and not family.tiled_loss and family.tiled_mlp is None
    assert arch_from_config(config).decoder_layers == 2


def test_a_config_without_sizes_is_a_clear_error_not_an_attribute_error():
    from transformers import PretrainedConfig

    config = PretrainedConfig()
    config.model_type = "mystery"
    family = family_of(config)
    with pytest.raises(RecipeError, match="'mystery' config sets none of hidden_size, d_model, n_embd"):
        family.shape(config, [])


def test_the_tiled_loss_and_mlp_ask_the_family(tmp_path):
    from lorakit.model.tiled_loss import loss_tile_tokens
    from lorakit.model.tiled_mlp import tile_tokens
    from tests.unit.test_tiled_mlp import tiny_llama_recipe

    with pytest.raises(RecipeError, match="'gpt_neox' is not one"):
        loss_tile_tokens(tiny_llama_recipe(tmp_path, tiled_loss=True), _unclaimed("gpt_neox"))
    # qwen3's logits are the head's, so the tiled loss is exact for it.
    qwen3 = AutoConfig.for_model("qwen3", hidden_size=64, num_attention_heads=4, vocab_size=300)
    assert family_of(qwen3).tiled_loss and TILED_LOSS not in family_of(qwen3).unproven
    assert loss_tile_tokens(tiny_llama_recipe(tmp_path, tiled_loss=True), qwen3) is not None
    with pytest.raises(RecipeError, match="encoder-decoder"):
        tile_tokens(tiny_llama_recipe(tmp_path, tiled_mlp=True), tiny_config("bart"))


def _generic_recipe(tmp_path):
    """A causal LoRA recipe on a tiny GPT-NeoX saved locally with lorakit's tiny tokenizer."""
    from transformers import GPTNeoXForCausalLM

    path = tmp_path / "tiny-neox"
    build_tiny_tokenizer(path, "llama")
    torch.manual_seed(0)
    GPTNeoXForCausalLM(_unclaimed("gpt_neox")).save_pretrained(path)
    return tiny_recipe(
        tmp_path,
        tmp_path / "run",
        model={"name_or_path": str(path), "attention": "sdpa"},
        data={"format": "instruction", "max_length": 128},
        method={"r": 4, "alpha": 8, "dropout": 0.0},
    )


def test_an_unclaimed_architecture_builds_and_trains_a_packed_step_with_a_warning(tmp_path):
    from lorakit.model import build_model
    from lorakit.model.build import UnprovenFamilyWarning
    from lorakit.model.loss import token_loss_sum

    recipe = _generic_recipe(tmp_path)
    with pytest.warns(UnprovenFamilyWarning, match="no model family for 'gpt_neox'.*not proven"):
        built = build_model(recipe)
    assert built.packing and not built.is_encoder_decoder
    model = built.model.train()
    # One packed row of two examples, as the packed causal collator makes it.
    ids = torch.randint(4, TINY_VOCAB_SIZE, (1, 20))
    batch = {
        "input_ids": ids,
        "position_ids": torch.cat([torch.arange(12), torch.arange(8)])[None],
        "labels": ids.masked_fill(torch.rand(ids.shape) < 0.3, -100),
    }
    trainable = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    loss = token_loss_sum(built.inputs.logits(model, batch, "cpu"), batch["labels"])
    assert torch.isfinite(loss)
    loss.backward()
    torch.optim.SGD(trainable, lr=0.1).step()
    assert any(not torch.equal(a, p) for a, p in zip(before, trainable, strict=True))


def test_an_unclaimed_architecture_is_planned_with_the_not_proven_note(tmp_path):
    from lorakit.planner import plan

    result = plan(_generic_recipe(tmp_path), gpus=1, gpu_memory="16GB", device="cpu")
    assert any("no model family for 'gpt_neox'" in note for note in result.assumptions)
    assert result.total_params > 0


def test_model_class_is_none_where_transformers_maps_none():
    from transformers import PretrainedConfig

    config = PretrainedConfig()
    config.model_type = "mystery"
    auto_cls, cls = model_class(config)
    assert auto_cls.__name__ == "AutoModelForCausalLM" and cls is None
    assert model_class(tiny_config("t5"))[1].__name__ == "T5ForConditionalGeneration"


# --- ZeRO-3 leaf modules -----------------------------------------------------------------------------


def test_a_familys_zero3_leaf_modules_are_marked(tmp_path):
    from deepspeed.utils import z3_leaf_module

    from lorakit.model.build import _set_zero3_leaves

    llama = family_named("llama")
    assert llama.zero3_leaf_modules == ()
    config = tiny_config("llama")
    model = family_named("llama").tiny.model(config)
    _set_zero3_leaves(llama, model)  # dense: nothing marked
    assert not any(z3_leaf_module(m) for m in model.modules())
    moe_like = dataclasses.replace(llama, zero3_leaf_modules=("LlamaMLP",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _set_zero3_leaves(moe_like, model)
    marked = [m for m in model.modules() if z3_leaf_module(m)]
    assert len(marked) == config.num_hidden_layers and all(type(m).__name__ == "LlamaMLP" for m in marked)
