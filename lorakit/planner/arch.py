"""What the planner knows about a model: its shape (from the config) and an exact parameter census.

The census instantiates the model on the meta device (no memory, no weights read), so parameter counts,
the linear layers LoRA and 4-bit quantization act on, and the largest layer are exact for any architecture
transformers can build from the config. Configs come from the caller (the training job has one), from a
local directory's config.json, from lorakit's tiny models, or from a small built-in table of known hub
models, so planning never needs the network.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorakit.errors import RecipeError
from lorakit.model.families import family_of
from lorakit.model.families.base import Shape
from lorakit.model.families.multimodal import in_towers, left_alone, towers_of
from lorakit.model.families.unknown import loadable_class
from lorakit.planner.units import PlanError

# Configs of the hub models lorakit's recipes name, as published in their config.json files (only the keys
# that shape memory). Planning a gated or unreachable hub model needs no download.
_FLAN_T5 = {"model_type": "t5", "vocab_size": 32128, "d_kv": 64, "feed_forward_proj": "gated-gelu",
            "dropout_rate": 0.1, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
            "tie_word_embeddings": False, "n_positions": 512, "decoder_start_token_id": 0, "pad_token_id": 0,
            "eos_token_id": 1}  # fmt: skip
_LLAMA3 = {"model_type": "llama", "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
           "bos_token_id": 128000, "eos_token_id": 128001}  # fmt: skip
_LLAMA3_8B = {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8}  # fmt: skip
_LLAMA3_70B = {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
               "num_attention_heads": 64, "num_key_value_heads": 8}  # fmt: skip
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "google/flan-t5-xl": {
        **_FLAN_T5,
        "d_model": 2048,
        "d_ff": 5120,
        "num_heads": 32,
        "num_layers": 24,
        "num_decoder_layers": 24,
    },  # fmt: skip
    "google/flan-t5-xxl": {
        **_FLAN_T5,
        "d_model": 4096,
        "d_ff": 10240,
        "num_heads": 64,
        "num_layers": 24,
        "num_decoder_layers": 24,
    },  # fmt: skip
}
# Mixture-of-experts models (lorakit.model.families.moe).
KNOWN_CONFIGS["mistralai/Mixtral-8x7B-v0.1"] = KNOWN_CONFIGS["mistralai/Mixtral-8x7B-Instruct-v0.1"] = {
    "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rope_theta": 1e6, "router_aux_loss_coef": 0.02,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
KNOWN_CONFIGS["Qwen/Qwen3-30B-A3B"] = KNOWN_CONFIGS["Qwen/Qwen3-30B-A3B-Base"] = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "max_position_embeddings": 40960, "rope_theta": 1e6, "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645}  # fmt: skip
# T5Gemma 2B-2B: two Gemma-2-2B stacks (lorakit.model.families.t5gemma).
_GEMMA2_2B = {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096,
              "max_position_embeddings": 8192, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}  # fmt: skip
for _name in (
    "t5gemma-2b-2b-ul2",
    "t5gemma-2b-2b-prefixlm",
    "t5gemma-2b-2b-ul2-it",
    "t5gemma-2b-2b-prefixlm-it",
):
    KNOWN_CONFIGS[f"google/{_name}"] = {"model_type": "t5gemma", "encoder": _GEMMA2_2B, "decoder": _GEMMA2_2B,
                                        "vocab_size": 256000, "decoder_start_token_id": 2}  # fmt: skip
for _name in ("Meta-Llama-3-8B", "Meta-Llama-3-8B-Instruct"):
    KNOWN_CONFIGS[f"meta-llama/{_name}"] = {**_LLAMA3_8B, "max_position_embeddings": 8192}
for _name in ("Meta-Llama-3-70B", "Meta-Llama-3-70B-Instruct"):
    KNOWN_CONFIGS[f"meta-llama/{_name}"] = {**_LLAMA3_70B, "max_position_embeddings": 8192}
for _name in ("Llama-3.1-8B", "Llama-3.1-8B-Instruct", "Meta-Llama-3.1-8B", "Meta-Llama-3.1-8B-Instruct"):
    KNOWN_CONFIGS[f"meta-llama/{_name}"] = {**_LLAMA3_8B, "max_position_embeddings": 131072}
for _name in ("Llama-3.1-70B", "Llama-3.1-70B-Instruct", "Meta-Llama-3.1-70B", "Meta-Llama-3.1-70B-Instruct"):
    KNOWN_CONFIGS[f"meta-llama/{_name}"] = {**_LLAMA3_70B, "max_position_embeddings": 131072}
# Qwen3-8B (base and instruct share one config.json).
_QWEN3_8B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
             "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
             "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
             "bos_token_id": 151643, "eos_token_id": 151645}  # fmt: skip
for _name in ("Qwen3-8B", "Qwen3-8B-Base"):
    KNOWN_CONFIGS[f"Qwen/{_name}"] = _QWEN3_8B
# Gemma 3 12B: multimodal (Gemma3ForConditionalGeneration); the language model's sizes are in text_config,
# the rest at Gemma3TextConfig's defaults (vocabulary 262208, 128k positions, query_pre_attn_scalar 256).
_GEMMA3_12B = {"model_type": "gemma3", "mm_tokens_per_image": 256, "image_token_index": 262144,
               "text_config": {"model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360,
                               "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
                               "head_dim": 256, "sliding_window": 1024},
               "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896,
                                 "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27,
                                 "patch_size": 14, "vision_use_head": False}}  # fmt: skip
for _name in ("gemma-3-12b-it", "gemma-3-12b-pt"):
    KNOWN_CONFIGS[f"google/{_name}"] = _GEMMA3_12B


@dataclass(frozen=True)
class Linear:
    """One nn.Linear of the model: its dotted name and shape."""

    name: str
    in_features: int
    out_features: int
    bias: bool

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)


@dataclass(frozen=True, kw_only=True)
class Arch(Shape):
    """A model's shape (what activations depend on: the Shape its model family reads from the config,
    lorakit.model.families) and its parameter census (what model states depend on)."""

    model_type: str
    is_encoder_decoder: bool
    total_params: int
    # DeepSpeed's "largest layer": the most parameters held directly by one module (ZeRO-3 gathers one
    # module's weights, and its gradients, at a time).
    largest_module_params: int
    linears: tuple[Linear, ...]
    head: str
    # Whether the output head shares the input embedding: the family's word, else the built model's.
    tied_head: bool
    keep_fp32: tuple[str, ...]
    # Every parameter's element count (ZeRO-3 keeps the small ones whole on every rank).
    param_numels: tuple[int, ...]
    # (name, parameters held directly) of every module that holds some: what method.modules_to_save copies.
    param_modules: tuple[tuple[str, int], ...] = ()
    # (name, shape) of an MoE family's fused expert and router parameters (LoRA through peft's parameter
    # targeting, lorakit.planner.moe).
    fused_params: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # The model family whose reading of the config this is, and what nothing has proven for it (the
    # generic family's contracts, lorakit.model.families.Family.unproven; empty for registered families).
    family: str = ""
    unproven: tuple[str, ...] = ()
    # The blocks FSDP2 shards one by one (modules of the model's _no_split_modules classes, as
    # lorakit.backends.fsdp_shard wraps them), and the bytes per weight the checkpoint stores (its config's
    # dtype; unstated: float32, transformers' default).
    blocks: tuple[str, ...] = ()
    stored_dtype_bytes: int = 4
    # A multimodal checkpoint's modules besides the language model (Gemma 3's vision_tower and
    # multi_modal_projector), which a text adapter leaves out unless target_modules names them
    # (lorakit.model.families.multimodal); () for text-only models.
    towers: tuple[str, ...] = ()

    def caveat(self) -> str | None:
        """The generic family's "not proven" sentence for this model (None for a registered family)."""
        from lorakit.model.families import family_for_type

        return family_for_type(self.model_type, self.is_encoder_decoder).caveat() if self.unproven else None

    @property
    def attention_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def lora_targets(self, target_modules) -> list[Linear]:
        """The linear layers peft gives a LoRA adapter: `all-linear` is every linear layer but the output
        head; a list matches module names equal to an entry or ending in "." + entry (peft's rule). Neither
        reaches into a multimodal checkpoint's towers that the list does not name (peft's exclude_modules,
        as lorakit.model.adapter sets it)."""
        skip = left_alone(self.towers, target_modules)
        out = []
        for lin in self.linears:
            if in_towers(lin.name, skip):
                continue
            if target_modules == "all-linear":
                if lin.name != self.head:
                    out.append(lin)
            elif any(lin.name == t or lin.name.endswith("." + t) for t in target_modules):
                out.append(lin)
        return out

    def ia3_targets(self, target_modules, feedforward_modules) -> list[tuple[Linear, bool]]:
        """(linear, feedforward?) of each layer peft's IA3 scales: `all-linear` means peft's IA3 defaults for
        the model type (targets and feedforward modules), a list names targets as for LoRA."""
        if target_modules == "all-linear":
            from peft.utils import (
                TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING as FEEDFORWARD,
            )
            from peft.utils import (
                TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING as TARGETS,
            )

            target_modules = TARGETS.get(self.model_type, [])
            feedforward_modules = FEEDFORWARD.get(self.model_type, [])
        ff = set(feedforward_modules or ())
        return [(lin, lin.name.rsplit(".", 1)[-1] in ff) for lin in self.lora_targets(target_modules)]

    def module_copy_params(self, names) -> list[int]:
        """Parameters of each module peft's modules_to_save copies (names matched as peft matches them:
        equal, or ending in "." + name), counting everything below it."""
        matched = [m for m, _ in self.param_modules if any(m == t or m.endswith("." + t) for t in names)]
        return [sum(n for m2, n in self.param_modules if m2 == m or m2.startswith(m + ".")) for m in matched]

    def quantized_linears(self) -> list[Linear]:
        """The linear layers bitsandbytes turns into 4-bit weights: all but the output head and the model's
        _keep_in_fp32_modules (T5's `wo`), which transformers leaves in the compute dtype."""
        return [
            lin
            for lin in self.linears
            if lin.name != self.head and not set(lin.name.split(".")) & set(self.keep_fp32)
        ]


def _build_config(raw: dict[str, Any]):
    from transformers import AutoConfig

    raw = dict(raw)
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def known_config(name: str):
    """The transformers config of a model in the built-in table, or None."""
    raw = KNOWN_CONFIGS.get(name)
    return _build_config(raw) if raw is not None else None


def resolve_config(recipe, config=None):
    """The recipe's model config without loading weights: `config` as given, a tiny model through
    lorakit.model.load_config, a local directory's config.json, or the built-in table."""
    if config is not None:
        return config
    name = recipe.model.name_or_path
    if name.startswith("tiny:"):
        from lorakit.model import load_config

        return load_config(recipe)[1]
    local = Path(name).expanduser()
    if local.is_dir():
        path = local / "config.json"
        if not path.is_file():
            raise PlanError(f"model.name_or_path {name!r}: no config.json in that directory")
        try:
            return _build_config(json.loads(path.read_text()))
        except (ValueError, KeyError) as e:
            from lorakit.model.families.unknown import unknown_config_type

            unknown = unknown_config_type(e)
            raise PlanError(
                str(unknown) if unknown else f"model.name_or_path {name!r}: cannot read {path}: {e}"
            ) from e
    cfg = known_config(name)
    if cfg is None:
        known = ", ".join(sorted(KNOWN_CONFIGS))
        raise PlanError(
            f"model.name_or_path {name!r}: the planner reads configs offline and does not know this model; "
            f"point model.name_or_path at a local directory holding its config.json (hf "
            f"download {name} config.json --local-dir DIR), or use a known one: {known}"
        )
    return cfg


def arch_from_config(config, trust_remote_code: bool = False) -> Arch:
    """The Arch of a transformers config (parameter census on the meta device, cached per config)."""
    return _arch(config.to_json_string(use_diff=False), type(config), trust_remote_code)


@functools.lru_cache(maxsize=32)
def _arch(config_json: str, config_cls, trust_remote_code: bool) -> Arch:
    import torch

    config = config_cls.from_dict(json.loads(config_json))
    is_enc_dec = bool(getattr(config, "is_encoder_decoder", False))
    try:
        auto_cls, model_cls = loadable_class(config, trust_remote_code)
    except RecipeError as e:
        raise PlanError(str(e)) from e
    try:
        with torch.device("meta"):
            # The class itself, not from_config: inside a ZeRO-3 run (the training job plans at its end)
            # from_config would build under deepspeed.zero.Init, partitioning and communicating.
            model = (
                model_cls(config)
                if model_cls is not None
                else auto_cls.from_config(config, trust_remote_code=trust_remote_code)
            )
    except (ValueError, KeyError) as e:
        raise PlanError(f"the planner cannot build a {config.model_type!r} model from its config: {e}") from e
    head_module = model.get_output_embeddings()
    head = next(n for n, m in model.named_modules() if m is head_module)
    linears = tuple(
        Linear(name, m.in_features, m.out_features, m.bias is not None)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    )
    family = family_of(config)
    try:
        shape = family.shape(config, [lin.name for lin in linears])
    except RecipeError as e:
        raise PlanError(str(e)) from e
    tied = head_module.weight is model.get_input_embeddings().weight
    if shape.tied_head is not None:
        tied = shape.tied_head
    numels = [p.numel() for p in model.parameters()]
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    if not tied and head_module.weight is model.get_input_embeddings().weight:
        numels.append(head_module.weight.numel())
    fields = {k: v for k, v in vars(shape).items() if k != "tied_head"}
    block_types = set(getattr(model, "_no_split_modules", None) or ())
    return Arch(
        model_type=config.model_type,
        is_encoder_decoder=is_enc_dec,
        total_params=sum(numels),
        largest_module_params=largest,
        linears=linears,
        head=head,
        tied_head=tied,
        **fields,
        family=family.name,
        unproven=family.unproven,
        keep_fp32=tuple(sorted(getattr(model, "_keep_in_fp32_modules", None) or ())),
        param_numels=tuple(numels),
        param_modules=tuple(
            (name, n)
            for name, m in model.named_modules()
            if (n := sum(p.numel() for p in m.parameters(recurse=False)))
        ),
        fused_params=_fused_params(family, model),
        blocks=tuple(n for n, m in model.named_modules() if type(m).__name__ in block_types),
        stored_dtype_bytes=2 if str(getattr(config, "dtype", None)).endswith(("bfloat16", "float16")) else 4,
        towers=towers_of(config),
    )


def _fused_params(family, model) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of the parameters an MoE family's adapter can target by name (none for dense ones)."""
    if family.moe is None:
        return ()
    names = (*family.moe.experts, family.moe.router)
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters() if n.endswith(names))
