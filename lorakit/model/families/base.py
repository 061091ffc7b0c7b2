"""The model-family type: what lorakit knows about one architecture, in one record.

A `Family` says how to recognise its models (transformers' `config.model_type`), what the planner reads from
their config (`Shape`), on which attention backends and with which fused kernels packed rows stay exact
(`PackedAttention`), whether the tiled loss and the tiled MLP apply (and to which modules), which modules
ZeRO-3 must treat as leaves, and how to build a tiny random model of it for tests, the doctor and the
quickstart (`Tiny`). The registry (lorakit.model.families.registry) maps model types to families; an
architecture no family claims gets the generic family (lorakit.model.families.generic), which says which of
these contracts nothing has proven for it (`Family.unproven`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# The contracts a family proves by its tests; the generic family lists the ones it cannot claim.
PACKED_ISOLATION = "packed attention isolation"
TILED_LOSS = "tiled loss"
TILED_MLP = "tiled MLP"
PLANNER_SHAPES = "planner shape accuracy"

# The fused kernels of lorakit.model.fused_attention, by the names it gives them (a test keeps them equal):
# per packed call kind, a family lists the ones its packed rows may take; the loop (per-example SDPA) is
# always allowed.
VARLEN, FLEX, LOOP = "varlen", "flex", "loop"
# The attn_implementation values lorakit chooses from (lorakit.model.attention.choose_attention).
ALL_BACKENDS = frozenset({"flash_attention_2", "sdpa", "eager"})
# The tiny models' longest sequence (their tokenizer's model_max_length, T5's n_positions).
TINY_MAX_LENGTH = 512


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP's shape: how many experts, how many each token is routed to, one expert's
    intermediate size, and the always-on shared experts' intermediate size (0: none)."""

    count: int
    active: int
    ffn: int
    shared_ffn: int = 0


@dataclass(frozen=True)
class MoeLayout:
    """Where a mixture-of-experts family keeps its experts and router (lorakit.model.families.moe):
    `experts`, the fused expert parameters (peft's target_parameters suffixes); `router`, the router's
    weight (a target_parameters suffix, adapted only with method.train_router); `router_classes`, the
    router modules' class names, whose first output is the router logits (the load-balancing loss)."""

    experts: tuple[str, ...]
    router: str
    router_classes: tuple[str, ...]


@dataclass(frozen=True)
class Shape:
    """What the planner reads from a model's config (lorakit.planner.arch.Arch takes these fields).

    Encoder-decoders: `layers` counts encoder blocks and `decoder_layers` decoder blocks; causal LMs have
    decoder_layers == 0. `tied_head`: whether the output head shares the input embedding, None when the
    built model says it (the planner's census); `experts`: None for a dense MLP."""

    vocab: int
    hidden: int
    ffn: int
    gated_mlp: bool
    layers: int
    decoder_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_length: int | None
    # Dropout on hidden states and attention probabilities while training (T5: dropout_rate).
    dropout: float
    attention_dropout: float
    # T5's gelu_new is written in Python (tanh approximation): it keeps four activations, not one.
    python_gelu: bool
    tied_head: bool | None = None
    experts: Experts | None = None


@dataclass(frozen=True)
class PackedAttention:
    """Where a family's packed rows stay exact: the attention backends (attn_implementation) on which
    lorakit packs them, and per packed attention call kind (lorakit.model.fused_attention.KINDS: causal,
    encoder, decoder, cross) the fused kernels it may take besides the loop."""

    backends: frozenset[str] = frozenset()
    kernels: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))

    def kernels_for(self, kind: str) -> tuple[str, ...]:
        """The kernels a packed call of `kind` may take: the fused ones the family allows, then the loop."""
        return (*self.kernels.get(kind, ()), LOOP)


def packed(backends, **kernels: tuple[str, ...]) -> PackedAttention:
    """A PackedAttention with a read-only kernel table."""
    return PackedAttention(frozenset(backends), MappingProxyType(dict(kernels)))


@dataclass(frozen=True)
class Tiny:
    """How a family's tiny random model is built (lorakit.model.families.tiny drives it).

    tokenizer: "t5" (appends </s>, as T5's) or "causal" (prepends <s>, no </s>, a chat template).
    config(vocab_size, bos, **shape): the tiny config; `shape` replaces some of its sizes (reshapable only).
    model(config): a random model of that config, drawn from the caller's (seeded) random stream."""

    tokenizer: str
    config: Callable[..., Any]
    model: Callable[[Any], Any]
    reshapable: bool = False


@dataclass(frozen=True)
class Family:
    """One architecture family (module docstring).

    tiled_mlp: for a decoder layer's `mlp` module, whether lorakit.model.tiled_mlp may tile it (None: the
    family's MLPs are never tiled). zero3_leaf_modules: class names of the modules ZeRO-3 gathers whole
    (deepspeed.utils.set_z3_leaf_modules), as MoE blocks need; none for dense families. unproven: the
    contracts nothing has proven for this family (the generic family's; empty for registered ones)."""

    name: str
    model_types: tuple[str, ...]
    encoder_decoder: bool
    shape: Callable[[Any, Sequence[str]], Shape]
    packed: PackedAttention
    tiled_loss: bool
    tiled_mlp: Callable[[Any], bool] | None
    zero3_leaf_modules: tuple[str, ...] = ()
    tiny: Tiny | None = None
    # Mixture-of-experts families: their experts and router (None: a dense MLP).
    moe: MoeLayout | None = None
    unproven: tuple[str, ...] = ()
    # Encoder-decoders: where the checkpoint's config keeps the token its decoder starts on, as attribute
    # paths tried in order (lorakit.model.families.start reads them); unused for causal LMs.
    decoder_start: tuple[str, ...] = ("decoder_start_token_id",)
    # Multimodal checkpoints: the top-level modules besides the language model (Gemma 3's vision_tower and
    # multi_modal_projector), which text fine-tuning leaves alone (lorakit.model.families.multimodal).
    towers: tuple[str, ...] = ()

    def packs(self, attention: str) -> bool:
        """Whether packed rows of this family are exact on the `attention` backend."""
        return attention in self.packed.backends

    def tiles_loss(self, config) -> bool:
        """Whether the tiled loss is exact for a model of `config`: the family's logits are the head's
        output, and the config caps no logits after the head (Gemma 2's final_logit_softcapping)."""
        return self.tiled_loss and not getattr(text_config(config), "final_logit_softcapping", None)

    def caveat(self) -> str | None:
        """What nothing has proven for this family, in a sentence (None: everything is proven)."""
        if not self.unproven:
            return None
        types = ", ".join(repr(t) for t in self.model_types) or "this model"
        return (
            f"lorakit has no model family for {types}: it goes through the generic path, which reads the "
            f"common config attributes; not proven for it: {'; '.join(self.unproven)}"
        )


def dense_decoder_mlp(mlp) -> bool:
    """A gated dense decoder MLP (Llama, Mistral, Qwen2 and most causal LMs): a down_proj, no experts to
    route to. Token-wise, so tiles of the sequence give the same output."""
    return hasattr(mlp, "down_proj") and not hasattr(mlp, "experts")


_REQUIRED = object()


def text_config(config):
    """The config of the language model inside `config`: a multimodal checkpoint's text_config (Gemma 3's
    Gemma3Config holds its sizes there), else `config` itself (transformers' get_text_config). An
    encoder-decoder is its own text config: transformers would hand back only T5Gemma's decoder stack, whose
    masks and windows are not the encoder's."""
    get = getattr(config, "get_text_config", None)
    if getattr(config, "is_encoder_decoder", False) or not callable(get):
        return config
    return get(decoder=True)


def read(config, *names: str, default: Any = _REQUIRED) -> Any:
    """The first of `names` that `config` sets (not None), else `default`; with no default, a RecipeError
    naming the model type and the attributes looked for, not an AttributeError."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if default is _REQUIRED:
        from lorakit.errors import RecipeError

        raise RecipeError(
            f"model.name_or_path: the {getattr(config, 'model_type', None)!r} config sets none of "
            f"{', '.join(names)}; lorakit cannot read this architecture's sizes from it"
        )
    return default


def max_length(config) -> int | None:
    """The longest sequence the model's config allows (lorakit.data.tokenize's reading)."""
    from lorakit.data.tokenize import model_max_length

    return model_max_length(None, config)
