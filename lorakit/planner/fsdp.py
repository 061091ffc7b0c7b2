"""FSDP2's model states and step buffers per rank (distributed.strategy fsdp), as torch 2.13's fully_shard
allocates them with lorakit's settings: every transformer block and then the root wrapped, the default
reshard_after_forward, MixedPrecisionPolicy(param_dtype=model.dtype, reduce_dtype=float32), the trainable
parameters kept in float32 (lorakit.backends.fsdp_shard); no gradient sync between accumulation boundaries
(lorakit.backends.fsdp); each rank reading its own rows of the checkpoint (lorakit.backends.fsdp_load).

    frozen base            stored bytes / shard group: every parameter is sharded, small ones too
    trainable weights      4 bytes / shard group: the float32 parameters are the masters (no second copy)
    Adam states            8 bytes / shard group
    gradients              4 bytes / shard group: reduce-scattered in float32 into float32 shards, from the
                           backward to the optimizer's zero_grad
    root unit, gathered    the root's parameters (embeddings, head, final norms) in the compute dtype, whole from
                           the forward's start to the backward's end: fully_shard does not reshard the root
                           after forward
    gathered blocks        two blocks' worth at once. Forward: a block's unsharded parameters and the all-gather
                           output they were copied out of (kept until the next block's copy-out). Backward: the
                           block computing and the one before it, prefetched. Plus the float32 shards cast to
                           the compute dtype for the all-gather
    first block            at the forward's start, before activations: the root's all-gather output (kept
                           until the first block's copy-out) beside the root and the first block
    reduce-scatter         a unit's unsharded gradients in the compute dtype and its float32 reduce-scatter input
                           (kept until the next unit reduces), and the root's unsharded gradients, made from the
                           head's backward on and reduced at the end
    accumulation           gradient_accumulation_steps > 1: every unit's unsharded gradients in float32, held
                           across the window and reduce-scattered once, at the boundary
    loading                sharded: the model's states plus one tensor's rows per rank, as stored and cast (and
                           the adapter, whole); otherwise the whole model in each process (states.loading)

Measured against the retired benchmarks/rehearsal.py's FLAN-T5-XL-shaped runs (docs/planning.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from lorakit.planner.arch import Arch
from lorakit.planner.moe import expert_stacks
from lorakit.planner.states import QUANT_BYTES_PER_WEIGHT, Counts, Item, Setup, loading


@dataclass(frozen=True)
class Unit:
    """One fully_shard unit: its frozen weights' bytes as stored on the ranks (model.dtype, or packed 4-bit)
    and its trainable elements."""

    frozen_bytes: int
    trainable: int

    def gathered(self, compute_bytes: int) -> int:
        """Bytes of the unit all-gathered: frozen weights as stored, trainable ones cast to the compute dtype."""
        return self.frozen_bytes + self.trainable * compute_bytes


def units(arch: Arch, method, c: Counts, dtype_bytes: int) -> tuple[Unit, list[Unit]]:
    """The root unit and each block's (arch.blocks, in model order): the parameters below each block, the
    root everything else (embeddings, head, final norms, and what the block census cannot place)."""
    a, names = dtype_bytes, set(arch.blocks)

    def owner(name: str) -> str | None:  # the innermost block holding module `name`
        parts = name.split(".")
        return next((p for i in range(len(parts), 0, -1) if (p := ".".join(parts[:i])) in names), None)

    params = dict.fromkeys(arch.blocks, 0)
    for name, n in arch.param_modules:
        if (b := owner(name)) is not None:
            params[b] += n
    frozen = {b: 0 if method.kind == "full" else n * a for b, n in params.items()}
    trainable = dict(params) if method.kind == "full" else dict.fromkeys(arch.blocks, 0)
    if method.kind == "qlora":
        for lin in arch.quantized_linears():
            if (b := owner(lin.name)) is not None:
                frozen[b] -= int(lin.in_features * lin.out_features * (a - QUANT_BYTES_PER_WEIGHT))
        for name, n in expert_stacks(arch):  # an MoE's fused experts are 4-bit too
            if (b := owner(name)) is not None:
                frozen[b] -= int(n * (a - QUANT_BYTES_PER_WEIGHT))
    if method.kind == "ia3":
        for lin, ff in arch.ia3_targets(method.target_modules, method.feedforward_modules):
            if (b := owner(lin.name)) is not None:
                trainable[b] += lin.in_features if ff else lin.out_features
    elif method.kind != "full":
        for lin in arch.lora_targets(method.target_modules):
            if (b := owner(lin.name)) is not None:
                trainable[b] += method.r * (lin.in_features + lin.out_features)
                trainable[b] += lin.out_features if method.use_dora else 0
    blocks = [Unit(frozen[b], trainable[b]) for b in arch.blocks]
    root = Unit(max(0, c.frozen_bytes - sum(u.frozen_bytes for u in blocks)),
                max(0, c.trainable - sum(u.trainable for u in blocks)))  # fmt: skip
    return root, blocks


def fsdp_states(arch: Arch, recipe, c: Counts, setup: Setup, *, world: int, dtype_bytes: int,
                sharded_load: bool) -> list[Item]:  # fmt: skip
    """The per-rank items of `recipe` on FSDP2 over shard groups of `world` ranks (see the module docstring);
    `setup.offload_params` "cpu": distributed.fsdp.cpu_offload (the shards, their gradients and Adam's states
    in CPU RAM, gathered onto the GPU); `sharded_load`: each rank reads its own rows of the checkpoint."""
    a, t = dtype_bytes, c.trainable
    where = "gpu" if setup.offload_params == "none" else setup.offload_params
    items = []
    if c.frozen_bytes:
        note = c.frozen_note(a)
        items.append(Item("frozen base weights", c.frozen_bytes // world, where, "resident", note))
    if c.quant_constants:
        items.append(Item("4-bit quantization constants", c.quant_constants, "gpu", "resident",
                          "not sharded: every rank keeps a copy"))  # fmt: skip
    items.append(Item("trainable weights", t * 4 // world, where, "resident",
                      "float32: the parameters are the masters"))  # fmt: skip
    items.append(Item("Adam states (fp32)", t * 8 // world, where, "resident"))
    items.append(Item("gradients", t * 4 // world, where, "gradients", "float32, reduce-scattered"))
    root, blocks = units(arch, recipe.method, c, a)
    g = [u.gathered(a) for u in blocks]
    # What an all-gather copies in besides the output: the float32 shards cast to model.dtype, and with
    # cpu_offload every shard moved to the GPU.
    copy_in = max(u.trainable * a * (a != 4) + u.gathered(a) * (where != "gpu") for u in [root, *blocks])
    items.append(Item("FSDP2 root unit, gathered", root.gathered(a), "gpu", "forward",
                      "embeddings, head, final norms: whole through the forward and the backward"))  # fmt: skip
    items.append(Item("FSDP2 gathered blocks", 2 * max(g, default=0) + copy_in // world, "gpu", "backward",
                      "a block and the next one's all-gather output (forward: its own; backward: the "
                      "prefetched block's)"))  # fmt: skip
    items.append(Item("FSDP2 root's all-gather output, first block", root.gathered(a) + (g[0] if g else 0)
                      + copy_in // world, "gpu", "start", "kept until the first block's copy-out"))  # fmt: skip
    tb = max((u.trainable for u in blocks), default=0)
    reduce = max(root.trainable * a + tb * (a + 4), root.trainable * (a + 4))
    items.append(Item("FSDP2 unsharded gradients, reduce-scatter input (fp32)", reduce, "gpu", "backward",
                      "a unit's gradients and their float32 copy; the root's, from the head on",
                      kind="buffer"))  # fmt: skip
    if recipe.train.gradient_accumulation_steps > 1:
        items.append(Item("unsharded fp32 gradients across the accumulation window", t * 4, "gpu", "forward",
                          "no reduce-scatter until the boundary", kind="buffer"))  # fmt: skip
    if sharded_load:
        # read_shards: a rank's rows of one tensor as stored, cast to model.dtype (and to the float32 of a
        # trainable weight); LoRA's weights made whole on every rank before sharding.
        stored = arch.stored_dtype_bytes
        per_elem = stored + a * (stored != a) + 4 * (recipe.method.kind == "full" and a != 4)
        rows = max(arch.param_numels, default=0) // world * per_elem
        adapter = 0 if recipe.method.kind == "full" else t * 4
        items.append(Item("one tensor's rows per rank while loading", rows + adapter, "cpu", "load",
                          "each rank reads its own rows of the checkpoint", kind="load"))  # fmt: skip
    else:
        items += loading(c, dtype_bytes=a, partitioned_init=False)
    return items
