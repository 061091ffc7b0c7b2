"""Load the base model (dtype, attention backend, the backend's load plan), attach the adapter (LoRA, IA3:
model/adapter.py), checkpointing."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from lorakit.errors import RecipeError
from lorakit.model.adapter import apply_linear_dropout, peft_config
from lorakit.model.attention import choose_attention, packing_enabled, set_attention_dropout
from lorakit.model.checkpointing import Checkpointing, enable_checkpointing, from_recipe
from lorakit.model.cpu_products import use_fp32_products
from lorakit.model.families import Family, family_of
from lorakit.model.families.moe import check_method
from lorakit.model.families.start import start_generation_on_it
from lorakit.model.families.unknown import loadable_class
from lorakit.model.grouped_experts import use_grouped_experts
from lorakit.model.inputs import ModelInputs
from lorakit.model.load_plan import WHOLE, LoadPlan
from lorakit.model.quantize import bnb_config, check_keep_in_fp32, keep_standard_4bit_layout, logical_numel
from lorakit.model.sequence_parallel import register_sequence_parallel

# load_config and load_tokenizer live in source.py, which the launcher imports without this module's peft.
from lorakit.model.source import _pickle_refused, load_config, load_tokenizer
from lorakit.recipe.schema import Recipe


@dataclass
class BuiltModel:
    """The trainable model and what was decided while building it."""

    model: torch.nn.Module
    tokenizer: Any
    source: str
    attention: str
    is_encoder_decoder: bool
    # Turns batches into forward kwargs (per-example attention for packed rows) for this model's backend.
    inputs: ModelInputs
    # Whether training batches are packed (data.packing resolved for this model and backend).
    packing: bool = False
    # transformers tracks HfDeepSpeedConfig through a weak reference: it must outlive training, since
    # peft and generate ask "is ZeRO-3 on?" long after from_pretrained returns.
    hf_ds_config: Any = None
    # method.init pissa / olora: the adapter as initialised (whole, on CPU), which save.py subtracts to
    # save an adapter for the original base (the init rewrote the base weights in place).
    initial_adapter: dict[str, torch.Tensor] | None = None
    # LoRA on fused MoE experts: the run's line on the experts' path (lorakit.model.grouped_experts).
    experts: str | None = None
    # model.compile: what lorakit.model.compile.compile_blocks compiled ({blocks, classes, backend}); None
    # when the blocks run eager.
    compiled: dict[str, Any] | None = None
    # model.gradient_checkpointing as resolved for this run (lorakit.model.checkpointing).
    checkpointing: Checkpointing | None = None
    # bf16 linear layers multiplying in fp32 on a CPU without a fast bf16 kernel (lorakit.model.cpu_products).
    fp32_products: bool = False


def no_safetensors_weights(error: OSError) -> bool:
    """Whether from_pretrained(use_safetensors=True) failed for want of safetensors weights (then pickles
    may be all there is), not because a file of a safetensors checkpoint is missing or unreadable (a lost
    shard is that file's problem, never a reason to suggest model.allow_pickle)."""
    text = str(error)
    missing_file = "No such file or directory" in text or re.search(r"-\d{5}-of-\d{5}\.safetensors", text)
    return "safetensors" in text and not missing_file


def build_model(
    recipe: Recipe,
    load: LoadPlan = WHOLE,
    sp_group: Any = None,
    checkpointing: Checkpointing | None = None,
    device_type: str | None = None,
) -> BuiltModel:
    """Load the base in the recipe's dtype and attention backend, then apply the method.

    `load` is the backend's plan (Backend.load_plan): partitioned (ZeRO-3: HfDeepSpeedConfig is alive during
    from_pretrained, so each rank materialises only its shard of the base; an 11B model never sits whole on
    one rank), meta (the structure only; the backend reads each rank's shards once sharded) or whole. With
    distributed.sequence_parallel > 1, `sp_group` is this rank's sequence-parallel group (engine/mesh.py).
    `checkpointing`: the run's gradient checkpointing (the planner's choice); None: the recipe's own.
    `device_type`: where the model will compute (`cpu`, `cuda`); None: a GPU if one is present.
    """
    source, config = load_config(recipe)
    is_enc_dec = bool(getattr(config, "is_encoder_decoder", False))
    auto_cls, model_cls = loadable_class(config, recipe.model.trust_remote_code)
    family = family_of(config)
    check_method(family, recipe.method)
    if family.caveat():
        warnings.warn(family.caveat(), UnprovenFamilyWarning, stacklevel=2)
    attention = choose_attention(recipe.model.attention, model_cls)
    packing = packing_enabled(recipe.data.packing, attention, is_enc_dec, config.model_type)
    if attention == "sdpa" and packing:
        # Packed rows: SDPA per example (cost sum of L_i^2) instead of SDPA over the row with a T x T mask.
        from lorakit.model.varlen import register_varlen_sdpa

        attention = register_varlen_sdpa()
    sp = recipe.distributed.sequence_parallel
    if sp > 1:
        if not packing:
            raise RecipeError("distributed.sequence_parallel > 1 splits packed rows: set data.packing: auto")
        # Split rows attend through the all-to-all wrapper around lorakit's per-example kernel (on CUDA the
        # same fused varlen flash kernel flash_attention_2 would use).
        attention = register_sequence_parallel()
    dtype = getattr(torch, recipe.model.dtype)
    check_keep_in_fp32(model_cls, dtype)
    quant_type = recipe.method.quantization()
    # QLoRA: transformers quantizes the linear layers as it loads them. Under ZeRO-3 it then loads the
    # (4-bit) base whole on each rank, without zero.Init; deepspeed.initialize partitions it afterwards.
    quantization = bnb_config(quant_type, dtype) if quant_type else None

    hf_ds_config = None
    if load.kind == "partitioned":
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(load.zero_config)
    # Seeded before loading so the LoRA init (and any freshly initialised weights) is reproducible.
    torch.manual_seed(recipe.train.seed)
    try:
        model = auto_cls.from_pretrained(
            source,
            revision=recipe.model.revision,
            trust_remote_code=recipe.model.trust_remote_code,
            # True: only safetensors; None: transformers' default, safetensors else pytorch_model.bin.
            use_safetensors=None if recipe.model.allow_pickle else True,
            dtype=dtype,
            attn_implementation=attention,
            quantization_config=quantization,
            # The structure only (FSDP2's sharded loading, backends/fsdp_load.py): each rank reads its shards.
            **({"device_map": "meta"} if load.kind == "meta" else {}),
            **_moe_4bit_on_cpu(quantization, family),
        )
    except OSError as e:
        if recipe.model.allow_pickle or not no_safetensors_weights(e):
            raise
        raise _pickle_refused(recipe.model.name_or_path, f"no safetensors weights found ({e})") from e
    if quantization is not None:
        keep_standard_4bit_layout(model)
        if family.moe is not None:
            from lorakit.model.quant_experts import quantize_experts

            # bitsandbytes quantized the linear layers; the fused experts are 3-D parameters it leaves alone.
            quantize_experts(model, quant_type)
    if hf_ds_config is not None:
        from lorakit.model.untie import restore_untied_head

        restore_untied_head(model, source, recipe.model.revision, load.zero_config)
    _set_zero3_leaves(family, model)
    # The KV cache is for generation; in training it changes how packed/masked attention is built.
    model.config.use_cache = False
    # Evaluation's generate() starts the decoder where training's collators do (families/start.py).
    start_generation_on_it(model, config)
    set_attention_dropout(model, recipe.model.attention_dropout)
    # The run's checkpointing, chosen before the build (the planner's, for auto); the recipe's without it.
    checkpointing = checkpointing or from_recipe(recipe.model)
    if checkpointing.enabled:
        enable_checkpointing(model, checkpointing.every_n_blocks)
    experts = None
    if recipe.method.adapter():
        # peft freezes the base (4-bit weights included). No prepare_model_for_kbit_training for qlora:
        # see quantize.py for what it would do and why it is not needed here.
        from peft import get_peft_model

        with warnings.catch_warnings():
            # peft 0.21 (peft_model.py, PeftModel.__init__) reads transformers' deprecated
            # `is_gradient_checkpointing`, which warns on every rank.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            adapter_config = peft_config(recipe.method, is_enc_dec, family, model)
            model = get_peft_model(model, adapter_config)
        if getattr(adapter_config, "target_parameters", None):
            apply_linear_dropout(model, recipe.method)
            # The one place the experts' path is chosen: grouped, with the LoRA factored per group.
            experts = use_grouped_experts(model)
        if quantization is not None and family.moe is not None:
            from lorakit.model.quant_experts import experts_as_buffers

            experts_as_buffers(model)
        # peft may create LoRA weights in fp32; one dtype across the module is what DeepSpeed expects.
        for p in model.parameters():
            if p.requires_grad and p.dtype != dtype:
                p.data = p.data.to(dtype)
    _tile_mlps(recipe, config, model, family)
    loss_head = _tile_loss(recipe, config, model)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    fp32_products = use_fp32_products(model, dtype, device_type)
    initial = None
    if recipe.method.mutates_base():
        # Before deepspeed.initialize, so the adapter's weights are still whole on every rank.
        initial = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}
    compiled = _compile(
        recipe, model, quantized=quant_type is not None, partitioned=load.kind == "partitioned"
    )
    tokenizer = load_tokenizer(recipe, source)
    inputs = ModelInputs(config, attention, dtype, sp_group=sp_group, sp_world=sp, loss_head=loss_head)
    return BuiltModel(
        model,
        tokenizer,
        source,
        attention,
        is_enc_dec,
        inputs,
        packing,
        hf_ds_config,
        initial,
        experts,
        compiled,
        checkpointing,
        fp32_products,
    )


def _moe_4bit_on_cpu(quantization, family: Family) -> dict[str, Any]:
    """An MoE's 4-bit base loads in CPU RAM: transformers would load it onto the GPU (bitsandbytes' default
    device_map) with its fused experts in model.dtype (29B weights of Qwen3-30B-A3B) before lorakit quantizes
    them (model/quant_experts.py); the backend moves the 4-bit model to the GPU. Not measured on GPUs."""
    if quantization is None or family.moe is None or not torch.cuda.is_available():
        return {}  # without a GPU transformers loads on the CPU already
    from transformers.integrations import is_deepspeed_zero3_enabled

    # Under ZeRO-3 transformers refuses any device_map (and does not place the model itself).
    return {} if is_deepspeed_zero3_enabled() else {"device_map": {"": "cpu"}}


class UnprovenFamilyWarning(UserWarning):
    """The model's architecture has no lorakit model family: it trains through the generic path, and the
    warning names the contracts nothing has proven for it (lorakit.model.families.Family.caveat)."""


def _set_zero3_leaves(family: Family, model) -> None:
    """The family's ZeRO-3 leaf modules (MoE blocks: ZeRO-3 gathers each whole, since a token may route to
    any expert): set before deepspeed.initialize installs its hooks; dense families have none."""
    if family.zero3_leaf_modules:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, list(family.zero3_leaf_modules))


def _tile_mlps(recipe: Recipe, config, model, family: Family) -> None:
    """model.tiled_mlp: the decoder MLPs the family tiles, over tiles of the sequence
    (lorakit.model.tiled_mlp), wrapped after peft so that the tiles run its layers."""
    from lorakit.model.tiled_mlp import apply_tiled_mlp, tile_tokens

    tiles = tile_tokens(recipe, config)
    if (
        tiles is not None
        and not apply_tiled_mlp(model, tiles, family.tiled_mlp)
        and recipe.model.tiled_mlp is True
    ):
        raise RecipeError(
            f"model.tiled_mlp: true, but {config.model_type!r} has no dense decoder MLP (a `mlp` with a "
            "down_proj and no experts) to tile; set model.tiled_mlp: auto or false"
        )


def _tile_loss(recipe: Recipe, config, model):
    """model.tiled_loss: the output head and cross-entropy over tiles of the sequence
    (lorakit.model.tiled_loss), wrapped after peft; returns the wrapper, or None for the untiled loss."""
    from lorakit.model.tiled_loss import apply_tiled_loss, loss_tile_tokens

    tiles = loss_tile_tokens(recipe, config)
    if tiles is None:
        return None
    head = apply_tiled_loss(model, tiles)
    if head is None and recipe.model.tiled_loss is True:
        raise RecipeError(f"model.tiled_loss: true, but {config.model_type!r} has no output head to tile")
    return head


def _compile(recipe: Recipe, model, *, quantized: bool, partitioned: bool) -> dict[str, Any] | None:
    """model.compile: each block compiled regionally (lorakit.model.compile), after peft and the tiling
    wrappers so that the graphs hold the LoRA branches; None when the blocks stay eager. `partitioned`: the
    backend's load plan partitions the weights (ZeRO-3), whose gather hooks compile does not take."""
    from lorakit.model.compile import compile_blocks, compile_wanted

    if not compile_wanted(
        recipe.model.compile, cuda=torch.cuda.is_available(), quantized=quantized, zero3=partitioned
    ):
        return None
    return compile_blocks(model)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts, correct under ZeRO-3 partitioning (ds_numel) and for 4-bit
    weights (the weights they stand for, not their packed storage)."""
    trainable = total = 0
    for p in model.parameters():
        n = logical_numel(p)
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total
