"""`lorakit.doctor(recipe)`: every check of this machine for a recipe, in order (environment, contracts,
speed, plan), each one's errors caught and reported as a failed check, never raised."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from lorakit.disclosure import redact
from lorakit.doctor import contracts, ds_ops, env, speed
from lorakit.doctor.backend import fsdp_backend
from lorakit.doctor.result import SECTIONS, CheckResult, DoctorReport, failed, passed, skipped
from lorakit.errors import LorakitError

CRASH_ACTION = "report doctor.md and the traceback in doctor.json as a bug"


def detect_device() -> tuple[str, int, str]:
    """(device type, how many, its name): the CUDA / ROCm GPUs torch sees, else the CPU."""
    if torch.cuda.is_available():
        return "cuda", torch.cuda.device_count(), torch.cuda.get_device_name(0)
    import platform

    return "cpu", 1, f"CPU ({platform.processor() or platform.machine()})"


def _guard(section: str, name: str, fn: Callable[[], CheckResult | list[CheckResult]]) -> list[CheckResult]:
    """Run one check; an exception becomes a failed check that names it (a doctor never crashes)."""
    start = time.perf_counter()
    try:
        out = fn()
    except LorakitError as e:  # the recipe, not this machine: say what the error says
        link = e.doc_link()
        return [failed(section, name, str(e), "the recipe cannot be checked as it is",
                       f"fix the recipe{f' (see {link})' if link else ''} and run the doctor again")]  # fmt: skip
    except Exception as e:
        return [
            failed(
                section,
                name,
                redact(f"the check raised {type(e).__name__}: {e}"),
                f"{name} could not be checked on this machine",
                CRASH_ACTION,
                traceback=redact(traceback.format_exc(limit=8)),
            )
        ]
    out = out if isinstance(out, list) else [out]
    if len(out) == 1 and "seconds_taken" not in out[0].data:
        out = [replace(out[0], data={**out[0].data, "seconds_taken": round(time.perf_counter() - start, 2)})]
    return out


def _load(recipe):
    from lorakit.recipe import Recipe, load_recipe

    if recipe is None or isinstance(recipe, Recipe):
        return recipe
    return load_recipe(recipe)


def environment(recipe) -> list[CheckResult]:
    """The environment section."""
    checks = [
        ("python + torch", env.python_and_torch),
        ("libraries", env.packages),
        ("gpus", lambda: env.gpus(recipe)),
        ("driver + nccl", env.driver),
        ("flash-attn", env.flash_attn),
        ("bitsandbytes", lambda: env.bitsandbytes(recipe)),
        ("cpu bf16 matmul", env.cpu_matmul),
        ("deepspeed ops", lambda: ds_ops.deepspeed_ops(recipe)),
        ("fsdp", lambda: fsdp_backend(recipe)),
        ("extension locks", env.stale_locks),
    ]
    if recipe is not None:
        checks.append(("disk", lambda: env.disk(recipe)))
    return [c for name, fn in checks for c in _guard(env.SECTION, name, fn)]


def contract_checks(recipe, device: str, *, processes: int, quick: bool) -> list[CheckResult]:
    """The contracts section on a small model of the recipe's architecture, on `device`."""
    from lorakit.doctor.models import contract_model, recipe_config

    config = recipe_config(recipe)
    built = contract_model(recipe, device)
    out = _guard(contracts.SECTION, "packed == alone", lambda: contracts.packing(built, device=device))
    dtype = built.inputs.dtype
    out += _guard(contracts.SECTION, "chunked CE == full CE", lambda: contracts.chunked_ce(contracts.vocab_size(config), dtype,
                                                                             device=device))  # fmt: skip
    if recipe.method.kind not in ("lora", "qlora"):
        out.append(skipped(contracts.SECTION, "LoRA merged == adapter", f"method.kind {recipe.method.kind}"))
    elif recipe.method.quantization():
        out.append(skipped(contracts.SECTION, "LoRA merged == adapter", "QLoRA merges into the unquantized "
                           "base, which lorakit.merge checks at export"))  # fmt: skip
    else:
        out += _guard(contracts.SECTION, "LoRA merged == adapter", lambda: contracts.merge(built, device))
    out += _guard(
        contracts.SECTION, "token-weighted accumulation", lambda: contracts.accumulation(built, device=device)
    )
    from lorakit.doctor.zero3 import zero3_save

    out += _guard(
        contracts.SECTION, "ZeRO-3 save + reload", lambda: zero3_save(recipe, processes, quick=quick)
    )
    return out


def speed_checks(recipe, device: str, devices: int, device_name: str, *, quick: bool) -> list[CheckResult]:
    """The speed section: the block, the whole run's estimate, all_reduce bandwidth."""
    from lorakit.doctor.models import recipe_config

    config = recipe_config(recipe)
    block: dict = {}

    def run_block():
        result, data = speed.block_speed(recipe, config, device, quick=quick, device_name=device_name)
        block.update(data)
        return result

    out = _guard(speed.SECTION, "block forward+backward", run_block)
    # The run's processes on this machine: GPUs, as many as the recipe uses; a CPU is one device however
    # many processes share its cores.
    run_devices = min(devices, recipe.distributed.num_processes) if device == "cuda" else 1
    if block:
        out += _guard(
            speed.SECTION, "run time estimate", lambda: speed.run_estimate(recipe, config, block, run_devices)
        )
    out += _guard(speed.SECTION, "all_reduce", lambda: all_reduce(devices, quick=quick))
    return out


def all_reduce(devices: int, *, quick: bool) -> CheckResult:
    """all_reduce bus bandwidth across the local devices (or the launched group)."""
    from lorakit.engine.launch import launch_env, launched_distributed, torchrun_command

    if launched_distributed():
        # Under a launcher (several nodes, or torchrun on this one): across the launched group.
        import torch.distributed as dist

        from lorakit.doctor.allreduce import measure
        from lorakit.engine.launch import resolve_backend

        created = not dist.is_initialized()
        if created:
            dist.init_process_group(resolve_backend("auto"))
        try:
            return _bandwidth(measure())
        finally:
            if created:
                dist.destroy_process_group()
    if devices < 2:
        return skipped(
            speed.SECTION, "all_reduce", "one device: nothing to reduce across (--devices N on CPU)"
        )
    if quick:
        return skipped(speed.SECTION, "all_reduce", "--quick")
    with tempfile.TemporaryDirectory(prefix="lorakit-doctor-") as tmp:
        out = Path(tmp) / "allreduce.json"
        cmd = torchrun_command(devices, "lorakit.doctor.allreduce", [str(out)])
        proc = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 or not out.is_file():
            return failed(
                speed.SECTION,
                "all_reduce",
                f"{devices} processes could not all_reduce (exit code {proc.returncode}): "
                + (proc.stderr.strip().splitlines() or ["no output"])[-1],
                "the devices cannot communicate: a multi-device run would hang or fail at start",
                "check NCCL (NCCL_DEBUG=INFO), the GPUs' peer access and the driver; see doctor.json",
                stderr=proc.stderr[-4000:],
            )
        return _bandwidth(json.loads(out.read_text()))


def _bandwidth(m: dict) -> CheckResult:
    gbps = m["busbw_bytes_per_s"] / 1e9
    detail = (f"{m['world']} processes ({m['backend']}): bus bandwidth {gbps:.3g} GB/s "
              f"(all_reduce of {m['bytes'] >> 20} MiB in {m['seconds'] * 1e3:.1f} ms)")  # fmt: skip
    return passed(speed.SECTION, "all_reduce", detail, **m)


def plan_check(recipe, device: str, devices: int) -> CheckResult:
    """The planner's memory verdict for the recipe on the detected devices (on CPU: its RAM shared by the
    recipe's processes)."""
    import psutil

    from lorakit.doctor.models import recipe_config
    from lorakit.planner import plan
    from lorakit.planner.units import PlanError, format_bytes

    ram = psutil.virtual_memory().total
    try:
        config = recipe_config(recipe)
        if device == "cuda":
            memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(devices))
            p = plan(recipe, gpus=devices, gpu_memory=memory, cpu_memory=ram, config=config)
            where = f"{devices} GPU(s) of {format_bytes(memory)}"
        else:
            procs = recipe.distributed.num_processes
            p = plan(recipe, gpus=procs, gpu_memory=ram // procs, cpu_memory=ram, device="cpu", config=config)
            where = f"CPU: {format_bytes(ram)} of RAM shared by {procs} process(es)"
    except PlanError as e:
        return skipped("plan", "memory plan", f"the planner cannot plan this recipe: {e}")
    detail = f"{format_bytes(p.per_gpu_bytes)} per process on {where}"
    data = p.to_dict()
    if p.fits:
        return passed("plan", "memory plan", detail + ": fits", **data)
    fix = " ".join(p.recommended_overrides)
    return failed(
        "plan",
        "memory plan",
        detail + ": does not fit",
        "the run would run out of memory on this machine",
        f"apply the planner's recommendation: {fix}"
        if fix
        else "use more or larger devices (python -m lorakit.plan RECIPE shows the breakdown)",
        **data,
    )


def run_doctor(
    recipe=None,
    *,
    quick: bool = False,
    output: str | Path | None = None,
    devices: int | None = None,
    sections: tuple[str, ...] = SECTIONS,
    label: str | None = None,
) -> DoctorReport:
    """Check this machine for `recipe` (a Recipe, a YAML path, or None for the environment only); returns
    the DoctorReport and, with `output`, writes doctor.json and doctor.md there. `devices`: how many
    processes the multi-device checks use on CPU (default: the GPUs torch sees; one on CPU). `quick`: no
    all_reduce or ZeRO-3 save, fewer timing iterations (what preflight.doctor runs). `label`: what the
    report calls the recipe (default: its path, else its model)."""
    start = time.perf_counter()
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per process under a launcher
    if label is None and isinstance(recipe, str | Path):
        label = str(recipe)
    recipe = _load(recipe)
    device, count, name = detect_device()
    count = devices or count
    checks: list[CheckResult] = []
    if "environment" in sections:
        checks += environment(recipe)
    for section in ("contracts", "speed", "plan"):
        if section not in sections:
            continue
        if recipe is None:
            checks.append(skipped(section, section, "no recipe given"))
        elif section == "contracts":
            checks += _guard(section, "contracts", lambda: contract_checks(recipe, device, processes=count,
                                                                             quick=quick))  # fmt: skip
        elif section == "speed":
            checks += _guard(section, "speed", lambda: speed_checks(recipe, device, count, name, quick=quick))
        else:
            checks += _guard(section, "memory plan", lambda: plan_check(recipe, device, count))
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    report = DoctorReport(
        recipe=label or (None if recipe is None else recipe.model.name_or_path),
        quick=quick,
        checks=checks,
        seconds=time.perf_counter() - start,
        versions={**env.versions(), "device": name, "devices": count},
    )
    if output is not None and os.environ.get("RANK", "0") == "0":
        report.write(output)
    return report
