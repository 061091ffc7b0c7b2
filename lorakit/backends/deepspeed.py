"""DeepSpeed ZeRO as a lorakit backend (distributed.strategy: deepspeed).

`DeepSpeedBackend` checks the group's ZeRO++ settings, builds the DeepSpeed config (the model loads under
it, so ZeRO-3 loads partitioned) and starts `deepspeed.initialize`. `DeepSpeedEngine` holds the engine it
returns (composed: DeepSpeed's engine is never subclassed or patched) and answers lorakit's Engine verbs in
DeepSpeed's: the boundary is `set_gradient_accumulation_boundary`, the loop's weighted loss goes to
`backward(scale_wrt_gas=False)`, ZeRO-3's whole weights come from `_zero3_consolidated_16bit_state_dict`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lorakit import dist, rundir
from lorakit.backends import deepspeed_bf16 as bf16
from lorakit.backends.base import Forwarding, StepResult, gather_trainable
from lorakit.backends.facts import ByteModels, Layout, Readiness
from lorakit.model.load_plan import WHOLE, LoadPlan


def accelerator_name() -> str:
    """DeepSpeed's accelerator for this machine: `cuda`, or `cpu` where there is no GPU."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def device_kind() -> str:
    """Where the run's tensors live, as torch names the device type: `cpu` or `cuda` (what DeepSpeed's
    accelerator detection says, so DS_ACCELERATOR=cpu keeps a GPU machine's run on the CPU)."""
    return "cpu" if accelerator_name() == "cpu" else "cuda"


def accelerator_device() -> str:
    """The device this process trains on (`cuda:N`, `cpu`), where deepspeed.initialize moves the model."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


def _gathered(params: list[torch.nn.Parameter]):
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        # ZeRO-3 keeps a shard of each tensor per rank; this assembles whole tensors on every rank.
        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def _full_shape(p: torch.nn.Parameter) -> tuple[int, ...]:
    # Under ZeRO-3 a parameter's own shape is its (empty) partition's; ds_shape is the whole tensor's.
    return tuple(getattr(p, "ds_shape", p.shape))


class DeepSpeedEngine(Forwarding):
    """A DeepSpeed engine behind lorakit's Engine verbs.

    `built`: the BuiltModel the engine was made from; its HfDeepSpeedConfig (ZeRO-3 loading) must live as
    long as the engine, and `close()` lets it go."""

    def __init__(self, engine, built=None, gather_for_generation: bool | str = "auto"):
        self.engine, self.built = engine, built
        self.gather_for_generation = gather_for_generation
        # Forward, train() and eval() go through DeepSpeed's engine (it casts inputs, times steps).
        self.inner = engine
        self.module = engine.module
        self.device = engine.device
        self.sharded = engine.zero_optimization_stage() == 3

    @contextlib.contextmanager
    def generation_weights(self):
        """ZeRO-3: the whole model gathered once on entry and DeepSpeed's per-layer hooks off until the exit
        (DeepSpeed's own unwrap_model_for_generation), when distributed.gather_for_generation allows;
        otherwise each decoding step's forwards gather layer by layer (synced). Stages 0-2: whole. Nested in a
        gathered context (generate inside it): whole, as the outer one keeps them (a second unwrap would put
        DeepSpeed's hooks back twice)."""
        if not self.sharded:
            yield True
            return
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        # What gathering adds on this rank: every partitioned parameter whole (DeepSpeed gathers into a new
        # full-size buffer and keeps the rank's partition beside it).
        def adds() -> int:
            params = self.module.parameters()
            return sum(
                p.ds_numel * p.element_size() for p in params if hasattr(p, "ds_id") and not p.ds_persist
            )

        with self._gathering(adds, lambda: unwrap_model_for_generation(self.engine)) as whole:
            yield whole

    def backward(self, loss: torch.Tensor, *, boundary: bool) -> None:
        """DeepSpeed's backward of the loop's already weighted loss (no division by its own accumulation
        count). The window, not DeepSpeed's micro-step counter, decides where gradients are reduced, so a
        short last window of an epoch still steps with correctly weighted gradients. DeepSpeed counts
        micro-batches in its `step()`: a micro-batch before the boundary takes that step here."""
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss, scale_wrt_gas=False)
        if not boundary:
            self.engine.step()

    def step(self) -> StepResult:
        """DeepSpeed's step at the boundary: clipping, the optimizer (ZeRO 1-3, and ZeRO-0 in bf16, skip a
        non-finite update themselves) and the LR schedule."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return StepResult(
            float(norm) if norm is not None else None,
            bool(self.engine.was_step_applied()),
            self.engine.get_lr()[0],
        )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups."""
        return self.engine.optimizer.param_groups

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The trainable weights, whole on every rank (ZeRO-3: gathered from every rank's partitions)."""
        return gather_trainable(self.module, gathered=_gathered, full_shape=_full_shape)

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        """ZeRO-3: gathered module by module into rank 0's CPU memory (None elsewhere). DeepSpeed's public
        save_16bit_model writes a pickle whatever the file name; lorakit writes safetensors. ZeRO 0-2: None,
        the module holds its weights whole."""
        return self.engine._zero3_consolidated_16bit_state_dict() if self.sharded else None

    def save_checkpoint(self, directory: Path, tag: str, *, trainable_only: bool) -> None:
        """DeepSpeed's own checkpoint (partitioned per rank under ZeRO) under directory/tag."""
        self.engine.save_checkpoint(
            str(directory), tag=tag, save_latest=False, exclude_frozen_parameters=trainable_only
        )

    def load_checkpoint(self, directory: Path, tag: str, *, trainable_only: bool) -> None:
        """Weights (the frozen ones are not in a trainable-only checkpoint: not strict), optimizer and LR
        schedule."""
        path, _ = self.engine.load_checkpoint(
            str(directory),
            tag=tag,
            load_module_strict=not trainable_only,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the engine state from {Path(directory) / tag}")

    def close(self) -> None:
        """Undo the process-wide state a job leaves: ZeRO hooks, and transformers' "ZeRO-3 is on" flag, which
        would otherwise make every later from_pretrained in this process load partitioned."""
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        self.engine.destroy()
        if self.built is not None:
            self.built.hf_ds_config = None
        unset_hf_deepspeed_config()


class DeepSpeedBackend:
    """DeepSpeed ZeRO (distributed.strategy: deepspeed)."""

    config_file = rundir.DS_CONFIG

    def __init__(self, recipe):
        self.recipe = recipe

    def check_before_launch(self, processes: int, per_node: int | None) -> None:
        """The ZeRO++ settings the workers would refuse (qwZ / qgZ on CPU, an hpZ group across nodes), refused
        before the data is prepared and torchrun starts."""
        from lorakit.backends.deepspeed_config import check_zero_plus_plus

        d = self.recipe.distributed
        # Only ZeRO++'s quantized collectives depend on the accelerator, and asking DeepSpeed which one this
        # is imports it (seconds, before torchrun starts the workers that import it anyway).
        accelerator = accelerator_name() if d.quantized_weights or d.quantized_gradients else None
        check_zero_plus_plus(self.recipe, processes, per_node, accelerator)

    def check_group(self) -> None:
        """The ZeRO++ settings this process group or accelerator cannot run are refused before any work."""
        from lorakit.backends.deepspeed_config import check_zero_plus_plus

        check_zero_plus_plus(self.recipe, dist.world_size(), dist.processes_per_node(), accelerator_name())

    def describe(self, model_config) -> dict[str, Any]:
        """The recipe's DeepSpeed config for this group and accelerator (buckets sized by the hidden size)."""
        from lorakit.backends.deepspeed_config import build_ds_config

        hidden = getattr(model_config, "d_model", None) or getattr(model_config, "hidden_size", None)
        return build_ds_config(
            self.recipe, dist.world_size(), accelerator=accelerator_name(), hidden_size=hidden
        )

    def describe_run(self) -> dict[str, Any]:
        """DeepSpeed ZeRO at the recipe's stage, with its offload and ZeRO++ settings."""
        from lorakit.recipe.schema import ZERO_PLUS_PLUS

        d = self.recipe.distributed
        return {
            "strategy": "deepspeed",
            "label": f"ZeRO-{d.zero_stage}",
            "zero_stage": d.zero_stage,
            "offload_optimizer": d.offload_optimizer,
            "offload_params": d.offload_params,
            **{key: getattr(d, key) for key in ZERO_PLUS_PLUS},
        }

    def load_plan(self, config: dict[str, Any]) -> LoadPlan:
        """ZeRO-3 loads partitioned under its config (each rank materialises only its partition); stages 0-2
        load the model whole in each process."""
        if config.get("zero_optimization", {}).get("stage") == 3:
            return LoadPlan.partitioned(config)
        return WHOLE

    def layout(self) -> Layout:
        """The recipe's ZeRO stage and offload."""
        d = self.recipe.distributed
        return Layout(d.zero_stage, d.offload_optimizer, d.offload_params)

    def layouts(self) -> list[Layout]:
        """ZeRO-2 and 3, each with every offload level it has (to the CPU)."""
        return [Layout(2, "none", "none"), Layout(2, "cpu", "none"),
                Layout(3, "none", "none"), Layout(3, "cpu", "none"), Layout(3, "cpu", "cpu")]  # fmt: skip

    def layout_overrides(self, layout: Layout) -> list[str]:
        """distributed.zero_stage, offload_optimizer and offload_params, where they change."""
        d, out = self.recipe.distributed, []
        if layout.zero_stage != d.zero_stage:
            out.append(f"distributed.zero_stage={layout.zero_stage}")
        if layout.offload_optimizer != d.offload_optimizer:
            out.append(f"distributed.offload_optimizer={layout.offload_optimizer}")
        if layout.offload_params != d.offload_params:
            out.append(f"distributed.offload_params={layout.offload_params}")
        return out

    def planned_states(
        self, layout: Layout, models: ByteModels, *, world: int, per_node: int, hidden_size: int | None,
        accelerator: str,
    ) -> Any:  # fmt: skip
        """ZeRO's byte model under the DeepSpeed config of `layout` (its buckets and ZeRO++ partitions);
        ZeRO-3 loads partitioned except a 4-bit base, which transformers quantizes whole while loading."""
        from lorakit.backends.deepspeed_config import build_ds_config

        d = self.recipe.distributed
        variant = self.recipe.model_copy(update={"distributed": d.model_copy(update={
            "zero_stage": layout.zero_stage, "offload_optimizer": layout.offload_optimizer,
            "offload_params": layout.offload_params})})  # fmt: skip
        config = build_ds_config(variant, world, accelerator=accelerator, hidden_size=hidden_size)
        partitioned = layout.zero_stage == 3 and self.recipe.method.kind != "qlora"
        return models.zero(config, partitioned_init=partitioned)

    def environment(self) -> Readiness:
        """Nothing of its own: the doctor's `deepspeed ops` line checks DeepSpeed."""
        return Readiness(None, "the recipe trains on DeepSpeed (distributed.strategy: deepspeed)")

    def wrap(self, built, config: dict[str, Any], schedule: Callable[[Any], Any]) -> DeepSpeedEngine:
        """deepspeed.initialize over the trainable parameters with the recipe's LR schedule."""
        import deepspeed

        from lorakit.model.adapter import optimizer_groups

        t = self.recipe.train
        # The trainable parameters; with LoRA+ (method.lr_ratio_b) in groups, each with its own lr.
        groups = optimizer_groups(built.model, self.recipe.method, t.lr, t.weight_decay)
        optimizer = None
        if bf16.owns_bf16(config):
            # ZeRO-0 in bf16: lorakit's flat-master AdamW instead of DeepSpeed's per-tensor bf16 wrapper
            # (one host sync per trainable tensor per step; deepspeed_bf16.py).
            bf16.place_module(built.model, accelerator_device())
            optimizer, groups = bf16.mixed_precision_adamw(groups, config), None
            config = bf16.engine_config(config)
        from lorakit.backends.zero3_leaves import before_initialize

        before_initialize(built.model, config)
        engine, *_ = deepspeed.initialize(
            model=built.model,
            model_parameters=groups,
            optimizer=optimizer,
            config=config,
            lr_scheduler=schedule,
        )
        if engine.zero_optimization_stage() == 0 and dist.world_size() == 1:
            # One process without ZeRO has nothing to reduce: DeepSpeed would still walk every parameter and
            # run its all-reduce fallback after each backward (about 3% of a small model's step on CPU).
            engine.enable_backward_allreduce = False
        return DeepSpeedEngine(engine, built, self.recipe.distributed.gather_for_generation)
