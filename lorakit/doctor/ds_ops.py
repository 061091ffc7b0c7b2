"""Which DeepSpeed ops a recipe's run loads, and whether each is prebuilt, already compiled in the torch
extensions cache, or will be compiled just in time at start (a minute or more per op, with ninja and a
C++ compiler, nvcc for CUDA ops; on a machine without them the run fails before its first step)."""

from __future__ import annotations

from pathlib import Path

from lorakit.doctor.result import CheckResult, failed, passed

SECTION = "environment"
# op name -> DeepSpeed's builder class name.
BUILDERS = {
    "cpu_adam": "CPUAdamBuilder",
    "async_io": "AsyncIOBuilder",
    "quantizer": "QuantizerBuilder",
    "deepspeed_shm_comm": "ShareMemCommBuilder",
}


def ops_for(recipe, accelerator: str) -> list[str]:
    """The ops a run of `recipe` loads on `accelerator` ("cuda", "cpu", ...), as lorakit configures
    DeepSpeed (engine/deepspeed_config.py: torch's AdamW without offload, DeepSpeed's CPU Adam with it)."""
    d = recipe.distributed
    ops = []
    if d.offload_optimizer != "none":
        ops.append("cpu_adam")
    if "nvme" in (d.offload_optimizer, d.offload_params):
        ops.append("async_io")
    if d.quantized_weights or d.quantized_gradients:
        ops.append("quantizer")
    if accelerator == "cpu" and d.num_processes > 1:
        ops.append("deepspeed_shm_comm")  # DeepSpeed's shared-memory collectives on CPU
    return ops


def _cached(name: str) -> Path | None:
    from lorakit.engine.extension_locks import extensions_root

    root = extensions_root()
    for so in [*root.glob(f"{name}/*.so"), *root.glob(f"*/{name}/*.so")]:
        return so
    return None


def deepspeed_ops(recipe) -> CheckResult:
    """For each op the recipe's run loads: prebuilt, compiled in the cache, or to be compiled at start; an
    op that must be compiled where it cannot be (incompatible, no ninja) fails."""
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops
    except Exception as e:
        return failed(
            SECTION,
            "deepspeed ops",
            f"DeepSpeed does not import: {type(e).__name__}: {e}",
            "no run can start: lorakit trains on DeepSpeed",
            "reinstall deepspeed for this torch (pip install --force-reinstall deepspeed)",
        )
    accelerator = get_accelerator().device_name()
    if recipe is None:
        built = sorted(k for k, v in installed_ops.items() if v)
        return passed(SECTION, "deepspeed ops", f"prebuilt: {', '.join(built) or 'none'} (no recipe given)")
    ops = ops_for(recipe, accelerator)
    if not ops:
        return passed(SECTION, "deepspeed ops", f"the run loads no compiled DeepSpeed op on {accelerator}")
    from torch.utils.cpp_extension import is_ninja_available

    states, problems = {}, []
    for name in ops:
        if installed_ops.get(name):
            states[name] = "prebuilt"
        elif _cached(name) is not None:
            states[name] = "compiled in the extensions cache"
        else:
            states[name] = "compiles at start (just in time)"
            try:
                builder = get_accelerator().create_op_builder(BUILDERS[name])
                compatible = builder is not None and builder.is_compatible(verbose=False)
            except Exception:
                compatible = False
            if not compatible:
                problems.append(f"{name} cannot be built on this machine")
            elif not is_ninja_available():
                problems.append(f"{name} needs ninja to compile (pip install ninja)")
    detail = "; ".join(f"{k}: {v}" for k, v in states.items()) + f" (accelerator {accelerator})"
    if problems:
        return failed(
            SECTION,
            "deepspeed ops",
            detail,
            "; ".join(problems) + ": the run would fail (or hang compiling) before its first step",
            "install ninja and a C++ compiler (and the CUDA toolkit for GPU ops), or a DeepSpeed built with "
            "the ops (DS_BUILD_OPS=1 pip install deepspeed), or change distributed.offload_* settings",
            ops=states,
        )
    return passed(SECTION, "deepspeed ops", detail, ops=states)
