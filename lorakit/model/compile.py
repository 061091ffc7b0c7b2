"""Regional torch.compile: each transformer block (decoder layer, T5 block) compiled on its own, its LoRA
branches included, so the elementwise work around the GEMMs (norms, casts, LoRA scale and dropout) fuses.

Why per block and not the whole model: every block of a stack runs the same code, so one compiled graph
serves them all (transformers' blocks take their weights as inputs: torch's inlined nn modules), compile
time stays that of one block, and the loss, the sampler and gradient checkpointing stay outside the graph.
Shapes are marked dynamic, so packed rows whose length changes every step reuse the graph instead of
recompiling per length.

Not yet wired into build_model (issue 61): `compile_blocks` is the building block the recipe setting will
call. Open: under transformers' non-reentrant gradient checkpointing the compiled forward runs inside
checkpoint's saved-tensor hooks, where dynamo captured 4 calls of a tiny Llama's step against 315 without
checkpointing (CPU, torch 2.13): the composition needs the checkpoint inside the compiled region (compile
the checkpointed call, as torchtitan orders them), measured before the setting goes on.
"""

from __future__ import annotations

import time

import torch


def block_classes(model: torch.nn.Module) -> set[str]:
    """The class names of the model's repeated blocks, as transformers lists them (`_no_split_modules`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return set(getattr(base, "_no_split_modules", None) or ())


def compile_blocks(model: torch.nn.Module, *, dynamic: bool = True) -> dict:
    """Compile every block of `model` in place (nn.Module.compile: the module's calls go through the
    compiled forward; its parameters, hooks and state dict are unchanged). Returns {blocks, classes,
    seconds}: seconds is the wrapping only, the compilation itself happens at the first call."""
    started = time.perf_counter()
    classes = block_classes(model)
    blocks = [m for m in model.modules() if type(m).__name__ in classes]
    for block in blocks:
        block.compile(dynamic=dynamic)
    return {"blocks": len(blocks), "classes": sorted(classes), "seconds": time.perf_counter() - started}
