"""Model families as a type: one module per architecture family (T5, BART, Llama, Mistral, Qwen2, Qwen3,
Gemma 2 and 3, Phi-3, OLMo 2; docs/models.md), each a `Family` (lorakit.model.families.base) holding what
the rest of lorakit asks about an architecture, and a registry (lorakit.model.families.registry) that finds
a config's family, or the generic one. Importing it loads neither torch nor transformers: the families name
their classes and import them when they build."""

from lorakit.model.families.base import Experts, Family, PackedAttention, Shape, Tiny
from lorakit.model.families.registry import (
    FAMILIES,
    family_for_type,
    family_named,
    family_of,
    model_class,
    tiled_loss_types,
    tiny_kinds,
)

__all__ = [
    "FAMILIES",
    "Experts",
    "Family",
    "PackedAttention",
    "Shape",
    "Tiny",
    "family_for_type",
    "family_named",
    "family_of",
    "model_class",
    "tiled_loss_types",
    "tiny_kinds",
]
