"""lorakit.plan: will a recipe fit, per GPU and per node's CPU RAM, and what is the best setup that does.

Reads the model's config only (never weights), applies the byte model of states.py and activations.py to
the recipe's setup and to the alternatives search.py lists, and returns a MemoryPlan.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from lorakit.backends import backend_for
from lorakit.model.sequence_parallel import check_sequence_parallel
from lorakit.model.tiled_loss import planned_loss_tile
from lorakit.model.tiled_mlp import planned_tile
from lorakit.objectives import objective_type
from lorakit.planner.activations import Activations, Kernels, Shape, activations
from lorakit.planner.arch import Arch, arch_from_config, resolve_config
from lorakit.planner.byte_models import PlannedBytes
from lorakit.planner.checkpointing import Checkpointing, choose, with_checkpointing
from lorakit.planner.generation import Generation, generation_ways, planned_generation
from lorakit.planner.moe import moe_notes
from lorakit.planner.rollouts import RolloutPlan, completions_per_prompt, planned_rollouts, rollout_shape
from lorakit.planner.search import ROW_STEP, longest_row, overrides, recipe_setup, recommend, slowdown
from lorakit.planner.shapes import attention_label, micro_batch_shape, positive
from lorakit.planner.states import Item, Setup, counts
from lorakit.planner.units import HEADROOM, PlanError, parse_bytes
from lorakit.recipe.objective_spec import SFT

GiB = 2**30
# Framework overhead, stated as assumptions (docs/planning.md): what a GPU process holds besides the tensors
# torch.cuda.max_memory_allocated counts (CUDA context, cuBLAS workspaces, NCCL buffers), the allocator's
# fragmentation on top of the allocated peak, and a training process's resident CPU memory (Python, torch,
# CUDA libraries, DeepSpeed, transformers, the data loader).
CUDA_CONTEXT_BYTES = 1 * GiB
FRAGMENTATION = 0.05
PROCESS_CPU_BYTES = 3 * GiB
# A CPU run's process holds no CUDA libraries: ~0.5 GiB of runtime measured per rank (Python, torch,
# DeepSpeed, transformers, the data loader; the retired benchmarks/rehearsal.py (git 26ed32f), tiny and FLAN-T5-XL-width models, with
# the launcher's allocator settings).
CPU_RUN_PROCESS_BYTES = GiB // 2
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Estimate:
    """The memory of one setup, per GPU (allocated peak + framework overhead) and per node (CPU RAM)."""

    setup: Setup
    items: tuple[Item, ...]
    activations: Activations
    shape: Shape
    # Peak of the tensors torch allocates on one GPU: the number torch.cuda.max_memory_allocated reports.
    gpu_allocated: int
    gpu_overhead: int
    per_gpu_bytes: int
    per_node_cpu_bytes: int
    nvme_bytes: int
    fits_gpu: bool | None
    fits_cpu: bool | None
    slowdown: float
    # train.objective grpo: what generating the rollouts holds and the time split (lorakit.planner.rollouts).
    rollouts: RolloutPlan | None = None
    # What generating (eval predictions, GRPO) does with sharded weights (lorakit.planner.generation).
    generation: Generation | None = None

    @property
    def fits(self) -> bool | None:
        """GPU and CPU verdicts combined; None when the GPU memory is unknown."""
        if self.fits_gpu is None:
            return None
        return self.fits_gpu and self.fits_cpu is not False

    def model_state_bytes(self, where: str = "gpu") -> int:
        """Per rank: weights, gradients, optimizer state and the layer ZeRO-3 gathers, on `where` ("gpu",
        "cpu", "nvme"), all counted at once (what DeepSpeed's estimators count; no activations, buckets or
        loading)."""
        return sum(i.bytes for i in self.items if i.where == where and i.kind == "state")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary of this estimate."""
        a = self.activations
        return {
            "setup": asdict(self.setup),
            "fits": self.fits,
            "fits_gpu": self.fits_gpu,
            "fits_cpu": self.fits_cpu,
            "per_gpu_bytes": self.per_gpu_bytes,
            "gpu_allocated_bytes": self.gpu_allocated,
            "gpu_overhead_bytes": self.gpu_overhead,
            "per_node_cpu_bytes": self.per_node_cpu_bytes,
            "nvme_bytes": self.nvme_bytes,
            "slowdown": round(self.slowdown, 3),
            "shape": {
                "rows": self.shape.rows,
                "seq_len": self.shape.seq_len,
                "target_len": self.shape.target_len,
            },
            "activations": {
                "kept": a.kept,
                "head": a.head,
                "logits": a.logits,
                "recompute": a.recompute,
                "peak": a.peak,
                "at_loss": a.at_loss,
                "in_layers": a.in_layers,
                "quadratic_per_layer": a.quadratic_per_layer,
                "no_grad_forward": a.no_grad_forward,
                "checkpointed_blocks": a.checkpointed,
            },  # fmt: skip
            "items": [asdict(i) for i in self.items],
            "rollouts": self.rollouts.to_dict() if self.rollouts else None,
            "generation": self.generation.to_dict() if self.generation else None,
        }


@dataclass(frozen=True)
class MemoryPlan:
    """The plan for one recipe on given hardware: the recipe's own setup and the best setup that fits."""

    model: str
    method: str
    dtype: str
    gpus: int
    nodes: int
    gpu_memory: int | None
    cpu_memory: int | None
    device: str
    attention: str
    total_params: int
    trainable_params: int
    estimate: Estimate
    recommendation: Estimate | None
    recommended_overrides: tuple[str, ...]
    assumptions: tuple[str, ...] = field(default=())
    # Causal LMs on packed rows, with gpu_memory given: the longest row (one document filling it) that the
    # recipe's setup trains with headroom, at its distributed.sequence_parallel; None otherwise.
    longest_row: int | None = None
    sequence_parallel: int = 1
    # distributed.timeout_minutes: how long a collective waits for a stalled or dead rank (docs/faults.md).
    timeout_minutes: float | None = None
    # train.objective: what its objective adds is asked of it (DPO: two sequences a pair, a reference pass).
    objective: str = SFT.name
    # model.gradient_checkpointing resolved for this run (auto: lorakit.planner.checkpointing's choice).
    checkpointing: Checkpointing | None = None

    @property
    def fits(self) -> bool | None:
        """Whether the recipe as written fits (GPU and CPU RAM); None when the GPU memory is unknown."""
        return self.estimate.fits

    @property
    def per_gpu_bytes(self) -> int:
        """Peak bytes on each GPU for the recipe as written, framework overhead included."""
        return self.estimate.per_gpu_bytes

    @property
    def per_node_cpu_bytes(self) -> int:
        """Peak CPU RAM per node for the recipe as written (offloaded states, loading, processes)."""
        return self.estimate.per_node_cpu_bytes

    def to_dict(self) -> dict[str, Any]:
        """The machine-readable plan (`--json`)."""
        rec = self.recommendation
        return {
            "model": self.model,
            "method": self.method,
            "dtype": self.dtype,
            "gpus_per_node": self.gpus,
            "nodes": self.nodes,
            "gpu_memory": self.gpu_memory,
            "cpu_memory": self.cpu_memory,
            "device": self.device,
            "attention": self.attention,
            "total_params": self.total_params,
            "trainable_params": self.trainable_params,
            "fits": self.fits,
            "per_gpu_bytes": self.per_gpu_bytes,
            "per_node_cpu_bytes": self.per_node_cpu_bytes,
            # Fits, but with less free memory than the planner's tolerance: may OOM after all.
            "tight": None
            if self.gpu_memory is None
            else bool(self.fits and self.per_gpu_bytes > HEADROOM * self.gpu_memory),
            "recipe": self.estimate.to_dict(),
            "recommended": None
            if rec is None
            else {**rec.to_dict(), "overrides": list(self.recommended_overrides)},
            "assumptions": list(self.assumptions),
            "longest_row": self.longest_row,
            "sequence_parallel": self.sequence_parallel,
            "timeout_minutes": self.timeout_minutes,
            "objective": self.objective,
            "gradient_checkpointing": self.checkpointing.to_dict() if self.checkpointing else None,
        }

    def describe(self) -> str:
        """The terminal report: breakdown, verdict and recommendation."""
        from lorakit.planner.report import describe

        return describe(self)


def _recipe(recipe):
    from lorakit.recipe import Recipe, load_recipe

    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str | Path):
        return load_recipe(recipe)
    raise PlanError(f"plan: expected a Recipe or the path of a recipe YAML file, got {type(recipe).__name__}")


def cpu_training_bytes(items) -> int:
    """What the model-state `items` keep in CPU RAM while training: the offloaded states, their gradients
    and the optimizer step's (not what loading holds)."""
    return sum(i.bytes for i in items if i.where == "cpu" and i.when in ("resident", "gradients", "step"))


def plan(
    recipe,
    *,
    gpus: int | None = None,
    gpu_memory: int | str | None = None,
    nodes: int = 1,
    cpu_memory: int | str | None = None,
    config=None,
    seq_len: int | None = None,
    target_len: int | None = None,
    device: str = "cuda",
) -> MemoryPlan:
    """Plan `recipe` (a Recipe or a YAML path) on `nodes` nodes of `gpus` GPUs (default: the recipe's
    distributed.num_processes) with `gpu_memory` bytes each ("40GB", "80GiB") and `cpu_memory` bytes of RAM
    per node. `config`: the model's transformers config, when the caller has it. `seq_len` / `target_len`
    stand in for `auto` data lengths (default: the model's maximum). `device`: "cuda" plans for GPUs;
    "cpu" models PyTorch's CPU kernels and no CUDA overhead (for checking the plan against CPU runs)."""
    recipe = _recipe(recipe)
    gpus = positive(recipe.distributed.num_processes if gpus is None else gpus, "gpus")
    nodes = positive(nodes, "nodes")
    if device not in ("cuda", "cpu"):
        raise PlanError(f"device: expected 'cuda' or 'cpu', got {device!r}")
    gpu_cap = parse_bytes(gpu_memory, "gpu_memory")
    cpu_cap = parse_bytes(cpu_memory, "cpu_memory")
    config = resolve_config(recipe, config)
    check_sequence_parallel(recipe.distributed.sequence_parallel, config)
    # The run's attention-probability dropout is model.attention_dropout (build.set_attention_dropout), not
    # the config's (FLAN-T5's dropout_rate 0.1 stays for hidden states only).
    arch = replace(
        arch_from_config(config, recipe.model.trust_remote_code),
        attention_dropout=recipe.model.attention_dropout,
    )
    a = _DTYPE_BYTES[recipe.model.dtype]
    notes: list[str] = [arch.caveat()] if arch.unproven else []  # the generic family's "not proven"
    notes += moe_notes(arch, recipe.method)
    shape, kernels, min_tokens = rollout_shape(recipe, arch, seq_len, target_len, device, notes) or (
        micro_batch_shape(recipe, arch, seq_len, target_len, device, notes)
    )
    world = gpus * nodes
    backend = backend_for(recipe)
    base = recipe_setup(recipe, backend)
    if kernels.packed:
        base = replace(base, max_tokens=shape.seq_len)

    def estimate(setup: Setup, r=recipe) -> Estimate:
        return _estimate(r, arch, a, setup, shape, kernels, world, gpus, gpu_cap, cpu_cap, base, nodes)

    blocks = arch.layers + arch.decoder_layers
    ckpt = choose(recipe.model, base, estimate, gpu_cap if device == "cuda" else None, blocks)
    base = with_checkpointing(base, ckpt)
    own = estimate(base)
    best, extra = None, []
    if gpu_cap is not None:
        # Only setups with headroom for the model's error; generating layer by layer only when no setup fits
        # with the whole model gathered for it.
        ways = generation_ways(recipe, own.generation)
        best, extra = recommend(estimate, base, ways, HEADROOM * gpu_cap, min_tokens, backend.layouts())
    longest = None
    if gpu_cap is not None and kernels.packed and not arch.is_encoder_decoder:

        def fits(tokens: int) -> bool:
            row = replace(shape, seq_len=tokens, example_len=tokens)
            e = _estimate(recipe, arch, a, replace(base, max_tokens=tokens), row, kernels, world, gpus,
                          gpu_cap, cpu_cap, base, nodes)  # fmt: skip
            return bool(e.fits) and e.per_gpu_bytes <= HEADROOM * gpu_cap

        longest = longest_row(fits, step=ROW_STEP * shape.sequence_parallel)
    c = counts(arch, recipe.method, a, None)
    said = (own.rollouts and own.rollouts.note(), own.generation and own.generation.note())
    return MemoryPlan(
        model=recipe.model.name_or_path,
        method=recipe.method.kind,
        dtype=recipe.model.dtype,
        gpus=gpus,
        nodes=nodes,
        gpu_memory=gpu_cap,
        cpu_memory=cpu_cap,
        device=device,
        attention=attention_label(recipe.model.attention, kernels),
        total_params=c.total,
        trainable_params=c.trainable,
        estimate=own,
        recommendation=best,
        recommended_overrides=tuple(overrides(best.setup, recipe, base, backend) + extra) if best else (),
        assumptions=tuple(notes + [n for n in said if n]),
        longest_row=longest,
        sequence_parallel=shape.sequence_parallel,
        timeout_minutes=recipe.distributed.timeout_minutes,
        objective=recipe.train.objective,
        checkpointing=ckpt,
    )


def _estimate(recipe, arch: Arch, a: int, setup: Setup, shape: Shape, kernels: Kernels, world: int, gpus: int,
              gpu_cap, cpu_cap, reference: Setup, nodes: int) -> Estimate:  # fmt: skip
    # The model states: the byte model the recipe's backend shards by, with its parameters.
    items = backend_for(recipe).planned_states(
        setup.layout, PlannedBytes(arch, recipe, setup, world, a), world=world, per_node=gpus,
        hidden_size=arch.hidden, accelerator=kernels.device,
    )  # fmt: skip
    if setup.max_tokens:
        scale = setup.max_tokens / shape.seq_len
        target = round(shape.target_len * scale) if shape.target_len else None
        this = replace(shape, rows=1, seq_len=setup.max_tokens, target_len=target)
    else:
        # The objective's sequences per example (DPO: 2) as rows; encoder-decoders: decoder_passes instead.
        sequences = 1 if arch.is_encoder_decoder else objective_type(recipe).passes(recipe).sequences
        this = replace(shape, rows=sequences * setup.micro_batch_size * completions_per_prompt(recipe))
    if not arch.is_encoder_decoder:
        this = replace(
            this,
            mlp_tile=planned_tile(recipe, this.seq_len, arch.hidden),
            loss_tile=planned_loss_tile(recipe, this.seq_len, arch.vocab, arch.model_type),
        )
    act = activations(
        arch, recipe.method, a, kernels, this, setup.gradient_checkpointing, setup.checkpoint_every
    )

    def total(where: str, when: str) -> int:
        return sum(i.bytes for i in items if i.where == where and i.when == when)

    # Three moments: the start of the backward (the output head's gradients), the backward through the
    # layers (gradients, buckets, a recomputed layer), the optimizer step (fp32 gradients).
    gpu = {w: total("gpu", w) for w in ("resident", "forward", "backward", "gradients", "step", "start")}
    # Before anything of the micro-batch is kept: an objective's no-grad forward (DPO's reference pass, full
    # fine-tuning's pass before training), FSDP2's first block (items "start": the root's all-gather output).
    no_grad = act.no_grad_forward if objective_type(recipe).passes(recipe).no_grad_forward else 0
    # Generating (eval predictions, GRPO) on sharded weights gathers them whole or layer by layer; auto asks
    # what is free beside the resident states, as the first generate call finds it.
    context = CUDA_CONTEXT_BYTES if kernels.device == "cuda" else CPU_RUN_PROCESS_BYTES
    free = None if gpu_cap is None else gpu_cap - context - gpu["resident"]
    gen = planned_generation(recipe, arch, a, setup, world, free)
    if gen is not None and gen.mode == "gathered":
        items.append(gen.item())
    # GRPO generates before it trains: a forward's weights with the rollouts' KV cache and logits.
    rollouts = planned_rollouts(recipe, arch, a, setup, shape, world, gen)
    generating = rollouts.generation_bytes if rollouts else 0
    # While generating: the forward's gathered weights, or the whole model gathered in their place.
    generation_peak = gpu["resident"] + max(gpu["forward"], total("gpu", "generate")) + generating
    gen = gen and replace(gen, peak_bytes=generation_peak)
    train = gpu["resident"] + max(
        gpu["forward"] + act.at_loss,
        gpu["forward"] + gpu["backward"] + gpu["gradients"] + act.in_layers,
        gpu["gradients"] + gpu["step"],
        gpu["forward"] + max(no_grad, gpu["start"]),
    )
    train = max(train, generation_peak)
    allocated = max(train, total("gpu", "load"))
    overhead = int(CUDA_CONTEXT_BYTES + FRAGMENTATION * allocated) if kernels.device == "cuda" else 0
    per_gpu = allocated + overhead
    cpu_train = cpu_training_bytes(items)
    process = CPU_RUN_PROCESS_BYTES if kernels.device == "cpu" else PROCESS_CPU_BYTES
    cpu = gpus * (process + max(cpu_train, total("cpu", "load")))
    if kernels.device == "cpu":
        # Without a GPU, the "GPU" tensors live in the same RAM.
        cpu += gpus * allocated
    return Estimate(
        setup=setup,
        items=tuple(items),
        activations=act,
        shape=this,
        gpu_allocated=allocated,
        gpu_overhead=overhead,
        per_gpu_bytes=per_gpu,
        per_node_cpu_bytes=cpu,
        nvme_bytes=sum(i.bytes for i in items if i.where == "nvme"),
        fits_gpu=None if gpu_cap is None else per_gpu <= gpu_cap,
        fits_cpu=None if cpu_cap is None else cpu <= cpu_cap,
        slowdown=slowdown(setup, reference, adapter=recipe.method.adapter(), nodes=nodes),
        rollouts=rollouts,
        generation=gen,
    )
