"""The recipe as a complete DeepSpeed config: precision, ZeRO stage, offload, clipping, batch sizes."""

from __future__ import annotations

from typing import Any

from lorakit.recipe.schema import Recipe


def _offload(device: str, nvme_path: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        out["nvme_path"] = nvme_path
    return out


def build_ds_config(
    recipe: Recipe, world_size: int, *, accelerator: str = "cuda", hidden_size: int | None = None
) -> dict[str, Any]:
    """DeepSpeed config for `recipe` on `world_size` processes.

    accelerator is DeepSpeed's accelerator name: on `cpu` the optimizer is torch's AdamW, since DeepSpeed's
    fused CUDA Adam cannot run there. hidden_size tunes ZeRO-3 bucket sizes the way the HF integration does.
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
        if hidden_size:
            zero.update(
                {
                    "reduce_bucket_size": hidden_size * hidden_size,
                    "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
                    "stage3_param_persistence_threshold": 10 * hidden_size,
                }
            )
    optimizer_params: dict[str, Any] = {
        "lr": t.lr,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": t.weight_decay,
    }
    if accelerator == "cpu" and d.offload_optimizer == "none":
        optimizer_params["torch_adam"] = True
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
        # The LR schedule is lorakit's (engine/schedule.py), passed to deepspeed.initialize.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
