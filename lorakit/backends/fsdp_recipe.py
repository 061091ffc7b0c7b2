"""What distributed.strategy fsdp (PyTorch FSDP2) refuses of a validated recipe, naming the alternative
(registered with the recipe's checks by lorakit.backends). Imports no torch: it runs whenever a recipe
validates."""

from __future__ import annotations

# DeepSpeed-only keys of the distributed section and, for each, what to use with FSDP2 instead.
_DEEPSPEED_ONLY = {
    "offload_optimizer": "distributed.fsdp.cpu_offload: true (parameters, gradients and optimizer state)",
    "offload_params": "distributed.fsdp.cpu_offload: true",
    "nvme_path": "distributed.fsdp.cpu_offload: true (FSDP2 offloads to CPU memory, not to a disk)",
    "hpz_partition_size": "distributed.fsdp.sharding: hybrid (shards within a node, replicates across nodes)",
    "quantized_weights": "strategy deepspeed (FSDP2 all-gathers parameters in their own dtype)",
    "quantized_gradients": "strategy deepspeed (FSDP2 reduce-scatters gradients in float32)",
}


def check_recipe(recipe) -> None:
    """ValueError for what FSDP2 cannot be combined with; `recipe`: the validated Recipe."""
    d = recipe.distributed
    # By value, not by whether it was given: a resolved recipe.yaml spells every default out.
    defaults = type(d).model_fields
    for key, instead in _DEEPSPEED_ONLY.items():
        if getattr(d, key) != defaults[key].default:
            raise ValueError(
                f"distributed.{key} is a DeepSpeed ZeRO option that strategy fsdp does not have; use {instead}"
            )
    if d.zero_stage != 3:
        raise ValueError(
            f"distributed.zero_stage {d.zero_stage} is a DeepSpeed setting: strategy fsdp always shards "
            "parameters, gradients and optimizer state (as ZeRO-3); remove zero_stage (or set 3), or use "
            "strategy deepspeed for ZeRO stage 0-2"
        )
    shard = d.fsdp.shard_size
    if shard is not None and d.num_processes > 1 and d.num_processes % shard:
        raise ValueError(
            f"distributed.fsdp.shard_size {shard} must divide the processes per node (distributed."
            f"num_processes {d.num_processes}): a shard group is meant to be one node's processes"
        )
