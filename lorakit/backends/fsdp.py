"""PyTorch FSDP2 as a lorakit backend (distributed.strategy: fsdp).

`FsdpBackend` records the fsdp section and the mesh, loads the model whole and shards it
(lorakit.backends.fsdp_shard). `FsdpEngine` is the sharded model with its AdamW optimizer and LR schedule,
answering lorakit's Engine verbs (lorakit.backends.base): forward, backward, the step at the accumulation
boundary with gradient clipping and the LR schedule, resumable checkpoints through
torch.distributed.checkpoint, the whole model's state for saving, and the weights generation runs on
(unsharded once per generate call where distributed.gather_for_generation allows).

Gradients: FSDP2 reduce-scatters once per accumulation window (at the boundary's backward) and divides by the data-parallel world size, as
DeepSpeed averages over ranks, so lorakit's token-weighted micro-batch loss (loss.micro_batch_loss: loss sum
x world / window tokens) gives the same applied gradient on either backend.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lorakit import dist
from lorakit.backends.base import Forwarding, StepResult, gather_trainable
from lorakit.backends.facts import ByteModels, Layout, Readiness
from lorakit.backends.fsdp_shard import (
    DTYPES,
    check_built,
    device_mesh,
    full_tensor,
    gathered_bytes,
    mesh_shape,
    shard_model,
    unsharded,
)
from lorakit.model.load_plan import WHOLE, LoadPlan


class FsdpEngine(Forwarding):
    """A model sharded by FSDP2 with its AdamW optimizer and LR schedule, behind lorakit's Engine verbs."""

    # Every rank holds a shard of each parameter: forwards are collective (generate's too, unless
    # generation_weights gathered the model whole).
    sharded = True

    def __init__(
        self, module, optimizer, scheduler, device, max_grad_norm: float, save_dtype=None,
        gather_for_generation: bool | str = "auto",
    ):  # fmt: skip
        self.module, self.optimizer, self.lr_scheduler = module, optimizer, scheduler
        self.inner = module
        # The dtype full_model_state writes floating-point weights in (model.dtype, the dtype forwards gather
        # them in; None: as held).
        self.save_dtype = save_dtype
        self.device = device
        self.max_grad_norm = max_grad_norm
        self.gather_for_generation = gather_for_generation

    @contextlib.contextmanager
    def generation_weights(self):
        """Every FSDP module unsharded once on entry and kept so across the forwards inside (fsdp_shard.
        unsharded), each module's reshard-after-forward behaviour put back and the weights resharded on exit,
        when distributed.gather_for_generation allows: True, each rank then decodes on its own. Otherwise
        False: each decoding step's forwards gather layer by layer (synced). Nested in a gathered context
        (generate inside it): whole, as the outer context keeps them."""
        gathered = self._gathering(
            lambda: gathered_bytes(self.module, self.save_dtype), lambda: unsharded(self.module)
        )
        with gathered as whole:
            yield whole

    def backward(self, loss: torch.Tensor, *, boundary: bool) -> None:
        """Backpropagate `loss` as given (the loop already weighted it). Before the boundary the gradients
        add up unsharded on each rank (in float32, FSDP2's reduce dtype); the boundary's backward
        reduce-scatters the window's sum into the shards: one reduction per step, not one per micro-batch."""
        sync = getattr(self.module, "set_requires_gradient_sync", None)  # an FSDPModule's
        if sync is not None:
            sync(boundary)
        loss.backward()

    def step(self) -> StepResult:
        """The global gradient norm, clipping, the AdamW update and the LR schedule; a non-finite norm skips
        the update (applied False)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
        norm = full_tensor(norm)
        grad_norm = float(norm)
        applied = math.isfinite(grad_norm)
        if applied:
            if self.max_grad_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm)
            self.optimizer.step()
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(grad_norm, applied, self.optimizer.param_groups[0]["lr"])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups."""
        return self.optimizer.param_groups

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The trainable weights, whole on every rank: each DTensor gathered with full_tensor() (collective)."""
        return gather_trainable(self.module, whole=full_tensor)

    def _checkpoint_state(self, frozen_too: bool) -> dict:
        """What a checkpoint holds: this rank's model and optimizer shards and the LR schedule's state."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(ignore_frozen_params=not frozen_too)
        model, optim = get_state_dict(self.module, self.optimizer, options=options)
        return {"model": model, "optim": optim, "scheduler": self.lr_scheduler.state_dict()}

    def save_checkpoint(self, directory: Path, tag: str, *, trainable_only: bool) -> None:
        """Model (trainable weights only with `trainable_only`), optimizer and LR-schedule state as a torch
        distributed checkpoint under directory/tag, each rank writing its shards (collective)."""
        import torch.distributed.checkpoint as dcp

        state = self._checkpoint_state(not trainable_only)
        dcp.save(state, checkpoint_id=str(Path(directory) / tag))

    def load_checkpoint(self, directory: Path, tag: str, *, trainable_only: bool) -> None:
        """Restore what save_checkpoint wrote (collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        strict = not trainable_only
        state = self._checkpoint_state(strict)
        dcp.load(state, checkpoint_id=str(Path(directory) / tag))
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(strict=strict),
        )
        self.lr_scheduler.load_state_dict(state["scheduler"])

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights in model.dtype (the fp32 masters cast, as DeepSpeed saves 16-bit weights),
        gathered into rank 0's CPU memory (collective; None elsewhere)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(
            self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if not dist.is_main():
            return None
        if self.save_dtype is None:
            return state
        return {k: v.to(self.save_dtype) if v.is_floating_point() else v for k, v in state.items()}

    def close(self) -> None:
        """Nothing to undo: FSDP2 leaves no process-wide state behind."""


class FsdpBackend:
    """PyTorch FSDP2 (distributed.strategy: fsdp)."""

    config_file = "fsdp_config.json"

    def __init__(self, recipe, device_type: str | None = None):
        self.recipe = recipe
        # Where the shards live, as torch names the device type: cpu or cuda (None: found when first needed).
        self._device_type = device_type

    @property
    def device_type(self) -> str:
        """cpu or cuda: the one given, else lorakit.backends.device_kind() (asked once, when first needed)."""
        if self._device_type is None:
            from lorakit.backends.deepspeed import device_kind

            self._device_type = device_kind()
        return self._device_type

    def check_before_launch(self, processes: int, per_node: int | None) -> None:
        """Nothing more: the schema checked the mesh against distributed.num_processes, and check_group checks
        the group's."""

    def check_group(self) -> None:
        """A hybrid shard group must divide the processes (the mesh's shape, computed before any work)."""
        f = self.recipe.distributed.fsdp
        mesh_shape(f.sharding, f.shard_size, dist.world_size())

    def describe(self, model_config) -> dict[str, Any]:
        """What the run directory records of the backend: the fsdp section, the world and the mesh."""
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

    def describe_run(self) -> dict[str, Any]:
        """FSDP2 with the fsdp section's sharding (never a ZeRO stage: distributed.zero_stage does not apply)."""
        f = self.recipe.distributed.fsdp
        label = f"FSDP2 {f.sharding} sharding" + (", CPU offload" if f.cpu_offload else "")
        return {"strategy": "fsdp", "label": label, **f.model_dump(mode="json")}

    def load_plan(self, config: dict[str, Any]) -> LoadPlan:
        """Several processes, LoRA or full fine-tuning from safetensors: on the meta device, each rank reading
        its own shards once sharded (lorakit.backends.fsdp_load); otherwise whole in each process, sharded
        after."""
        from lorakit.backends.fsdp_load import eligible

        if dist.world_size() > 1 and eligible(self.recipe):
            return LoadPlan.meta()
        return WHOLE

    def layout(self) -> Layout:
        """ZeRO-3's partitioning; cpu_offload as offloading both the optimizer and the parameters."""
        d = self.recipe.distributed
        offload = "cpu" if d.fsdp.cpu_offload else None
        return Layout(d.zero_stage, offload or d.offload_optimizer, offload or d.offload_params)

    def layouts(self) -> list[Layout]:
        """What FSDP2 has: everything sharded, nothing or everything offloaded to the CPU."""
        return [Layout(3, "none", "none"), Layout(3, "cpu", "cpu")]

    def layout_overrides(self, layout: Layout) -> list[str]:
        """distributed.fsdp.cpu_offload, where it changes."""
        if layout.offload_params == self.layout().offload_params:
            return []
        return [f"distributed.fsdp.cpu_offload={str(layout.offload_params != 'none').lower()}"]

    def planned_states(
        self, layout: Layout, models: ByteModels, *, world: int, per_node: int, hidden_size: int | None,
        accelerator: str,
    ) -> Any:  # fmt: skip
        """FSDP2's byte model over its shard group: hybrid sharding keeps one copy per group of shard_size
        (default: the processes per node), full sharding shards over the world."""
        from lorakit.backends.fsdp_load import eligible

        f = self.recipe.distributed.fsdp
        group = (f.shard_size or per_node) if f.sharding == "hybrid" else world
        return models.fsdp(shard_group=group, sharded_load=eligible(self.recipe))

    def environment(self) -> Readiness:
        """torch's fully_shard and device mesh, and the mesh the recipe will shard over."""
        try:
            from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError as e:
            return Readiness(
                False,
                f"torch {torch.__version__} has no FSDP2: {e}",
                "install torch 2.6 or newer (lorakit is tested with 2.13), or use distributed.strategy: deepspeed",
            )
        d = self.recipe.distributed
        procs = d.num_processes
        if d.fsdp.sharding == "full":
            mesh = f"full sharding over {procs} process(es) per node (x nodes)"
        else:
            shard = d.fsdp.shard_size or procs
            mesh = f"hybrid: shard groups of {shard}, replicated {procs // shard}x per node (x nodes)"
        offload = ", parameters and optimizer state offloaded to CPU" if d.fsdp.cpu_offload else ""
        return Readiness(True, f"torch {torch.__version__} fully_shard; {mesh}{offload}")

    def wrap(self, built, config: dict[str, Any], schedule: Callable[[Any], Any]) -> FsdpEngine:
        """fully_shard the model; AdamW over its trainable (sharded) parameters (LoRA+ groups as with
        DeepSpeed) and the recipe's LR `schedule`."""
        from lorakit.model.adapter import optimizer_groups

        d, t = self.recipe.distributed, self.recipe.train
        check_built(built)
        if self.device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        mesh = device_mesh(d.fsdp.sharding, d.fsdp.shard_size, self.device_type)
        # Without a GPU the shards live in CPU memory already (and torch's CPUOffloadPolicy needs an
        # accelerator).
        offload = d.fsdp.cpu_offload and self.device_type == "cuda"
        model = shard_model(
            built.model, mesh, dtype=self.recipe.model.dtype, cpu_offload=offload, fill=self._reader(built)
        )
        # After fully_shard: the optimizer must hold the sharded (DTensor) parameters.
        groups = optimizer_groups(model, self.recipe.method, t.lr, t.weight_decay)
        optimizer = torch.optim.AdamW(
            groups, lr=t.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=t.weight_decay
        )
        dtype = DTYPES[self.recipe.model.dtype]
        return FsdpEngine(
            model, optimizer, schedule(optimizer), device, t.max_grad_norm, dtype, d.gather_for_generation
        )

    def _reader(self, built) -> Callable | None:
        """For a model built on the meta device: its adapter made real now, and the filler shard_model calls
        once the model is sharded (each rank reads its own rows of the checkpoint); None for a real model."""
        from lorakit.backends import fsdp_load

        if not fsdp_load.has_meta(built.model):
            return None
        fsdp_load.materialize_adapter(built.model)
        device = "cpu" if self.device_type == "cpu" else torch.device("cuda", torch.cuda.current_device())
        buffers = fsdp_load.keep_buffers(built.model, built.model.config)
        m = self.recipe.model
        dtype = DTYPES[m.dtype]

        def fill(model, real):
            fsdp_load.read_shards(model, built.source, m.revision, dtype, real, buffers, device)

        return fill
