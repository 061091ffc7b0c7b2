"""A CPU run's memory per process and per phase: what benchmarks/rehearsal.py measured the plan against
(retired at 26ed32f; its results in benchmarks/README.md).

    load        the runtime, the resident model states (each rank's partition of the weights, as zero.Init
                builds it, or FSDP2's shards) and what loading adds (zero.Init: one layer in fp32; FSDP2's
                sharded loading: one tensor's rows)
    step        the estimate's training peak: every model state, ZeRO-3's gathered weights and buckets (FSDP2:
                its gathered root and blocks, reduce-scatter buffers), the activations (the first step and the
                steady state alike)
    save        the resident states and the trainable weights gathered whole in model.dtype (the adapter's or
                the 16-bit model's consolidated state dict)
    merge       the streaming merge (export/stream_job.py) as its own process: its runtime, the largest
                adapted matrix as read in model.dtype and twice in float32 (the copy and W + scale * B A),
                and the adapter in float32

On a CPU run the "GPU" tensors share the RAM, so each phase counts them with the CPU ones.
"""

from __future__ import annotations

from lorakit.planner.core import _DTYPE_BYTES, CPU_RUN_PROCESS_BYTES, Estimate, GiB, cpu_training_bytes, plan
from lorakit.planner.states import adapter_params

# `python -m lorakit.merge`'s process without the tensors it merges: Python, torch, transformers, safetensors
# (0.38 GiB measured at FLAN-T5-XL and Llama-3-8B width, benchmarks/README.md's rehearsal section).
MERGE_PROCESS_BYTES = int(0.4 * GiB)


def step_bytes(e: Estimate) -> int:
    """Per process, the training peak of a CPU run: runtime, the CPU-side states and the estimate's training
    peak. Not what loading held (the estimate's per-node RAM is the peak over the whole run, loading
    included: at Llama-3-8B width the embedding read in fp32 is 2 GiB more than any step holds)."""
    return CPU_RUN_PROCESS_BYTES + cpu_training_bytes(e.items) + e.gpu_allocated


def load_bytes(e: Estimate) -> int:
    """Per process, while the model loads (and DeepSpeed initialises): runtime, resident states, loading."""
    resident = sum(i.bytes for i in e.items if i.when == "resident")
    return CPU_RUN_PROCESS_BYTES + resident + sum(i.bytes for i in e.items if i.when == "load")


def save_bytes(e: Estimate, trainable: int, dtype_bytes: int) -> int:
    """Per process, while saving: runtime, resident states and the trainable weights gathered whole."""
    resident = sum(i.bytes for i in e.items if i.when == "resident")
    return CPU_RUN_PROCESS_BYTES + resident + trainable * dtype_bytes


def merge_bytes(largest_adapted: int, adapter: int, dtype_bytes: int) -> int:
    """The streaming merge's peak: its runtime, the largest adapted matrix (`largest_adapted` elements) read
    in the base's dtype and held twice in float32, and the adapter's `adapter` elements in float32."""
    return MERGE_PROCESS_BYTES + largest_adapted * (dtype_bytes + 8) + adapter * 4


def cpu_phases(recipe, *, config=None) -> dict[str, int]:
    """Planned bytes per process of each phase of `recipe` run on CPUs (as the retired benchmarks/rehearsal.py ran them):
    load, first_step, steady, save, merge."""
    from lorakit.planner.arch import arch_from_config, resolve_config
    from lorakit.planner.core import _recipe

    recipe = _recipe(recipe)
    config = resolve_config(recipe, config)
    p = plan(recipe, device="cpu", config=config)
    e, a = p.estimate, _DTYPE_BYTES[recipe.model.dtype]
    step = step_bytes(e)
    out = {"load": load_bytes(e), "first_step": step, "steady": step,
           "save": save_bytes(e, p.trainable_params, a)}  # fmt: skip
    method = recipe.method
    if method.kind in ("lora", "qlora"):
        arch = arch_from_config(config, recipe.model.trust_remote_code)
        targets = arch.lora_targets(method.target_modules)
        largest = max((lin.in_features * lin.out_features for lin in targets), default=0)
        out["merge"] = merge_bytes(largest, sum(adapter_params(arch, method)), a)
    return out
