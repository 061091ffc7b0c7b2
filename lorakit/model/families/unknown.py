"""Architectures nothing here knows: a config class that no lorakit family claims and that transformers' auto
mapping cannot build. Loading, planning and generating ask `loadable_class`, which gives the class to load,
or a RecipeError (exit 2) that names the config class and the two ways forward (the checkpoint's own code
through model.trust_remote_code, or a transformers that has the architecture), never a KeyError or
transformers' list of every class it knows."""

from __future__ import annotations

import re

from lorakit.errors import RecipeError
from lorakit.model.families.base import PACKED_ISOLATION, PLANNER_SHAPES, TILED_LOSS, TILED_MLP
from lorakit.model.families.registry import model_class

DOC = "docs/models.md#unknown-architectures"


def remote_code(config, auto_cls) -> bool:
    """Whether the checkpoint names its own modeling code for `auto_cls` (an `auto_map` in config.json)."""
    return auto_cls.__name__ in (getattr(config, "auto_map", None) or {})


def unknown_architecture(
    what: str, model_type: str | None, loader: str, *, remote: bool = False
) -> RecipeError:
    """The error for an architecture neither lorakit nor transformers can build: `what` is the config class
    (or "a config"), `loader` the transformers class that cannot load it."""
    import transformers

    contracts = ", ".join((PACKED_ISOLATION, TILED_LOSS, TILED_MLP, PLANNER_SHAPES))
    if remote:
        first = (
            "its checkpoint ships its own modeling code (auto_map in config.json): set "
            "model.trust_remote_code: true in the recipe if you trust that code (it runs with your permissions)"
        )
    else:
        first = (
            "if the checkpoint ships its own modeling code (an auto_map in config.json), set "
            "model.trust_remote_code: true in the recipe (that code runs with your permissions); otherwise use "
            f"a transformers release that knows model type {model_type!r} (this is {transformers.__version__})"
        )
    return RecipeError(
        f"model.name_or_path: {what} (model type {model_type!r}) is an architecture no lorakit model family "
        f"claims and transformers' {loader} cannot build. Way forward: {first}. It then trains on lorakit's "
        f"generic path, whose unproven contracts ({contracts}) the run and `python -m lorakit.doctor` name",
        doc=DOC,
    )


def loadable_class(config, trust_remote_code: bool = False):
    """(auto class, model class) that loads `config`, as model_class; the model class is None for a
    checkpoint's own code allowed by `trust_remote_code`. RecipeError (unknown_architecture) otherwise."""
    auto_cls, model_cls = model_class(config)
    if model_cls is not None:
        return auto_cls, model_cls
    remote = remote_code(config, auto_cls)
    if remote and trust_remote_code:
        return auto_cls, None
    raise unknown_architecture(
        type(config).__name__, getattr(config, "model_type", None), auto_cls.__name__, remote=remote
    )


# transformers' words for a model type it has no config class for (AutoConfig.from_pretrained, for_model).
_UNKNOWN_TYPE = (
    re.compile(r"has model type `([^`]+)` but Transformers does not recognize"),
    re.compile(r"Unrecognized model identifier: ([\w-]+)"),
)


def unknown_config_type(error: Exception) -> RecipeError | None:
    """unknown_architecture for AutoConfig's error on a model type transformers does not know (None for any
    other error: a missing file, no network)."""
    for pattern in _UNKNOWN_TYPE:
        found = pattern.search(str(error))
        if found:
            return unknown_architecture("its config", found[1], "AutoConfig")
    return None
