"""Model states per rank: weights, gradients, fp32 master weights, Adam states and ZeRO's buffers.

Byte counts per parameter, as DeepSpeed 0.19 allocates them for bf16/fp16 mixed precision (measured on
tiny models by tests/integration/test_plan_measured.py, and compared with DeepSpeed's own estimators by
tests/unit/test_plan_states.py; see docs/planning.md):

    weights in model.dtype           a   (the frozen base too; 4-bit weights: 0.5 + constants)
    gradients in model.dtype         a   (trainable only; ZeRO-2 frees them after the step, ZeRO-3 keeps
                                          a flat partition)
    fp32 master weights              4   (trainable only)
    Adam exp_avg + exp_avg_sq        8   (trainable only)
    fp32 gradients for the step      4   (trainable only; made at the step, when activations are gone)

ZeRO-1 partitions master weights and Adam states over all ranks, ZeRO-2 also the gradients, ZeRO-3 also
the weights. Offloading the optimizer moves master weights, Adam states and gradients to CPU RAM;
offloading parameters (ZeRO-3) moves the weights too.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorakit.backends.facts import Layout
from lorakit.model.checkpointing import OFF, SELECTIVE, WHOLE, ordinal
from lorakit.planner.arch import Arch
from lorakit.planner.moe import moe_frozen_note, parameter_lora, quantized_experts

# bitsandbytes 4-bit, blocksize 64 with double quantization: 0.5 byte per weight, one uint8 absmax per
# block of 64, one fp32 scale per 256 blocks, and a 256-entry fp32 code table per weight matrix.
QUANT_BYTES_PER_WEIGHT = 0.5
QUANT_CONSTANT_BYTES_PER_WEIGHT = 1 / 64 + 4 / (64 * 256)
QUANT_CODE_BYTES = 256 * 4 + 16 * 4


@dataclass(frozen=True)
class Setup:
    """One way to run a recipe: what the planner varies to find a setup that fits."""

    zero_stage: int
    offload_optimizer: str
    offload_params: str
    micro_batch_size: int
    # Packed micro-batches: the token budget of the (encoder) row; None without packing.
    max_tokens: int | None
    gradient_checkpointing: bool
    # With checkpointing: every k-th block only (selective, lorakit.model.checkpointing); None: every block.
    checkpoint_every: int | None = None

    @property
    def checkpointing(self) -> str:
        """off, selective or whole (lorakit.model.checkpointing)."""
        if not self.gradient_checkpointing:
            return OFF
        return SELECTIVE if self.checkpoint_every else WHOLE

    @property
    def layout(self) -> Layout:
        """The stage and offload, as the backend names them (lorakit.backends.facts.Layout)."""
        return Layout(self.zero_stage, self.offload_optimizer, self.offload_params)

    def label(self) -> str:
        """A short human description: ZeRO-3, offload optimizer+params to cpu, mb 4, checkpointing."""
        parts = [f"ZeRO-{self.zero_stage}"]
        if self.offload_params != "none":
            parts.append(f"offload optimizer+params to {self.offload_params}")
        elif self.offload_optimizer != "none":
            parts.append(f"offload optimizer to {self.offload_optimizer}")
        parts.append(
            f"max_tokens {self.max_tokens}" if self.max_tokens else f"micro-batch {self.micro_batch_size}"
        )
        every = self.checkpoint_every if self.gradient_checkpointing else None
        parts.append(
            f"checkpointing every {ordinal(every)} block"
            if every
            else ("checkpointing" if self.gradient_checkpointing else "no checkpointing")
        )
        return ", ".join(parts)


@dataclass(frozen=True)
class Item:
    """One line of a breakdown: bytes per rank, where they live, and when they are allocated.

    when: "resident" (from initialisation or the first step on), "forward" (from the forward through the
    backward), "backward" (from the first gradient of the backward on), "gradients" (from the first gradient
    through the optimizer step), "step" (during the optimizer step only), "start" (at the forward's start,
    before any activation: FSDP2's first block), "load" (while the model loads) or "generate" (while
    generating: the whole model gathered for generation, lorakit.planner.generation).
    """

    name: str
    bytes: int
    where: str
    when: str
    note: str = ""
    # "state": model states as DeepSpeed's estimators count them (weights, gradients, optimizer state, the
    # layer ZeRO-3 gathers); "buffer": communication buckets; "load": only while loading; "generation": the
    # whole model gathered for generation.
    kind: str = "state"


@dataclass(frozen=True)
class Counts:
    """Parameter counts and byte sizes that do not depend on the setup."""

    total: int
    trainable: int
    frozen_bytes: int
    quant_constants: int
    # Elements of parameters below stage3_param_persistence_threshold: ZeRO-3 keeps them whole on every
    # rank, besides their partition.
    persistent_frozen: int
    persistent_trainable: int
    largest_module: int
    largest_trainable_module: int
    # What ZeRO-3 gathers at once in training: the largest module, an adapter layer counted whole with its
    # base linear (backends/zero3_leaves.py). Loading (zero.Init) comes before the adapter: largest_module.
    largest_gathered: int
    # QLoRA: the weights stored in 4 bits, of them the fused MoE experts' (lorakit.model.quant_experts), and
    # the weights left in the compute dtype (embeddings, norms, routers, the output head).
    quantized_params: int = 0
    quantized_experts: int = 0
    unquantized_params: int = 0

    def frozen_note(self, dtype_bytes: int) -> str:
        """What the frozen base's bytes are made of, for the plan's line: which weights are 4-bit."""
        if not self.quant_constants:
            return ""
        if not self.quantized_experts:
            return "4-bit linear layers"
        return moe_frozen_note(
            self.quantized_params, self.quantized_experts, self.unquantized_params, dtype_bytes
        )


def lora_matrices(arch: Arch, r: int, target_modules) -> list[int]:
    """Element counts of the LoRA matrices (A: r x in, B: out x r) peft adds for rank r."""
    out = []
    for lin in arch.lora_targets(target_modules):
        out += [r * lin.in_features, r * lin.out_features]
    return out


def adapter_params(arch: Arch, method) -> list[int]:
    """Element counts of every trainable tensor peft adds for an adapter method: LoRA's A and B (DoRA: and
    a magnitude per output feature), IA3's vector per layer (its output features, or a feedforward
    layer's input features), and a full trainable copy of each of method.modules_to_save."""
    if method.kind == "ia3":
        out = [lin.in_features if ff else lin.out_features for lin, ff in arch.ia3_targets(
            method.target_modules, method.feedforward_modules)]  # fmt: skip
    else:
        out = lora_matrices(arch, method.r, method.target_modules) + parameter_lora(arch, method)
        if method.use_dora:
            out += [lin.out_features for lin in arch.lora_targets(method.target_modules)]
    return out + arch.module_copy_params(method.modules_to_save or ())


def largest_adapter_layer(arch: Arch, method) -> int:
    """The most parameters one adapter layer holds, its base linear with the adapter's own: ZeRO-3 gathers
    each adapter layer whole (lorakit/backends/zero3_leaves.py)."""
    if method.kind == "ia3":
        layers = [(lin, lin.in_features if ff else lin.out_features)
                  for lin, ff in arch.ia3_targets(method.target_modules, method.feedforward_modules)]  # fmt: skip
    else:
        dora = 1 if method.use_dora else 0
        layers = [(lin, method.r * (lin.in_features + lin.out_features) + dora * lin.out_features)
                  for lin in arch.lora_targets(method.target_modules)]  # fmt: skip
    return max((lin.in_features * lin.out_features + lin.bias * lin.out_features + own for lin, own in layers),
               default=0)  # fmt: skip


def counts(arch: Arch, method, dtype_bytes: int, persistence_threshold: int | None) -> Counts:
    """Trainable and frozen parameters and the bytes of the frozen base for a method section."""

    def small(numels) -> int:
        return sum(n for n in numels if persistence_threshold is not None and n < persistence_threshold)

    if method.kind == "full":
        return Counts(
            total=arch.total_params,
            trainable=arch.total_params,
            frozen_bytes=0,
            quant_constants=0,
            persistent_frozen=0,
            persistent_trainable=small(arch.param_numels),
            largest_module=arch.largest_module_params,
            largest_trainable_module=arch.largest_module_params,
            largest_gathered=arch.largest_module_params,
        )
    lora = adapter_params(arch, method)
    frozen_bytes = arch.total_params * dtype_bytes
    constants = 0
    if method.kind == "qlora":
        quantized = arch.quantized_linears()
        # The fused experts too (lorakit.model.quant_experts): one code table per stack of experts.
        experts, stacks = quantized_experts(arch)
        n = sum(lin.in_features * lin.out_features for lin in quantized) + experts
        frozen_bytes -= int(n * (dtype_bytes - QUANT_BYTES_PER_WEIGHT))
        constants = int(n * QUANT_CONSTANT_BYTES_PER_WEIGHT) + QUANT_CODE_BYTES * (len(quantized) + stacks)
        extra = {"quantized_params": n, "quantized_experts": experts,
                 "unquantized_params": arch.total_params - n}  # fmt: skip
    else:
        extra = {}
    return Counts(
        total=arch.total_params + sum(lora),
        trainable=sum(lora),
        frozen_bytes=frozen_bytes,
        quant_constants=constants,
        persistent_frozen=small(arch.param_numels),
        persistent_trainable=small(lora),
        largest_module=arch.largest_module_params,
        largest_trainable_module=max(lora, default=0),
        largest_gathered=max(arch.largest_module_params, largest_adapter_layer(arch, method)),
        **extra,
    )


def model_states(
    c: Counts, setup: Setup, *, world: int, dtype_bytes: int, ds_config: dict, partitioned_init: bool
) -> list[Item]:
    """The per-rank model-state items of `setup` on `world` ranks (see the module docstring)."""
    a, s = dtype_bytes, setup.zero_stage
    opt_where = "gpu" if setup.offload_optimizer == "none" else setup.offload_optimizer
    par_where = "gpu" if setup.offload_params == "none" else setup.offload_params
    shard_w = world if s == 3 else 1
    shard_g = world if s >= 2 else 1
    shard_o = world if s >= 1 else 1
    # ZeRO-3 keeps small parameters whole on every rank, on top of their partition.
    extra_frozen = c.persistent_frozen * a if s == 3 else 0
    extra_trainable = c.persistent_trainable * a if s == 3 else 0
    items = []
    if c.frozen_bytes:
        note = c.frozen_note(a)
        items.append(Item("frozen base weights", int(c.frozen_bytes / shard_w) + extra_frozen, par_where,
                          "resident", note))  # fmt: skip
    if c.quant_constants:
        items.append(Item("4-bit quantization constants", c.quant_constants, "gpu", "resident",
                          "not partitioned: every rank keeps a copy"))  # fmt: skip
    items.append(Item("trainable weights", int(c.trainable * a / shard_w) + extra_trainable, par_where,
                      "resident"))  # fmt: skip
    hpz = ds_config["zero_optimization"].get("zero_hpz_partition_size", 1)
    if s == 3 and hpz > 1:
        # ZeRO++ hpZ: a second partition of every weight over the hpz ranks of a node (where the all-gathers
        # stay), in the weights' own dtype and on their device (offload_params: the CPU).
        items.append(Item("hpZ secondary weight partition", int((c.frozen_bytes + c.trainable * a) / hpz),
                          par_where, "resident", f"weights / {hpz}"))  # fmt: skip
    if s == 3:
        # A flat gradient partition, allocated at initialisation (on the CPU with optimizer offload).
        items.append(Item("gradients", int(c.trainable * a / shard_g), opt_where, "resident"))
    elif setup.offload_optimizer == "none":
        # Stages 0-2 make gradients in backward and free them after the step; with offload, ZeRO-1/2
        # reduce them straight into the fp32 gradients on the CPU.
        items.append(Item("gradients", int(c.trainable * a / shard_g), "gpu", "gradients"))
    # fp32 training on stage 0: torch's AdamW steps the fp32 weights themselves, no master copy, and the
    # gradients are fp32 already.
    plain = s == 0 and a == 4
    if not plain:
        items.append(Item("fp32 master weights", int(c.trainable * 4 / shard_o), opt_where, "resident"))
    items.append(Item("Adam states (fp32)", int(c.trainable * 8 / shard_o), opt_where, "resident"))
    if not plain:
        items.append(Item("fp32 gradients", int(c.trainable * 4 / shard_o), opt_where, "step"))
    items += zero_buffers(c, setup, world=world, dtype_bytes=a, ds_config=ds_config)
    items += loading(c, dtype_bytes=a, partitioned_init=partitioned_init)
    return items


def zero_buffers(c: Counts, setup: Setup, *, world: int, dtype_bytes: int, ds_config: dict) -> list[Item]:
    """DeepSpeed's working buffers: ZeRO-3's gathered layer and buckets, ZeRO-1/2's reduce buckets."""
    zero = ds_config.get("zero_optimization", {})
    a, s = dtype_bytes, setup.zero_stage
    items = []
    if s == 3:
        gathered = zero3_gathered(c.largest_gathered, c.total, zero)
        items.append(Item("ZeRO-3 gathered weights", int(gathered * a), "gpu", "forward",
                          "largest layer + prefetch bucket + reuse window, at most the model"))  # fmt: skip
        items.append(
            Item("ZeRO-3 gathered gradients", int(c.largest_trainable_module * a), "gpu", "backward")
        )
        if zero.get("contiguous_gradients", True):
            bucket = min(int(zero.get("reduce_bucket_size", 5e8)), max(c.trainable, 1))
            items.append(Item("ZeRO-3 reduce bucket", bucket * a, "gpu", "resident", kind="buffer"))
    elif s in (1, 2) and zero.get("contiguous_gradients", True):
        # DeepSpeed allocates the whole bucket (default 5e8 elements), however few parameters train, and a
        # second one with overlap_comm.
        n = int(zero.get("reduce_bucket_size", 5e8)) * (2 if zero.get("overlap_comm", False) else 1)
        items.append(Item(f"ZeRO-{s} reduce buckets", n * a, "gpu", "backward",
                          "reduce_bucket_size x (2 with overlap_comm)", kind="buffer"))  # fmt: skip
    return items


def zero3_gathered(largest_module: int, total: int, zero: dict) -> int:
    """Elements ZeRO-3 holds gathered at once on a rank: the module in use, what the prefetcher fetches ahead
    (its bucket, within stage3_max_live_parameters), and the parameters kept for a reuse within
    stage3_max_reuse_distance; never more than the whole model. DeepSpeed's defaults (1e9 each) keep any model
    under a billion parameters whole (engine/deepspeed_config.py zero3_limits)."""
    prefetch = min(
        int(zero.get("stage3_prefetch_bucket_size", 5e7)), int(zero.get("stage3_max_live_parameters", 1e9))
    )
    reuse = int(zero.get("stage3_max_reuse_distance", 1e9))
    return min(total, largest_module + prefetch + reuse)


def loading(c: Counts, *, dtype_bytes: int, partitioned_init: bool) -> list[Item]:
    """Memory while the base model loads, before training starts."""
    whole = c.frozen_bytes + c.quant_constants + c.trainable * dtype_bytes
    if c.quant_constants:
        # transformers quantizes while loading, each rank onto its own GPU, whole; deepspeed.initialize
        # partitions it afterwards (ZeRO-3).
        if c.quantized_experts:
            # An MoE's 4-bit base loads in CPU RAM (model/build.py): its fused experts come in model.dtype and are
            # quantized there, and the backend moves the 4-bit model to the GPU.
            peak = whole + int(c.quantized_experts * (dtype_bytes - QUANT_BYTES_PER_WEIGHT))
            return [Item("whole model in each process's CPU RAM while loading", peak, "cpu", "load",
                         "the fused experts in model.dtype until quantized, then moved to its GPU", kind="load")]  # fmt: skip
        return [Item("whole 4-bit model on each GPU while loading", whole, "gpu", "load", kind="load")]
    if partitioned_init:
        # zero.Init: every rank materialises one layer at a time and keeps only its partition.
        return [Item("one layer in fp32 while loading (zero.Init)", c.largest_module * 4, "cpu", "load",
                     kind="load")]  # fmt: skip
    return [Item("whole model in each process's CPU RAM while loading", whole, "cpu", "load",
                 "then moved to its GPU", kind="load")]  # fmt: skip
