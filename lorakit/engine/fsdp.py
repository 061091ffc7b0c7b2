"""PyTorch FSDP2 behind the engine surface the loop uses (distributed.strategy: fsdp).

`shard_model` applies torch's `fully_shard` to every decoder (and encoder) block, then to the whole model,
over a 1-D device mesh (sharding full) or a 2-D (replicate, shard) one (sharding hybrid). `FsdpEngine` then
answers the same calls as a DeepSpeed engine (lorakit.engine.backend.Engine): forward, backward, step at the
accumulation boundary with gradient clipping and the LR schedule, the global gradient norm, resumable
checkpoints through torch.distributed.checkpoint, the whole model's state for saving.

Gradients: FSDP2 reduce-scatters after every backward and divides by the data-parallel world size, as
DeepSpeed averages over ranks, so lorakit's token-weighted micro-batch loss (loss.micro_batch_loss: loss sum
x world / window tokens) gives the same applied gradient on either backend.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from lorakit.engine import dist

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` whole: a sharded DTensor gathered from its mesh (collective), any other tensor as it is."""
    return t.full_tensor() if _is_dtensor(t) else t


def mesh_shape(sharding: str, shard_size: int | None, world: int) -> dict[str, int]:
    """The dimensions of the mesh FSDP2 shards over: {"shard": world} for full sharding; for hybrid
    {"replicate": world / shard, "shard": shard}, each shard group `shard_size` consecutive ranks (default:
    the processes per node). RecipeError when the shard group does not divide the processes."""
    if sharding == "full":
        return {"shard": world}
    shard = shard_size or dist.processes_per_node() or world
    if world % shard:
        from lorakit.errors import RecipeError

        raise RecipeError(
            f"distributed.fsdp.shard_size {shard} must divide the number of processes ({world}): each "
            "shard group holds one whole copy of the model"
        )
    return {"replicate": world // shard, "shard": shard}


def device_mesh(sharding: str, shard_size: int | None, device_type: str):
    """The mesh of `mesh_shape` over this process group: 1-D ("shard",) or 2-D ("replicate", "shard").
    Collective."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(sharding, shard_size, dist.world_size())
    return init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))


def _block_classes(model: torch.nn.Module) -> set[str]:
    """Class names of the model's transformer blocks: what transformers marks as never split across
    devices (`_no_split_modules`: LlamaDecoderLayer, T5Block, ...)."""
    for m in model.modules():
        names = getattr(m, "_no_split_modules", None)
        if names:
            return set(names)
    return set()


def shard_model(model: torch.nn.Module, mesh, *, dtype: str, cpu_offload: bool) -> torch.nn.Module:
    """fully_shard every block, then the root (in place; returned). The root's group holds the rest
    (embeddings, final norms, the head, tied or not): it gathers them for the whole forward.

    Compute in model.dtype (param_dtype bf16 for a bf16 model; LoRA weights peft keeps in fp32 stay fp32
    masters), gradients reduced in fp32. `generate` is registered as a forward, so generation gathers the
    root's parameters (embeddings, head) as a forward does."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    param_dtype = _DTYPES[dtype]
    mp = MixedPrecisionPolicy(
        param_dtype=None if param_dtype == torch.float32 else param_dtype,
        reduce_dtype=torch.float32,
        # Inputs are left as they come (ids, masks built in model.dtype, as under DeepSpeed): FSDP2's cast
        # rebuilds every tuple in the kwargs and cannot rebuild NamedTuples such as Seq2SeqSegments.
        cast_forward_inputs=False,
    )
    kw = {
        "mesh": mesh,
        "mp_policy": mp,
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    _broadcast_trainable(model, mesh.device_type)
    if param_dtype != torch.float32:
        # fp32 master weights, as DeepSpeed's bf16 optimizer keeps: the policy computes in param_dtype and
        # AdamW updates fp32 values (full fine-tuning of a bf16 model would otherwise train in bf16).
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
    blocks = _block_classes(model)
    for m in list(model.modules()):
        if type(m).__name__ in blocks:
            fully_shard(m, **kw)
    fully_shard(model, **kw)
    if hasattr(model, "generate"):
        register_fsdp_forward_method(model, "generate")
    return model


def _broadcast_trainable(model: torch.nn.Module, device_type: str) -> None:
    """Rank 0's values of the trainable parameters on every rank (collective). fully_shard keeps each rank's
    slice of its own copy, so copies initialised differently (LoRA's random A where the ranks' RNG streams
    differ) would be stitched together; DeepSpeed broadcasts from rank 0 at initialisation likewise. The
    frozen base came from the same checkpoint on every rank."""
    if dist.world_size() == 1:
        return
    import torch.distributed as td

    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else None
    for p in model.parameters():
        if p.requires_grad:
            t = p.data if device is None else p.data.to(device)
            td.broadcast(t, src=0)
            if device is not None:
                p.data.copy_(t)


class FsdpEngine:
    """A model sharded by FSDP2 with its AdamW optimizer and LR schedule, answering the calls lorakit's loop,
    checkpoints and saving make of an engine (the DeepSpeed engine's names)."""

    def __init__(self, module, optimizer, scheduler, device, max_grad_norm: float, save_dtype=None):
        self.module, self.optimizer, self.lr_scheduler = module, optimizer, scheduler
        # The dtype full_model_state writes floating-point weights in (model.dtype; None: as held).
        self.save_dtype = save_dtype
        self.device = device
        self.max_grad_norm = max_grad_norm
        self._boundary = True
        self._norm: float | None = None
        self._applied = True

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self) -> None:
        """Training mode (dropout on)."""
        self.module.train()

    def eval(self) -> None:
        """Evaluation mode (dropout off)."""
        self.module.eval()

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        """Whether the next `step()` ends the accumulation window and applies the update."""
        self._boundary = boundary

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = False) -> None:
        """Backpropagate `loss` as given (the loop already weighted it); FSDP2 reduce-scatters the
        gradients into this rank's shards, where they add up over the window."""
        loss.backward()

    def step(self) -> None:
        """At the window's end: the global gradient norm, clipping, the AdamW update and the LR schedule;
        a non-finite norm skips the update (was_step_applied() False). Between micro-batches: nothing."""
        if not self._boundary:
            return
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
        norm = full_tensor(norm)
        self._norm = float(norm)
        self._applied = math.isfinite(self._norm)
        if self._applied:
            if self.max_grad_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm)
            self.optimizer.step()
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last applied window (over every rank's shards), before clipping."""
        return self._norm

    def was_step_applied(self) -> bool:
        """Whether the last window's update was applied (its gradient norm was finite)."""
        return self._applied

    def get_lr(self) -> list[float]:
        """The current learning rate of each parameter group."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def _checkpoint_state(self, frozen_too: bool) -> dict:
        """What a checkpoint holds: this rank's model and optimizer shards and the LR schedule's state."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(ignore_frozen_params=not frozen_too)
        model, optim = get_state_dict(self.module, self.optimizer, options=options)
        return {"model": model, "optim": optim, "scheduler": self.lr_scheduler.state_dict()}

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool = False, **kw) -> None:
        """Model (trainable weights only with exclude_frozen_parameters), optimizer and LR-schedule state
        as a torch distributed checkpoint under save_dir/tag, each rank writing its shards (collective)."""
        import torch.distributed.checkpoint as dcp

        state = self._checkpoint_state(not kw.get("exclude_frozen_parameters", False))
        dcp.save(state, checkpoint_id=str(Path(save_dir) / tag))

    def load_checkpoint(self, load_dir: str, tag: str, load_module_strict: bool = True, **kw):
        """Restore what save_checkpoint wrote (collective); returns (path, {}) like DeepSpeed's."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        state = self._checkpoint_state(load_module_strict)
        path = Path(load_dir) / tag
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(strict=load_module_strict),
        )
        self.lr_scheduler.load_state_dict(state["scheduler"])
        return str(path), {}

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

    def destroy(self) -> None:
        """Nothing to undo: FSDP2 leaves no process-wide state behind."""


def check_built(built) -> None:
    """Refuse (RecipeError) what the built model would do that FSDP2 cannot gather for: packed
    encoder-decoder rows with explicit masks run the encoder on its own, outside the root module's forward,
    where the root's parameters (the shared embedding) are still sharded."""
    from lorakit.model.varlen import VARLEN_SDPA

    if built.is_encoder_decoder and built.packing and built.attention != VARLEN_SDPA:
        from lorakit.errors import RecipeError

        raise RecipeError(
            f"distributed.strategy fsdp: packed encoder-decoder rows on attention {built.attention} run the "
            "encoder outside the model's forward, which FSDP2 cannot gather parameters for; use model."
            "attention sdpa (or auto: per-example attention), data.packing false, or strategy deepspeed"
        )


def start_fsdp(recipe, built, plan, device_type: str) -> FsdpEngine:
    """Shard the built model and wrap it with AdamW over its trainable parameters (LoRA+ groups as with
    DeepSpeed) and the recipe's LR schedule."""
    from lorakit.engine.schedule import lambda_lr_factory
    from lorakit.model.adapter import optimizer_groups

    d, t = recipe.distributed, recipe.train
    check_built(built)
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    mesh = device_mesh(d.fsdp.sharding, d.fsdp.shard_size, device_type)
    # Without a GPU the shards live in CPU memory already (and torch's CPUOffloadPolicy needs an accelerator).
    offload = d.fsdp.cpu_offload and device_type == "cuda"
    model = shard_model(built.model, mesh, dtype=recipe.model.dtype, cpu_offload=offload)
    # After fully_shard: the optimizer must hold the sharded (DTensor) parameters.
    groups = optimizer_groups(model, recipe.method, t.lr, t.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=t.weight_decay)
    scheduler = lambda_lr_factory(plan.total_steps, t.warmup_ratio, t.lr_schedule)(optimizer)
    return FsdpEngine(model, optimizer, scheduler, device, t.max_grad_norm, _DTYPES[recipe.model.dtype])
