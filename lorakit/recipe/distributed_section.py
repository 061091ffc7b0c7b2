"""The recipe's distributed section: DeepSpeed ZeRO (the default) or PyTorch FSDP2 over processes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, model_validator

from lorakit.recipe.fsdp_section import FsdpSection
from lorakit.recipe.section import Section

# The sharding backends' checks of a whole validated recipe (ValueError naming the field), which lorakit
# installs from lorakit.backends when it is imported: the recipe package cannot import the backends it
# validates for (a floor up), and every process imports lorakit before it validates a recipe.
_BACKEND_CHECKS: list[Callable[[Any], None]] = []
# The functions whose ValueErrors those checks raise, for docs/recipes.md (reference.py reads their source).
_BACKEND_RULES: list[Callable[[Any], None]] = []


def install_backend_checks(
    check: Callable[[Any], None], rules: tuple[Callable[[Any], None], ...] = ()
) -> None:
    """Run `check(recipe)` on every recipe, once its sections are valid (lorakit.backends.check_recipe);
    `rules`: the functions whose ValueErrors it raises, as docs/recipes.md lists them."""
    if check not in _BACKEND_CHECKS:
        _BACKEND_CHECKS.append(check)
        _BACKEND_RULES.extend(rules)


def backend_rules() -> list[Callable[[Any], None]]:
    """The functions that raise the installed backend checks' ValueErrors (docs/recipes.md lists them)."""
    return list(_BACKEND_RULES)


def check_backend(recipe) -> None:
    """The recipe's sharding backend's checks (ValueError); RuntimeError when none were installed."""
    if not _BACKEND_CHECKS:
        raise RuntimeError("no backend checks installed: importing lorakit installs lorakit.backends' checks")
    for check in _BACKEND_CHECKS:
        check(recipe)


# The ZeRO++ keys of DistributedSection (zero_stage 3 only); deepspeed_config.py writes them.
ZERO_PLUS_PLUS = ("hpz_partition_size", "quantized_weights", "quantized_gradients")


class DistributedSection(Section):
    """How the work is spread over processes: DeepSpeed ZeRO (the default) or PyTorch FSDP2."""

    num_processes: int = Field(
        1, ge=1, description="Processes per node; `python -m lorakit.run` starts torchrun when it needs more."
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(3, description="DeepSpeed ZeRO stage.")
    offload_optimizer: Literal["none", "cpu", "nvme"] = Field(
        "none", description="Where ZeRO keeps optimizer state."
    )
    offload_params: Literal["none", "cpu", "nvme"] = Field(
        "none", description="Where ZeRO-3 keeps parameters between uses."
    )
    nvme_path: str | None = Field(None, description="Directory on a fast local disk for nvme offload.")
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="torch.distributed backend; auto: nccl on GPUs, gloo on CPU."
    )
    hpz_partition_size: int = Field(
        1,
        ge=1,
        description="ZeRO++ hierarchical partitioning (hpZ, zero_stage 3): each process also keeps a secondary "
        "copy of the parameters partitioned over a group of this many consecutive ranks, so the forward and "
        "backward all-gathers stay inside the group; set it to the processes (GPUs) per node when the nodes "
        "lack a fast interconnect such as InfiniBand. Costs params x dtype bytes / hpz_partition_size more "
        "memory per process. Must divide the processes per node (checked at start). 1: off. See "
        "docs/multinode.md#zero.",
    )
    quantized_weights: bool = Field(
        False,
        description="ZeRO++ qwZ (zero_stage 3): all-gather the parameters in int8 instead of model.dtype, "
        "halving that traffic. Needs GPUs (DeepSpeed's CUDA quantizer kernels); refused on CPU.",
    )
    quantized_gradients: bool = Field(
        False,
        description="ZeRO++ qgZ (zero_stage 3): reduce-scatter the gradients in int4 with a two-step "
        "all-to-all (within, then across nodes). Needs GPUs (DeepSpeed's CUDA quantizer kernels); refused on "
        "CPU.",
    )
    # issue 38: no hang, ever.
    timeout_minutes: float = Field(
        30.0,
        gt=0,
        description="How long a collective (all-reduce, barrier, broadcast) waits for every process before it "
        "fails with an error naming the phase and step it was in, instead of hanging: covers a process that "
        "stalls or dies without its peers noticing (another node, a lost network). Raise it when one "
        "process legitimately works alone for longer (rank 0 tokenizing a large dataset that "
        "`python -m lorakit.prepare` did not cache beforehand). See docs/faults.md.",
    )

    sequence_parallel: int = Field(
        1,
        ge=1,
        description="Sequence parallelism (DeepSpeed Ulysses): each packed row is split along the sequence "
        "over this many consecutive ranks, which exchange attention heads with all-to-alls; each rank holds "
        "1/N of the row's activations, so rows N times longer train. The ranks of a group see the same "
        "rows (the data-parallel replicas are the groups). Causal LMs with packed rows on sdpa or "
        "flash_attention_2; must divide distributed.num_processes and the model's attention and key/value "
        "heads (checked when the model config loads). 1: off. See docs/long-context.md.",
    )

    gather_for_generation: bool | Literal["auto"] = Field(
        "auto",
        description="ZeRO-3 and FSDP2: generating (eval predictions, GRPO rollouts) gathers the whole model "
        "once per generate call and decodes on it, instead of gathering every layer again at each decoding "
        "step (ZeRO-3's eval generation 6x faster on 2 CPU processes; docs/backends.md#generation). true: "
        "always (the whole model must fit beside the training state); false: layer by layer (a model that only "
        "fits sharded); auto: gather when what it adds fits in half the device memory free on every rank. The "
        "planner counts the gathered model in the generation peak (docs/planning.md).",
    )

    # issue 36: the sharding backend.
    strategy: Literal["deepspeed", "fsdp"] = Field(
        "deepspeed",
        description="The sharding backend: deepspeed (ZeRO, the zero_stage and offload keys) or fsdp (PyTorch "
        "FSDP2, the distributed.fsdp section). The same recipe trains on either. See docs/backends.md.",
    )
    fsdp: FsdpSection = Field(FsdpSection(), description="strategy fsdp: how FSDP2 shards the model.")

    @model_validator(mode="after")
    def _check(self) -> DistributedSection:
        if self.sequence_parallel > 1 and self.num_processes % self.sequence_parallel:
            raise ValueError(
                f"distributed.sequence_parallel {self.sequence_parallel} must divide the processes per node "
                f"(distributed.num_processes {self.num_processes}): a row is split over ranks of one node"
            )
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ValueError("distributed.offload_optimizer needs zero_stage 1, 2 or 3")
        if self.offload_params != "none" and self.zero_stage != 3:
            raise ValueError("distributed.offload_params needs zero_stage 3")
        if "nvme" in (self.offload_optimizer, self.offload_params) and not self.nvme_path:
            raise ValueError("distributed.nvme_path is required when offloading to nvme")
        asked = [k for k in ZERO_PLUS_PLUS if getattr(self, k) != type(self).model_fields[k].default]
        if asked and self.zero_stage != 3:
            key = asked[0]
            raise ValueError(
                f"distributed.{key} is a ZeRO++ option of ZeRO stage 3 (it partitions or quantizes "
                f"the stage-3 parameter and gradient exchange); set distributed.zero_stage: 3 or remove it"
            )
        if self.hpz_partition_size > 1 and self.offload_params == "nvme":
            # DeepSpeed 0.19 allocates the secondary partition with torch.empty(device=<offload device>),
            # which fails for "nvme" (partition_parameters.py, _partition_param_sec).
            raise ValueError(
                "distributed.hpz_partition_size > 1 cannot be combined with offload_params: nvme: DeepSpeed "
                "keeps hpZ's secondary parameter partition on the offload device and cannot allocate it on "
                "nvme; offload_params to cpu, or hpz_partition_size: 1"
            )
        if self.num_processes > 1 and self.num_processes % self.hpz_partition_size:
            raise ValueError(
                f"distributed.hpz_partition_size {self.hpz_partition_size} must divide the processes per node "
                f"(distributed.num_processes {self.num_processes}); set it to {self.num_processes} (or a "
                "divisor of it)"
            )
        return self
