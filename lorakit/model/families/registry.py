"""The registered model families and the lookups every caller uses: by config, by model type, by name.

Adding a family: one module beside this one that defines its FAMILY, and its line in FAMILIES."""

from __future__ import annotations

from types import MappingProxyType

from lorakit.errors import RecipeError
from lorakit.model.families import (
    bart,
    gemma,
    llama,
    mistral,
    mixtral,
    olmo2,
    olmoe,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
    t5,
    t5gemma,
)
from lorakit.model.families.base import Family
from lorakit.model.families.generic import HEAD_ONLY_LOGITS, generic_family

# In this order: the tiny kinds are listed in it (tiny:t5 first, as the quickstart uses).
FAMILIES: tuple[Family, ...] = (t5.FAMILY, llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, bart.FAMILY)
FAMILIES += (qwen3.FAMILY, gemma.GEMMA2, gemma.GEMMA3, phi3.FAMILY, olmo2.FAMILY)
FAMILIES += (mixtral.FAMILY, qwen3_moe.FAMILY, olmoe.FAMILY, t5gemma.FAMILY)

_BY_NAME = MappingProxyType({f.name: f for f in FAMILIES})
_BY_TYPE = MappingProxyType({t: f for f in FAMILIES for t in f.model_types})


def family_of(config) -> Family:
    """The family of a transformers config: the registered one claiming its model_type, else the generic
    family (which names what is not proven for it)."""
    model_type = getattr(config, "model_type", None)
    return family_for_type(model_type, bool(getattr(config, "is_encoder_decoder", False)))


def family_for_type(model_type: str | None, encoder_decoder: bool = False) -> Family:
    """The family claiming `model_type`; else the generic family of a causal LM (or, with
    `encoder_decoder`, of an encoder-decoder)."""
    found = _BY_TYPE.get(model_type) if model_type else None
    return found if found is not None else generic_family(model_type, encoder_decoder)


def family_named(name: str, field: str = "kind") -> Family:
    """The registered family called `name`; a RecipeError naming `field` and the known names otherwise."""
    if name not in _BY_NAME:
        raise RecipeError(f"{field}: unknown model family {name!r}; known: {', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def tiny_kinds() -> tuple[str, ...]:
    """The names of the families with a tiny builder (`tiny:NAME` in a recipe), in registry order."""
    return tuple(f.name for f in FAMILIES if f.tiny is not None)


def tiled_loss_types() -> tuple[str, ...]:
    """Every model type the tiled loss is exact for (registered families', and HEAD_ONLY_LOGITS), sorted."""
    claimed = {t for f in FAMILIES if f.tiled_loss for t in f.model_types}
    return tuple(sorted(claimed | HEAD_ONLY_LOGITS))


def model_class(config):
    """(auto class, model class) that loads `config`: AutoModelForSeq2SeqLM for encoder-decoders, else
    AutoModelForCausalLM, and the class it maps the config to; the model class is None when transformers
    maps none (a remote-code model), never a KeyError."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    enc_dec = bool(getattr(config, "is_encoder_decoder", False))
    auto_cls = AutoModelForSeq2SeqLM if enc_dec else AutoModelForCausalLM
    return auto_cls, auto_cls._model_mapping.get(type(config), None)
