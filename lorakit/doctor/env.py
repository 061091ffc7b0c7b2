"""Environment checks: what this machine has (Python, torch, GPUs, driver, NCCL, the libraries lorakit runs
on) and what would stop or stall a run before its first step (a flash-attn that does not import, a
bitsandbytes on the wrong branch, DeepSpeed ops that must be compiled, stale build locks, no disk space).
Every check catches its own errors: a broken library is reported, never raised."""

from __future__ import annotations

import importlib
import importlib.util
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from lorakit.doctor.result import CheckResult, failed, passed, skipped

SECTION = "environment"
PACKAGES = ("transformers", "peft", "deepspeed", "accelerate", "bitsandbytes", "flash-attn")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Python, torch (with its CUDA / ROCm build) and the libraries lorakit runs on."""
    out = {"python": platform.python_version(), "torch": torch.__version__}
    out["torch.cuda"] = torch.version.cuda
    out["torch.hip"] = getattr(torch.version, "hip", None)
    out.update({name: _version(name) for name in PACKAGES})
    return out


def python_and_torch() -> CheckResult:
    """Python and torch, and which accelerator build torch is."""
    v = versions()
    build = (
        f"CUDA {v['torch.cuda']}"
        if v["torch.cuda"]
        else f"ROCm {v['torch.hip']}"
        if v["torch.hip"]
        else "CPU"
    )
    detail = f"Python {v['python']}, torch {v['torch']} ({build} build)"
    return passed(SECTION, "python + torch", detail, python=v["python"], torch=v["torch"], build=build)


def packages() -> CheckResult:
    """The versions of the libraries a run uses ("-" for one that is not installed)."""
    v = versions()
    detail = ", ".join(f"{name} {v[name] or '-'}" for name in PACKAGES)
    return passed(SECTION, "libraries", detail, **{name: v[name] for name in PACKAGES})


def gpus(recipe=None) -> CheckResult:
    """GPU model, count, memory and compute capability; a recipe in bf16 on a GPU without it fails."""
    if not torch.cuda.is_available():
        return skipped(SECTION, "gpus", "no CUDA or ROCm GPU visible: this machine runs on CPU")
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devices.append({"name": p.name, "memory_bytes": p.total_memory, "capability": f"{p.major}.{p.minor}"})
    names = sorted({d["name"] for d in devices})
    detail = f"{len(devices)} x {', '.join(names)}, {devices[0]['memory_bytes'] / 2**30:.0f} GiB, "
    detail += f"compute capability {devices[0]['capability']}"
    wanted = recipe.distributed.num_processes if recipe is not None else 0
    if wanted > len(devices):
        return failed(
            SECTION,
            "gpus",
            detail,
            f"the recipe starts distributed.num_processes {wanted} processes, one per GPU, on {len(devices)} GPU(s)",
            f"set distributed.num_processes: {len(devices)} (and raise train.gradient_accumulation_steps to keep "
            "the step's size), or run on a machine with more GPUs",
            devices=devices,
        )
    if recipe is not None and recipe.model.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        return failed(
            SECTION,
            "gpus",
            detail,
            "this GPU has no bfloat16 support, which the recipe's model.dtype asks for",
            "use model.dtype: float16 (not for T5: see docs/qlora.md) or float32, or a GPU of compute "
            "capability 8.0 or newer",
            devices=devices,
        )
    return passed(SECTION, "gpus", detail, devices=devices)


def driver() -> CheckResult:
    """The GPU driver version (nvidia-smi, or rocm-smi), and NCCL's version in torch."""
    if not torch.cuda.is_available():
        return skipped(SECTION, "driver + nccl", "no GPU: no driver or NCCL to check")
    version = None
    for cmd in (
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        ["rocm-smi", "--showdriverversion"],
    ):
        if shutil.which(cmd[0]):
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
                version = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None
            except (OSError, subprocess.SubprocessError):
                version = None
            break
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # torch built without NCCL, or its library did not load
        nccl = None
        nccl_error = repr(e)
    else:
        nccl_error = None
    detail = f"driver {version or 'unknown'}, NCCL {nccl or 'unavailable'}"
    if nccl is None and torch.cuda.device_count() > 1:
        return failed(
            SECTION,
            "driver + nccl",
            detail + (f" ({nccl_error})" if nccl_error else ""),
            "several GPUs but no NCCL: multi-GPU runs cannot communicate",
            "install a torch wheel built with NCCL (the default CUDA wheels are), or set distributed.backend",
            driver=version,
            nccl=nccl,
        )
    return passed(SECTION, "driver + nccl", detail, driver=version, nccl=nccl)


def flash_attn() -> CheckResult:
    """Whether flash-attn, when installed, imports: a wheel built for another torch or CUDA fails with an
    undefined symbol (ImportError or OSError) at the first forward of a run that chose it."""
    if importlib.util.find_spec("flash_attn") is None:
        return passed(SECTION, "flash-attn", "not installed: model.attention auto uses SDPA", installed=False)
    try:
        module = importlib.import_module("flash_attn")
    except Exception as e:  # ImportError, OSError (undefined symbol), RuntimeError: all mean "unusable"
        return failed(
            SECTION,
            "flash-attn",
            f"installed but does not import: {type(e).__name__}: {e}",
            "the flash-attn wheel does not match this torch / CUDA (usually an undefined symbol); a run with "
            "model.attention auto on a GPU would choose flash_attention_2 and crash at its first step",
            f"reinstall it for torch {torch.__version__} (pip install --force-reinstall --no-build-isolation "
            '"lorakit[flash]"), or pip uninstall flash-attn; meanwhile use model.attention: sdpa',
            installed=True,
            error=repr(e),
        )
    version = getattr(module, "__version__", None) or _version("flash-attn")
    usable = "usable" if torch.cuda.is_available() else "imports, but needs a CUDA GPU"
    return passed(SECTION, "flash-attn", f"{version}: {usable}", installed=True, version=version)


def bitsandbytes(recipe=None) -> CheckResult:
    """bitsandbytes' branch: its GPU kernels, or its CPU kernels and whether they take the AVX512-BF16 path
    (the CPU inference layout that lorakit.model.quantize.keep_standard_4bit_layout turns off for training)."""
    qlora = recipe is not None and recipe.method.quantization() is not None
    if importlib.util.find_spec("bitsandbytes") is None:
        if qlora:
            return failed(
                SECTION,
                "bitsandbytes",
                "not installed",
                "the recipe is QLoRA (method.kind qlora), which quantizes the base with bitsandbytes",
                'pip install "lorakit[qlora]"',
            )
        return passed(SECTION, "bitsandbytes", "not installed (only QLoRA recipes need it)", installed=False)
    try:
        import bitsandbytes as bnb
        from bitsandbytes import cextension, functional
    except Exception as e:
        return failed(
            SECTION,
            "bitsandbytes",
            f"installed but does not import: {type(e).__name__}: {e}",
            "QLoRA runs (and peft, which imports it when present) would fail",
            "reinstall it for this torch (pip install --force-reinstall bitsandbytes), or uninstall it",
            error=repr(e),
        )
    backend = getattr(cextension, "BNB_BACKEND", None) or ("CUDA" if torch.cuda.is_available() else "CPU")
    data = {"version": bnb.__version__, "backend": backend}
    if backend == "CPU" or not torch.cuda.is_available():
        try:
            avx = bool(functional.has_avx512bf16())
        except Exception:  # an older bitsandbytes without the CPU inference layout
            avx = False
        data["avx512_bf16"] = avx
        path = "AVX512-BF16 path (lorakit keeps the standard 4-bit layout for training)" if avx else (
            "standard CPU path (no AVX512-BF16)")  # fmt: skip
        return passed(SECTION, "bitsandbytes", f"{bnb.__version__}, CPU branch: {path}", **data)
    return passed(SECTION, "bitsandbytes", f"{bnb.__version__}, GPU branch ({backend})", **data)


def cpu_matmul() -> CheckResult:
    """How a bf16 model's linear layers multiply on this CPU (lorakit.model.cpu_products): torch's bf16 kernel
    where the CPU has a fast one, else products formed in fp32; a bad LORAKIT_CPU_BF16_MATMUL fails."""
    from lorakit.errors import LorakitError
    from lorakit.model import cpu_products

    try:
        forced = cpu_products.forced_setting()
    except LorakitError as e:
        return failed(
            SECTION,
            "cpu bf16 matmul",
            str(e),
            "lorakit.train stops with exit 2 before any work",
            f"unset {cpu_products.FORCE} or set it to {', '.join(cpu_products.CHOICES)}",
        )
    fast = cpu_products.fast_bf16_kernel()
    fp32 = cpu_products.fp32_products_wanted(torch.bfloat16, "cpu")
    how = "products formed in fp32, rounded once" if fp32 else "torch's bf16 kernel"
    why = "oneDNN has a bf16 kernel here" if fast else "torch has no fast bf16 kernel for this CPU"
    if forced != "auto":
        why += f"; {cpu_products.FORCE}={forced}"
    data = {"fast_bf16_kernel": fast, "products": "fp32" if fp32 else "native", "forced": forced}
    return passed(SECTION, "cpu bf16 matmul", f"bf16 runs on this CPU: {how} ({why})", **data)


def disk(recipe) -> CheckResult:
    """output.dir and data.cache_dir writable, with room for what the run writes (lorakit.preflight)."""
    from lorakit import preflight
    from lorakit.errors import RunDirError
    from lorakit.storage import existing_ancestor, free_bytes
    from lorakit.units import format_bytes

    try:
        need = preflight.check_run_paths(recipe)
    except RunDirError as e:
        return failed(
            SECTION,
            "disk",
            str(e),
            "the run would stop before its first step, or when it saves",
            "free space there, or point output.dir / data.cache_dir at a filesystem with room",
        )
    free = {}
    for field in ("output.dir", "data.cache_dir"):
        section, key = field.split(".")
        path = existing_ancestor(Path(getattr(getattr(recipe, section), key)).expanduser().resolve())
        free[field] = free_bytes(path)
    detail = ", ".join(f"{k} {format_bytes(v)} free" for k, v in free.items())
    if need is not None:
        detail += f" (the run needs about {format_bytes(need.total)} in output.dir)"
    return passed(SECTION, "disk", detail, free_bytes=free, need_bytes=need.total if need else None)


def stale_locks() -> CheckResult:
    """Build locks left by a killed DeepSpeed op build in the torch extensions cache."""
    from lorakit.engine.extension_locks import describe_stale_locks, extensions_root
    from lorakit.engine.extension_locks import stale_locks as find

    root = extensions_root()
    try:
        locks = find()
    except Exception as e:  # an unreadable cache directory: say so, do not crash the report
        return skipped(SECTION, "extension locks", f"could not scan {root}: {e!r}")
    if not locks:
        return passed(SECTION, "extension locks", f"no stale build locks under {root}", root=str(root))
    return failed(
        SECTION,
        "extension locks",
        f"{len(locks)} stale lock(s) under {root}",
        describe_stale_locks(locks),
        "rm " + " ".join(str(p) for p in locks),
        locks=[str(p) for p in locks],
    )
