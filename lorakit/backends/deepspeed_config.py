"""The recipe as a complete DeepSpeed config: precision, ZeRO stage, offload, clipping, batch sizes."""

from __future__ import annotations

from typing import Any

from lorakit.errors import RecipeError
from lorakit.recipe.schema import Recipe

ZEROPP_DOC = "docs/multinode.md#zero"


def _offload(device: str, nvme_path: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        out["nvme_path"] = nvme_path
    return out


# About one transformer block's parameters in units of hidden^2: attention 4 h^2 (less with grouped KV heads,
# twice in a T5 decoder block), the MLP 8 h^2 (Llama-3-8B: 10.5 h^2, T5 v1.1 XL: 7.5 h^2).
BLOCK_PARAMS_PER_HIDDEN_SQUARED = 12


def zero3_limits(hidden_size: int) -> dict[str, int]:
    """ZeRO-3's buckets and live-parameter limits (in elements), sized from the model's hidden size.

    The first three are what the HF integration's "auto" writes. DeepSpeed's defaults for the other two
    (1e9 elements each) keep a gathered parameter whole until nothing within a billion parameters of the
    trace uses it again: every module used again in the backward stays gathered from its forward on, so a
    model under a billion parameters is held whole on every rank through each step (measured at FLAN-T5-XL
    width, 2+2 layers: the whole 0.67 GiB model on top of its 0.33 GiB partition), and a larger one the
    last billion (2 GB in bf16) of it. Here a parameter stays gathered only when it is used again within
    about one transformer block (a block recomputed by gradient checkpointing stays gathered for its
    backward), and no more than one block is prefetched or held at once: the gathered weights are at most
    the largest module, the prefetch bucket and one block (docs/planning.md). The cost is one more
    all-gather per parameter per step for models that fitted whole.
    """
    h2 = hidden_size * hidden_size
    block = BLOCK_PARAMS_PER_HIDDEN_SQUARED * h2
    return {
        "reduce_bucket_size": h2,
        "stage3_prefetch_bucket_size": int(0.9 * h2),
        "stage3_param_persistence_threshold": 10 * hidden_size,
        "stage3_max_reuse_distance": block,
        "stage3_max_live_parameters": block,
    }


def build_ds_config(
    recipe: Recipe, world_size: int, *, accelerator: str = "cuda", hidden_size: int | None = None
) -> dict[str, Any]:
    """DeepSpeed config for `recipe` on `world_size` processes.

    accelerator is DeepSpeed's accelerator name (`cpu`, `cuda`): without CPU offload the optimizer is torch's
    AdamW (foreach on CPU, fused on GPUs), so no DeepSpeed op is compiled at start. hidden_size tunes ZeRO-3 bucket sizes the way the HF integration does.
    """
    t, d = recipe.train, recipe.distributed
    zero: dict[str, Any] = {"stage": d.zero_stage}
    if d.zero_stage >= 1:
        # overlap_comm needs a separate CUDA stream; on CPU it only adds synchronisation.
        zero.update({"overlap_comm": accelerator != "cpu", "contiguous_gradients": True})
    if d.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(d.offload_optimizer, d.nvme_path)
    if d.offload_params != "none":
        zero["offload_param"] = _offload(d.offload_params, d.nvme_path)
    if d.zero_stage in (1, 2) and hidden_size:
        # DeepSpeed allocates the whole reduce bucket (default 5e8 elements: 1 GB in bf16, twice with
        # overlap_comm) however few parameters train; hidden^2 is what the HF integration's "auto" uses.
        zero["reduce_bucket_size"] = hidden_size * hidden_size
    if d.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        # ZeRO++ (docs/multinode.md#zero): written only when asked for, so other configs stay as they were.
        if d.hpz_partition_size > 1:
            zero["zero_hpz_partition_size"] = d.hpz_partition_size
        if d.quantized_weights:
            zero["zero_quantized_weights"] = True
        if d.quantized_gradients:
            zero["zero_quantized_gradients"] = True
        if hidden_size:
            zero.update(zero3_limits(hidden_size))
    optimizer_params: dict[str, Any] = {
        "lr": t.lr,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": t.weight_decay,
    }
    if d.offload_optimizer == "none":
        # torch's AdamW, never DeepSpeed's FusedAdam: that op is JIT-compiled at start (42 s on an H100, nvcc
        # and ninja needed) and DeepSpeed 0.19.8's builder fails on TORCH_CUDA_ARCH_LIST=9.0a ("invalid literal
        # for int() ... '0a'"), which stopped a run on the H100 lease of 2026-11-26. On CUDA torch's fused
        # kernel does the same update in one launch; on CPU foreach makes one op for all the (many, small)
        # LoRA tensors where torch's default loops over them. With CPU offload DeepSpeed's CPU Adam stays.
        fast = {"foreach": True} if accelerator == "cpu" else {"fused": True}
        optimizer_params.update(torch_adam=True, **fast)
    dtype = recipe.model.dtype
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "train_batch_size": t.micro_batch_size * t.gradient_accumulation_steps * world_size,
        "gradient_clipping": t.max_grad_norm,
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16", "loss_scale": 0, "initial_scale_power": 16},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": optimizer_params},
        # The LR schedule is lorakit's (lorakit.engine.schedule), passed to deepspeed.initialize.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def check_recipe(recipe: Recipe) -> None:
    """ValueError for what DeepSpeed cannot train of a validated recipe (registered with the recipe's checks by
    lorakit.backends, run when a recipe with distributed.strategy deepspeed validates)."""
    d = recipe.distributed
    # At stage 0 in bf16 lorakit's own optimizer leaves the update out (backends/deepspeed_bf16.py); in fp32
    # and fp16 DeepSpeed's stage 0 applies it before lorakit sees the gradient norm.
    if recipe.train.on_nonfinite == "skip" and d.zero_stage == 0 and recipe.model.dtype != "bfloat16":
        raise ValueError(
            "train.on_nonfinite: skip needs distributed.zero_stage 1, 2 or 3, or model.dtype bfloat16: "
            "those optimizers leave out an update whose gradients are not finite, while stage 0 in "
            "float32 or float16 applies it before lorakit sees the gradient norm; use a ZeRO stage, "
            "bfloat16 or on_nonfinite: error"
        )
    q = recipe.method  # FSDP2 gathers the 4-bit weight DoRA reads: only ZeRO-3 fails
    if q.kind == "qlora" and q.use_dora and d.zero_stage == 3:
        # Tried (2 processes, tiny Llama and T5): peft's DoRA layer hands DeepSpeed a 4-bit weight that
        # ZeRO-3 never partitioned ("'Params4bit' object has no attribute 'ds_status'" in the first
        # forward), with or without checkpointing; ZeRO-2 trains it.
        raise ValueError(
            "method.use_dora: DoRA on a 4-bit base (kind qlora) fails under ZeRO-3 (peft's DoRA layer reaches "
            "a 4-bit weight DeepSpeed did not partition); use distributed.zero_stage 2, or kind lora"
        )


def check_zero_plus_plus(
    recipe: Recipe, world_size: int, per_node: int | None, accelerator: str | None
) -> None:
    """Refuse, before any work, the ZeRO++ settings this group or accelerator cannot run (RecipeError).

    The schema cannot know the group: under a launcher the processes per node (`per_node`, None when the
    launcher does not say) and the world size are the launcher's. hpZ groups consecutive ranks, which
    launchers place node by node, so its groups stay inside a node only when hpz_partition_size divides the
    processes per node; DeepSpeed itself only asserts that it divides the world size. qwZ and qgZ load
    DeepSpeed's CUDA quantizer kernels, which its CPU accelerator does not have ("This op had not been
    implemented on CPU backend", raised while loading the model for qwZ, at the first backward for qgZ).
    `accelerator` None: not asked (no qwZ or qgZ in the recipe).
    """
    d = recipe.distributed
    hpz = d.hpz_partition_size
    if hpz > 1:
        where = f"{per_node} per node, {world_size} in all" if per_node else f"{world_size} in all"
        if world_size % hpz or (per_node and per_node % hpz):
            fit = per_node or world_size
            raise RecipeError(
                f"distributed.hpz_partition_size {hpz} must divide the processes per node ({where}): hpZ "
                f"keeps each secondary parameter partition within a group of that many consecutive ranks, "
                f"meant to be one node; set it to {fit} (the GPUs per node) or a divisor of it",
                doc=ZEROPP_DOC,
            )
    quantized = [k for k in ("quantized_weights", "quantized_gradients") if getattr(d, k)]
    if quantized and accelerator == "cpu":
        raise RecipeError(
            f"distributed.{quantized[0]} (ZeRO++ {'qwZ' if quantized[0] == 'quantized_weights' else 'qgZ'}) "
            "needs GPUs: it runs DeepSpeed's CUDA quantizer kernels, which its CPU accelerator does not "
            f"have; set distributed.{quantized[0]}: false on CPU",
            doc=ZEROPP_DOC,
        )
