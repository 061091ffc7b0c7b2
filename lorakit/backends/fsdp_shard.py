"""How FSDP2 shards a model (distributed.strategy: fsdp): the device mesh, `fully_shard` over every block
and the root, and what a built model must not do under it. The engine over the sharded model is
lorakit.backends.fsdp.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lorakit import dist

# model.dtype (the recipe's names) as torch dtypes.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` whole: a sharded DTensor gathered from its mesh (collective), any other tensor as it is."""
    return t.full_tensor() if _is_dtensor(t) else t


def gathered_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """What unsharding every parameter of `model` adds on this rank's device: each DTensor whole, in the
    dtype FSDP2 gathers it in (floating-point weights in `dtype`, the mixed-precision policy's model.dtype,
    where that is narrower than what the shard holds: fp32 masters of a bf16 model; None: as held). Whole,
    not the other ranks' shards only: unshard all-gathers into a buffer of its own beside the shard, which
    stays (in CPU memory under cpu_offload)."""
    total = 0
    for p in model.parameters():
        if _is_dtensor(p):
            size = p.element_size()
            if dtype is not None and p.is_floating_point():
                size = min(size, dtype.itemsize)
            total += p.numel() * size
    return total


@contextlib.contextmanager
def unsharded(model: torch.nn.Module) -> Iterator[None]:
    """Every FSDP module of `model` unsharded on entry (its all-gathers: collective) and kept unsharded across
    the forwards inside (no reshard after forward), so those forwards run no collective and each rank may run
    as many as it needs. On exit each module's reshard-after-forward behaviour is put back as it was and every
    module resharded (local: frees the gathered weights)."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    saved = [_reshard_after_forward(m) for m in modules]
    try:
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
        for m in modules:  # the same order on every rank: the all-gathers pair up
            m.unshard()
        yield
    finally:
        for m, behaviour in zip(modules, saved, strict=True):
            _restore_reshard_after_forward(m, behaviour)
        for m in modules:
            m.reshard()


def _reshard_after_forward(module) -> tuple[Any, list[Any]]:
    """An FSDP module's reshard-after-forward behaviour as torch stores it: the state's
    _auto_reshard_after_forward (fully_shard called without reshard_after_forward, as shard_model does: the
    root's lazy initialisation then turns its own off) and each parameter group's post_forward_mesh_info
    (None: keep unsharded, the root's default; the shard mesh: reshard, the blocks'; a smaller mesh: an int
    reshard_after_forward)."""
    state = module._get_fsdp_state()
    return state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in state._fsdp_param_groups]


def _restore_reshard_after_forward(module, behaviour: tuple[Any, list[Any]]) -> None:
    """Put back what _reshard_after_forward read. The public set_reshard_after_forward takes a bool only and
    marks the module as set by hand (_auto_reshard_after_forward False), so the stored values go back as they
    were."""
    state = module._get_fsdp_state()
    auto, infos = behaviour
    state._auto_reshard_after_forward = auto
    for group, info in zip(state._fsdp_param_groups, infos, strict=True):
        group.post_forward_mesh_info = info


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


def shard_model(
    model: torch.nn.Module, mesh, *, dtype: str, cpu_offload: bool, fill: Callable | None = None
) -> torch.nn.Module:
    """fully_shard every block, then the root (in place; returned). The root's group holds the rest
    (embeddings, final norms, the head, tied or not): it gathers them for the whole forward.

    Compute in model.dtype (param_dtype bf16 for a bf16 model; LoRA weights peft keeps in fp32 stay fp32
    masters), gradients reduced in fp32. `generate` is registered as a forward, so generation gathers the
    root's parameters (embeddings, head) as a forward does. `fill(model, real)`: for a model loaded on the
    meta device (lorakit.backends.fsdp_load), allocates and fills the shards once sharded; `real` holds the
    parameters that were real before sharding (the adapter), whole, by name."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    param_dtype = DTYPES[dtype]
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
    if any(getattr(p, "quant_state", None) is not None for p in model.parameters()):
        from lorakit.model.quantize import pin_quant_states

        # QLoRA: the packed 4-bit weights are stored in model.dtype (quantize.bnb_config), so they shard and
        # gather as the other weights do; their quantization state stays whole on every rank.
        pin_quant_states(model)
    if param_dtype != torch.float32:
        # fp32 master weights, as DeepSpeed's bf16 optimizer keeps: the policy computes in param_dtype and
        # AdamW updates fp32 values (full fine-tuning of a bf16 model would otherwise train in bf16).
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
    real = {n: p.data for n, p in model.named_parameters() if not p.is_meta} if fill else {}
    blocks = _block_classes(model)
    for m in list(model.modules()):
        if type(m).__name__ in blocks:
            fully_shard(m, **kw)
    fully_shard(model, **kw)
    if fill is not None:
        fill(model, real)
    # FSDP2 fixes each group's gradient dtypes (fp32 for LoRA's fp32 masters) from the parameters that require
    # grad at its lazy initialisation, otherwise run by the first forward. peft's disable_adapter() turns
    # requires_grad off for the adapter, and DPO's reference pass (a first forward) runs inside it: the
    # groups would then take no trainable parameter and hand bf16 gradients to fp32 shards. Initialise now.
    model._get_fsdp_state()._lazy_init()
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
        if p.requires_grad and not p.is_meta:  # meta: read from the checkpoint on every rank alike
            t = p.data if device is None else p.data.to(device)
            td.broadcast(t, src=0)
            if device is not None:
                p.data.copy_(t)


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
