"""The device a GPU benchmark runs on: what it is and can do (the probe), random weights built on it, and the
project's GPU tests run there."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness.provenance import ROOT


def probe(matmul_n: int, dtype_name: str) -> dict:
    """The device, its measured matmul rate, optional backends, versions."""
    import importlib.util
    from importlib import metadata

    import torch
    from transformers import LlamaForCausalLM

    from benchmarks.harness.provenance import versions
    from lorakit.model.attention import choose_attention

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    out: dict = {"device": dev, "versions": versions()}
    out["versions"]["torch_cuda"] = torch.version.cuda
    out["versions"]["cudnn"] = torch.backends.cudnn.version() if cuda else None
    for name in ("flash_attn", "pydantic", "bitsandbytes"):
        try:
            out["versions"][name] = metadata.version(name.replace("_", "-"))
        except Exception:
            out["versions"][name] = out["versions"].get(name)
    if cuda:
        props = torch.cuda.get_device_properties(0)
        out.update(gpu_name=props.name, gpu_memory_bytes=props.total_memory)
        out["multiprocessors"] = props.multi_processor_count
        out["compute_capability"] = f"{props.major}.{props.minor}"
        query = "name,driver_version,memory.total,clocks.max.sm,power.limit"
        smi = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"]
        values = subprocess.run(smi, capture_output=True, text=True).stdout.split(",")
        out["nvidia_smi"] = dict(zip(query.split(","), (x.strip() for x in values), strict=False))
    n, dtype = matmul_n, getattr(torch, dtype_name)
    gen = torch.Generator(device=dev).manual_seed(0)
    a, b = (torch.randn(n, n, device=dev, dtype=dtype, generator=gen) for _ in range(2))
    times, sync = [], torch.cuda.synchronize if cuda else lambda: None
    for i in range(13):
        sync()
        start = time.perf_counter()
        a @ b
        sync()
        if i >= 3:  # three warm-ups
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    out["matmul"] = {"n": n, "dtype": dtype_name, "data": "random normal", "repeats": len(times)}
    out["matmul"].update(median_seconds=seconds, flops_per_second=2 * n**3 / seconds)
    try:
        from bitsandbytes.functional import quantize_4bit

        quantize_4bit(torch.randn(64, 64, device=dev, dtype=dtype), quant_type="nf4")
        out["bitsandbytes"] = {"ok": True, "device": dev}
    except Exception as e:
        out["bitsandbytes"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-1000:]}
    out["flash_attn_importable"] = importlib.util.find_spec("flash_attn") is not None
    if cuda:
        out["t5_sdpa_backends"] = t5_sdpa_backends(dtype)
    out["lorakit_attention_auto"] = choose_attention("auto", LlamaForCausalLM)
    return out


def t5_sdpa_backends(dtype) -> dict:
    """Which of SDPA's kernels take T5's attention (a position-bias mask) in a forward and backward pass of a
    small T5 on the GPU (the third lease's profile showed SDPA's math fallback there)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import T5Config, T5ForConditionalGeneration

    sizes = {"vocab_size": 256, "d_model": 256, "d_kv": 64, "d_ff": 512, "num_heads": 4}
    layers = {"num_layers": 1, "num_decoder_layers": 1, "feed_forward_proj": "gated-gelu"}
    config = T5Config(**sizes, **layers, decoder_start_token_id=0)
    model = T5ForConditionalGeneration._from_config(config, attn_implementation="sdpa", dtype=dtype).cuda()
    ids = torch.randint(1, 256, (4, 200), device="cuda")
    labels = torch.randint(1, 256, (4, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[1:, 150:] = 0  # padded rows, as length-grouped micro-batches have
    out = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            out[backend.name] = "ok"
        except Exception as e:  # the kernel refused these inputs: what it said is the answer
            out[backend.name] = f"{type(e).__name__}: {e}"[:300]
    return out


def setup_worker(spec: dict) -> dict:
    """The probe, then the random weights of every model the run needs; with `gpu_tests` (the log's path)
    the GPU tests run beside the weight builds (which wait on the disk), after the probe."""
    import threading

    out = {"probe": probe(spec["matmul_n"], spec["dtype"]), "builds": {}}
    tests = None
    if spec.get("gpu_tests"):
        log = Path(spec["gpu_tests"])
        tests = threading.Thread(target=lambda: out.update(gpu_tests=run_gpu_tests(log, print)), daemon=True)
        tests.start()
    for name, model_dir in spec["models"].items():
        try:
            out["builds"][name] = build_weights(model_dir, spec["dtype"])
        except Exception as e:  # reported per model: its workloads fail, the others run
            out["builds"][name] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
    if tests is not None:
        tests.join()
    return out


def write_model_dir(path: Path, kwargs: dict):
    """Tokenizer (lorakit's tiny BPE) and config (`kwargs`) of a random-weight model, saved in `path`."""
    from transformers import AutoConfig

    from lorakit.testing import build_tiny_tokenizer

    kwargs = dict(kwargs)
    model_type = kwargs.pop("model_type")
    tokenizer = build_tiny_tokenizer(path, kind="t5" if model_type == "t5" else "llama")
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    if model_type == "t5":
        special["decoder_start_token_id"] = tokenizer.pad_token_id
    else:
        special["bos_token_id"] = tokenizer.bos_token_id
    config = AutoConfig.for_model(model_type, **kwargs, **special)
    # lorakit caps lengths at min(tokenizer, config) maximum; the tiny tokenizer says 512.
    tokenizer.model_max_length = getattr(config, "max_position_embeddings", None) or 512
    tokenizer.save_pretrained(str(path))
    config.save_pretrained(str(path))
    return config


def build_weights(model_dir: str, dtype: str) -> dict:
    """Random weights for the config saved in `model_dir`, made on the device, saved as safetensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    start = time.perf_counter()
    config = AutoConfig.from_pretrained(model_dir)
    # A second command on a still-warm machine finds the weights of the same config and dtype there.
    marker = Path(model_dir) / "built.json"
    identity = {"config": json.loads(config.to_json_string()), "dtype": dtype}
    earlier = json.loads(marker.read_text()) if marker.is_file() else {}
    if earlier.get("identity") == identity:
        return dict(earlier["build"], reused=True, seconds=time.perf_counter() - start)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(dev):
        model = auto.from_config(config, dtype=getattr(torch, dtype))
        if config.is_encoder_decoder:
            # FLAN-T5 checkpoints carry their own lm_head; transformers 5.x keeps it apart from the shared
            # embedding when both are saved with different values (as lorakit.testing does for tiny:t5).
            head = torch.empty_like(model.shared.weight).normal_(std=config.d_model**-0.5)
            model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(model_dir)
    params = sum(p.numel() for p in model.parameters())
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    build = {"seconds": time.perf_counter() - start, "params": params, "safetensors_bytes": size}
    build["device"] = dev
    marker.write_text(json.dumps({"identity": identity, "build": build}))
    return build


def run_gpu_tests(log_path: Path, log, tests: str = "tests/gpu", timeout: float = 300.0) -> dict:
    """pytest -m gpu tests/gpu (junit XML beside the log): the counts and whether they passed."""
    start = time.perf_counter()
    # One process on the one GPU, and no pytest-xdist there: the machine has pytest, not the dev extra.
    junit = log_path.with_name("gpu_tests_junit.xml")
    command = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=-ra", "-m", "gpu", tests]
    command += ["-p", "no:cacheprovider", f"--junitxml={junit}"]
    try:
        output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        proc = subprocess.run(command, cwd=ROOT, timeout=timeout, **output)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        proc = subprocess.CompletedProcess(command, 124, out + f"\n= timed out after {timeout:.0f} s in =")
    with open(log_path, "a") as f:
        f.write("\n===== pytest -m gpu tests/gpu\n" + proc.stdout)
    summary = next((line for line in reversed(proc.stdout.splitlines()) if " in " in line), "").strip("= ")
    log(f"gpu tests: exit code {proc.returncode}: {summary}")
    out = {"command": f"python -m pytest -q -m gpu {tests}", "exit_code": proc.returncode, "summary": summary}
    out["passed"] = gpu_tests_passed(out)
    return {**out, "seconds": time.perf_counter() - start}


def gpu_tests_passed(gpu_tests: dict) -> bool:
    """Whether pytest exited 0 and at least one test passed (tests that all skipped checked nothing)."""
    ran = re.search(r"(\d+) passed", gpu_tests.get("summary") or "")
    return gpu_tests.get("exit_code") == 0 and ran is not None and int(ran.group(1)) > 0
