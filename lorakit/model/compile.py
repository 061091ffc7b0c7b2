"""Regional torch.compile: each transformer block (decoder layer, T5 block) compiled on its own, its LoRA
branches included, so the elementwise work around the GEMMs (norms, casts, LoRA scale and dropout) fuses.

Why per block and not the whole model: every block of a stack runs the same code, so one compiled graph
serves them all (transformers' blocks take their weights as inputs: torch's inlined nn modules), compile
time stays that of one block, and the loss and the sampler stay outside the graph. Shapes are marked
dynamic, so packed rows whose length changes every step reuse the graph instead of recompiling per length.

Within a block, its parts (attention with its LoRA branches, MLP, norms) are compiled, not the block's
call, because of gradient checkpointing: transformers (5.x, GradientCheckpointingLayer) checkpoints a
block's `forward`, and compiling the block's call puts that checkpoint inside the graph, as a region dynamo
must trace whole; packed attention's host-side planning (lorakit.model.varlen, run eager: a graph break)
inside it made dynamo give up on the block (CPU, torch 2.13: no graph at all, measured). Compiled parts
run inside the eager checkpoint, which recomputes them through their compiled forward.

model.compile (recipe): auto compiles on CUDA only, where the fused elementwise work pays; on a CPU the
compile time (tens of seconds per block kind) outweighs it for short runs, so auto leaves it off.
auto leaves 4-bit bases (bitsandbytes: quantized matmuls break the graph at every layer) and DeepSpeed
ZeRO-3 eager. None of this is measured on a GPU yet (issue 61): benchmarks/gpu_checks.sh has the A/B.
"""

from __future__ import annotations

from typing import Any

import torch


def block_classes(model: torch.nn.Module) -> set[str]:
    """The class names of the model's repeated blocks, as transformers lists them (`_no_split_modules`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return set(getattr(base, "_no_split_modules", None) or ())


def compile_wanted(setting: bool | str, *, cuda: bool, quantized: bool, zero3: bool) -> bool:
    """model.compile resolved: true and false as said; auto on a CUDA device for unquantized bases outside
    DeepSpeed ZeRO-3 (whose parameter-gathering hooks on every submodule would break each block's graph)."""
    if setting == "auto":
        return cuda and not quantized and not zero3
    return bool(setting)


def regions(block: torch.nn.Module) -> list[torch.nn.Module]:
    """The parts of `block` compiled each on its own: its child modules that hold parameters (attention with
    its LoRA branches, the MLP, the norms), a ModuleList's items (T5's layer list) in place of the list."""
    parts = []
    for child in block.children():
        for part in child if isinstance(child, torch.nn.ModuleList) else [child]:
            if next(part.parameters(), None) is not None:
                parts.append(part)
    return parts


def compile_blocks(model: torch.nn.Module, *, dynamic: bool = True, backend: str = "inductor") -> dict:
    """Compile the regions of every block of `model` in place (nn.Module.compile: the module's calls go
    through the compiled forward; its parameters, hooks and state dict are unchanged). Returns {blocks,
    regions, classes, backend, baseline}: the compilation itself happens at the first call; baseline is
    compile_stats() now, which compile_summary subtracts."""
    classes = block_classes(model)
    blocks = [m for m in model.modules() if type(m).__name__ in classes]
    parts = [part for block in blocks for part in regions(block)]
    for part in parts:
        part.compile(dynamic=dynamic, backend=backend)
    return {
        "blocks": len(blocks),
        "regions": len(parts),
        "classes": sorted(classes),
        "backend": backend,
        "baseline": compile_stats(),
    }


def compile_stats() -> dict[str, Any]:
    """What dynamo did in this process so far: graphs compiled (a recompilation for a new shape or guard
    adds one), graph breaks and the seconds spent compiling (dynamo's own timers: frame compiles and the backward graphs' lazy compiles)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(
        sum(times)
        for key, times in compilation_time_metrics.items()
        if key in ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")
    )
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "compile_seconds": round(seconds, 3),
    }


def compile_summary(info: dict | None) -> dict[str, Any] | None:
    """summary.json's `compile`: None when no block was compiled, else compile_blocks' answer and what
    dynamo did since (graphs, graph_breaks, compile_seconds)."""
    if info is None:
        return None
    info = dict(info)
    before = info.pop("baseline")
    return {**info, **{k: round(v - before[k], 3) for k, v in compile_stats().items()}}
