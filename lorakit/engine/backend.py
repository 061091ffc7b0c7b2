"""The sharding backend (distributed.strategy): DeepSpeed ZeRO or PyTorch FSDP2, behind one interface, so
the job and the loop never branch on it.

A `Backend` checks the process group, gives the config build_model loads under (DeepSpeed's, for ZeRO-3's
partitioned loading; None for FSDP2, which shards after loading) and the file the run directory keeps it
in, and wraps the built model into an `Engine`. The Engine is the surface of a DeepSpeed engine that
lorakit uses, which lorakit.engine.fsdp.FsdpEngine answers too:

    module, device, train(), eval(), __call__ (forward), set_gradient_accumulation_boundary(bool),
    backward(loss, scale_wrt_gas=False), step(), get_global_grad_norm(), was_step_applied(), get_lr(),
    optimizer.param_groups, save_checkpoint(dir, tag, ...), load_checkpoint(dir, tag, ...), destroy()
"""

from __future__ import annotations

from typing import Any

from lorakit import rundir
from lorakit.engine import dist


def accelerator_name() -> str:
    """DeepSpeed's accelerator for this machine: `cuda`, or `cpu` where there is no GPU."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def device_kind() -> str:
    """Where the run's tensors live, as torch names the device type: `cpu` or `cuda`."""
    return "cpu" if accelerator_name() == "cpu" else "cuda"


class DeepSpeedBackend:
    """DeepSpeed ZeRO (distributed.strategy: deepspeed)."""

    config_file = rundir.DS_CONFIG

    def __init__(self, recipe):
        self.recipe = recipe

    def check_group(self) -> None:
        """The ZeRO++ settings this process group or accelerator cannot run are refused before any work."""
        from lorakit.engine.deepspeed_config import check_zero_plus_plus

        check_zero_plus_plus(self.recipe, dist.world_size(), dist.processes_per_node(), accelerator_name())

    def config(self, model_config) -> dict[str, Any]:
        """The recipe's DeepSpeed config for this group and accelerator (buckets sized by the hidden size)."""
        from lorakit.engine.deepspeed_config import build_ds_config

        hidden = getattr(model_config, "d_model", None) or getattr(model_config, "hidden_size", None)
        return build_ds_config(
            self.recipe, dist.world_size(), accelerator=accelerator_name(), hidden_size=hidden
        )

    def load_config(self, config: dict[str, Any]) -> dict[str, Any] | None:
        """What build_model loads under: the DeepSpeed config (ZeRO-3 loads partitioned)."""
        return config

    def start(self, built, config: dict[str, Any], plan):
        """deepspeed.initialize over the trainable parameters with the recipe's LR schedule."""
        import deepspeed

        from lorakit.engine.schedule import lambda_lr_factory
        from lorakit.model.adapter import optimizer_groups

        t = self.recipe.train
        engine, *_ = deepspeed.initialize(
            model=built.model,
            # The trainable parameters; with LoRA+ (method.lr_ratio_b) in groups, each with its own lr.
            model_parameters=optimizer_groups(built.model, self.recipe.method, t.lr, t.weight_decay),
            config=config,
            lr_scheduler=lambda_lr_factory(plan.total_steps, t.warmup_ratio, t.lr_schedule),
        )
        if engine.zero_optimization_stage() == 0 and dist.world_size() == 1:
            # One process without ZeRO has nothing to reduce: DeepSpeed would still walk every parameter and
            # run its all-reduce fallback after each backward (about 3% of a small model's step on CPU).
            engine.enable_backward_allreduce = False
        return engine


class FsdpBackend:
    """PyTorch FSDP2 (distributed.strategy: fsdp; lorakit.engine.fsdp)."""

    config_file = "fsdp_config.json"

    def __init__(self, recipe):
        self.recipe = recipe

    def check_group(self) -> None:
        """A hybrid shard group must divide the processes (the mesh's shape, computed before any work)."""
        from lorakit.engine.fsdp import mesh_shape

        f = self.recipe.distributed.fsdp
        mesh_shape(f.sharding, f.shard_size, dist.world_size())

    def config(self, model_config) -> dict[str, Any]:
        """What the run directory records of the backend: the fsdp section, the world and the mesh."""
        from lorakit.engine.fsdp import mesh_shape

        f = self.recipe.distributed.fsdp
        world = dist.world_size()
        return {
            "strategy": "fsdp",
            **f.model_dump(mode="json"),
            "world_size": world,
            "mesh": mesh_shape(f.sharding, f.shard_size, world),
            "dtype": self.recipe.model.dtype,
            "reduce_dtype": "float32",
        }

    def load_config(self, config: dict[str, Any]) -> None:
        """FSDP2 shards the model after it is loaded whole: no loading config."""
        return None

    def start(self, built, config: dict[str, Any], plan):
        """fully_shard the model; AdamW and the LR schedule over its trainable (sharded) parameters."""
        from lorakit.engine.fsdp import start_fsdp

        return start_fsdp(self.recipe, built, plan, device_kind())


def backend_for(recipe) -> DeepSpeedBackend | FsdpBackend:
    """The recipe's backend (distributed.strategy)."""
    return FsdpBackend(recipe) if recipe.distributed.strategy == "fsdp" else DeepSpeedBackend(recipe)
