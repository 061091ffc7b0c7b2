"""GPU validation and benchmark: lorakit vs HF Trainer + peft on realistic model sizes with random weights.

    python benchmarks/gpu_bench.py [--out DIR] [--output benchmarks/results/gpu_h200.json]
                                   [--workloads causal_1b_lora,...] [--budget-seconds S] [--run-gpu-tests]
                                   [--extra-sides] [--work-dir DIR] [--note TEXT]
    python benchmarks/gpu_bench.py --smoke --output /tmp/smoke.json     # the same code on CPU, tiny configs
    python benchmarks/gpu_bench.py --merge PART1.json PART2.json [--output benchmarks/results/gpu_h200.json]
    python benchmarks/gpu_bench.py --plot-only benchmarks/results/gpu_h200.json

Every workload trains one model shape with one method (LoRA, full, QLoRA; ZeRO-0 or ZeRO-3, one process)
on synthetic instruction data, once through lorakit and once through the usual Hugging Face recipe:

- lorakit: `lorakit.train` on a recipe (the product's own path: data cache, batching, DeepSpeed engine, loop).
  Causal LMs train packed (multipack rows, attention per example: flash varlen when flash-attn imports, else
  lorakit's per-example SDPA); T5 trains lorakit's default, micro-batches grouped by length and padded to their
  longest member.
- hf: `Trainer` (`Seq2SeqTrainer` for T5) + peft, `DataCollatorForSeq2Seq` (dynamic padding to the longest
  member), the default random sampler (`hf_grouped`: `train_sampling_strategy="group_by_length"`), the same
  attention backend lorakit resolved for unpacked batches, bf16, non-reentrant gradient checkpointing, the
  default fused AdamW (ZeRO-3: DeepSpeed's, through `TrainingArguments(deepspeed=...)`).

Both sides read the same tokenized rows (lorakit's data cache) with the same micro-batch size in examples;
lorakit's packed rows hold about as many tokens as that many examples. Every run is a fresh subprocess.
Throughput is timed per optimizer step with a device synchronisation at the end of each step, and the first
`warmup_steps` steps are left out: useful tokens/s = non-pad tokens of the timed steps / their wall time
(batch loading and collation included, since they happen between the steps).

MFU = model FLOPs of the timed steps / their wall time / the GPU's dense bf16 peak (FLOP_ACCOUNTING below;
also reported against the bf16 matmul rate measured on the same GPU at start). Weights are random (nothing is
downloaded); speed does not depend on their values.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from a checkout: benchmarks.common and this lorakit

from benchmarks.common import machine as cpu_machine  # noqa: E402
from benchmarks.common import source_digest  # noqa: E402

DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "gpu_h200.json"
LORA = {"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"}
LR = {"lora": 2e-4, "qlora": 2e-4, "full": 1e-5}
SEED = 42
# Dense (no sparsity) bf16 tensor-core peaks from the vendors' datasheets; first match of the device name wins.
DATASHEET_BF16 = (
    ("H200 NVL", 835e12, "NVIDIA H200 NVL datasheet: 1,671 TFLOPS bf16 with sparsity, half of it dense"),
    ("H200", 989e12, "NVIDIA H200 SXM datasheet: 1,979 TFLOPS bf16 with sparsity, 989 dense"),
    ("H100 PCIe", 756e12, "NVIDIA H100 PCIe datasheet: 1,513 TFLOPS bf16 with sparsity, half of it dense"),
    ("H100", 989e12, "NVIDIA H100 SXM datasheet: 1,979 TFLOPS bf16 with sparsity, 989 dense"),
    ("A100", 312e12, "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense"),
)
FLOP_ACCOUNTING = (
    "Model FLOPs of the timed steps, counted on useful tokens only (padding is waste, not work) and without "
    "gradient checkpointing's recompute (MFU, not hardware utilisation). Matmul part: every nn.Linear of the "
    "model (embedding lookups excluded, the output head included even when tied) costs 2*in*out FLOPs per "
    "token in the forward pass; training multiplies that by 3 for full fine-tuning (forward, activation "
    "gradients, weight gradients: 6N per token) and by 2 for LoRA and QLoRA, whose frozen base needs no weight "
    "gradients (4N per token), plus 6*N_lora per token for the adapters (r*(in+out) per adapted linear; "
    "all-linear adapts every linear but the output head; QLoRA's dequantisation is not counted). For T5, "
    "encoder linears and the decoder's cross-attention key/value projections run on source tokens, the rest "
    "of the decoder and the head on target tokens. Attention part: 4*heads*head_dim FLOPs per (query, key) "
    "pair a token actually attends to in the forward pass (QK^T and AV), times 3 for training: per example, "
    "causal self-attention has L(L+1)/2 pairs, T5's encoder Ls^2, its decoder self-attention Lt(Lt+1)/2 and "
    "cross-attention Lt*Ls, in every layer. MFU divides FLOP/s by the dense bf16 peak of the datasheet "
    "(`peak_flops.datasheet`) and, separately, by the bf16 matmul rate measured on the same device at start."
)
TARGETS = {
    "packed_causal_lora_vs_hf": {
        "workload": "causal_1b_lora",
        "ratio": "lorakit/hf",
        "at_least": 1.5,
        "what": "packed causal LoRA at >= 1.5x the useful tokens/s of HF Trainer + peft on the same model and data",
    },
    "causal_1b_lora_mfu": {
        "workload": "causal_1b_lora",
        "side": "lorakit",
        "at_least": 0.45,
        "what": "MFU of 1B-class LoRA with packing (an aim, reported honestly)",
    },
}

# Model shapes (transformers config kwargs); the tokenizer is lorakit's tiny BPE (ids < 2000) saved with the
# model, so text is cheap to make while every matmul has the real model's size.
# fmt: off
MODELS = {
    "llama_1b": {"family": "causal", "like": "Llama-3.2-1B (tied head)", "config": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=True)},
    "llama_8b": {"family": "causal", "like": "Llama-3.1-8B", "config": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False)},
    "t5_xl": {"family": "seq2seq", "like": "FLAN-T5-XL", "config": dict(
        model_type="t5", vocab_size=32128, d_model=2048, d_kv=64, d_ff=5120, num_layers=24, num_decoder_layers=24,
        num_heads=32, relative_attention_num_buckets=32, relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False)},
}
SMOKE_MODELS = {  # --smoke: the same shapes, tiny
    "llama_1b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=2000, max_position_embeddings=1024),
    "llama_8b": dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=24, vocab_size=2000, max_position_embeddings=1024),
    "t5_xl": dict(vocab_size=2000, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4),
}
# Synthetic lengths in tokens of content (special tokens come on top): log-normal (median, sigma), clipped to
# [low, high]. Causal: a long-tailed chat/instruction-like spread, where padding random batches wastes what it
# does in practice; T5: CNN/DailyMail-like articles (capped at 512) and summaries.
LENGTHS = {
    "causal": {"total": (512, 0.7, 32, 2040), "prompt_share": (0.3, 0.7)},
    "seq2seq": {"source": (300, 0.5, 16, 510), "target": (50, 0.45, 4, 126)},
}
SMOKE_LENGTHS = {
    "causal": {"total": (40, 0.6, 8, 200), "prompt_share": (0.3, 0.7)},
    "seq2seq": {"source": (40, 0.5, 8, 120), "target": (8, 0.45, 2, 30)},
}
CAPS = {"causal": {"max_length": 2048}, "seq2seq": {"max_source_length": 512, "max_target_length": 128}}
SMOKE_CAPS = {"causal": {"max_length": 256}, "seq2seq": {"max_source_length": 128, "max_target_length": 32}}
# batch: examples per micro-batch (one micro-batch per optimizer step) on every side; steps: optimizer steps
# of the HF side, so the data holds batch * steps examples (one epoch); est_seconds: what one side takes on an
# H200, start-up included, to skip what no longer fits the budget.
WORKLOADS = {
    "causal_1b_lora":       {"model": "llama_1b", "method": "lora",  "zero_stage": 0, "batch": 16, "steps": 24,
                             "sides": ("lorakit", "hf", "hf_grouped"), "extra_sides": ("lorakit_grouped",),
                             "est_seconds": 40},
    "causal_1b_full":       {"model": "llama_1b", "method": "full",  "zero_stage": 0, "batch": 16, "steps": 20,
                             "sides": ("lorakit", "hf"), "est_seconds": 45},
    "causal_1b_lora_zero3": {"model": "llama_1b", "method": "lora",  "zero_stage": 3, "batch": 16, "steps": 20,
                             "sides": ("lorakit", "hf"), "est_seconds": 55},
    "causal_1b_qlora":      {"model": "llama_1b", "method": "qlora", "zero_stage": 0, "batch": 16, "steps": 20,
                             "sides": ("lorakit", "hf"), "needs": "bitsandbytes", "est_seconds": 50},
    "t5_xl_lora":           {"model": "t5_xl",    "method": "lora",  "zero_stage": 0, "batch": 32, "steps": 24,
                             "sides": ("lorakit", "hf"), "extra_sides": ("lorakit_packed",), "est_seconds": 50},
    "t5_xl_full":           {"model": "t5_xl",    "method": "full",  "zero_stage": 0, "batch": 32, "steps": 16,
                             "sides": ("lorakit", "hf"), "est_seconds": 55},
    "causal_8b_lora":       {"model": "llama_8b", "method": "lora",  "zero_stage": 0, "batch": 8,  "steps": 16,
                             "sides": ("lorakit", "hf"), "est_seconds": 90},
}
# fmt: on
SMOKE_STEPS = {"batch": 4, "steps": 4, "warmup_steps": 1}
WARMUP_STEPS = 3
SIDES = {
    "lorakit": "lorakit.train: causal LMs packed (multipack rows, attention per example), T5 length-grouped "
    "micro-batches padded to their longest member (lorakit's default for encoder-decoders)",
    "lorakit_grouped": "lorakit.train without packing: length-grouped micro-batches padded to their longest member",
    "lorakit_packed": "lorakit.train with data.packing true (T5: packed encoder and decoder rows)",
    "hf": "HF Trainer + peft, DataCollatorForSeq2Seq (dynamic padding), random sampler (the default)",
    "hf_grouped": "HF Trainer + peft, DataCollatorForSeq2Seq, train_sampling_strategy group_by_length",
}


# ------------------------------------------------------------------------------------------- accounting
def make_config(model: str, smoke: bool, special: dict):
    """The transformers config of a MODELS entry (tiny in smoke mode) with the tokenizer's special ids."""
    from transformers import AutoConfig

    kwargs = dict(MODELS[model]["config"])
    if smoke:
        kwargs.update(SMOKE_MODELS[model])
    kind = kwargs.pop("model_type")
    return AutoConfig.for_model(kind, **kwargs, **special)


def accounting(config, r: int = LORA["r"]) -> dict:
    """Matmul parameters per token of each stream and attention dimensions, counted on a meta-device model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    with torch.device("meta"):
        model = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_config(config)
    head = model.get_output_embeddings()
    params: dict[str, int] = {}
    lora: dict[str, int] = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        stream = "token"
        if seq2seq:
            on_source = name.startswith("encoder.") or re.search(r"EncDecAttention\.[kv]$", name)
            stream = "source" if on_source else "target"
        params[stream] = params.get(stream, 0) + module.in_features * module.out_features
        if module is not head:
            lora[stream] = lora.get(stream, 0) + r * (module.in_features + module.out_features)
    if seq2seq:
        attention = {
            "encoder_layers": config.num_layers,
            "decoder_layers": config.num_decoder_layers,
            "heads": config.num_heads,
            "head_dim": config.d_kv,
        }
    else:
        attention = {
            "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        }
    return {
        "family": "seq2seq" if seq2seq else "causal",
        "matmul_params_per_token": params,
        "lora_params_per_token": lora,
        "lora_r": r,
        "attention": attention,
    }


def model_flops(acc: dict, method: str, sums: dict) -> float:
    """Training FLOPs of `sums` (token and attention-pair counts) under FLOP_ACCOUNTING."""
    base = 6 if method == "full" else 4
    adapters = 0 if method == "full" else 6
    p, lo, a = acc["matmul_params_per_token"], acc["lora_params_per_token"], acc["attention"]
    per_pair = 12 * a["heads"] * a["head_dim"]  # 4 FLOPs per pair forward (QK^T, AV), x3 for training
    if acc["family"] == "causal":
        matmul = (base * p["token"] + adapters * lo["token"]) * sums["tokens"]
        return float(matmul + per_pair * a["layers"] * sums["pairs"])
    matmul = (base * p["source"] + adapters * lo["source"]) * sums["source_tokens"] + (
        base * p["target"] + adapters * lo["target"]
    ) * sums["target_tokens"]
    attention = per_pair * (
        a["encoder_layers"] * sums["encoder_pairs"]
        + a["decoder_layers"] * (sums["decoder_pairs"] + sums["cross_pairs"])
    )
    return float(matmul + attention)


SUM_KEYS = {
    "causal": ("tokens", "pairs", "examples", "slots"),
    "seq2seq": (
        "source_tokens",
        "target_tokens",
        "encoder_pairs",
        "decoder_pairs",
        "cross_pairs",
        "examples",
        "slots",
    ),
}


def add_lengths(sums: dict, family: str, lengths, slots: int) -> None:
    """Add one micro-batch: its examples' lengths (causal: L; seq2seq: (Ls, Lt)) and its token slots."""
    sums["slots"] += slots
    for item in lengths:
        sums["examples"] += 1
        if family == "causal":
            n = int(item)
            sums["tokens"] += n
            sums["pairs"] += n * (n + 1) // 2
        else:
            s, t = (int(x) for x in item)
            sums["source_tokens"] += s
            sums["target_tokens"] += t
            sums["encoder_pairs"] += s * s
            sums["decoder_pairs"] += t * (t + 1) // 2
            sums["cross_pairs"] += t * s


def useful_tokens(sums: dict) -> int:
    return sums["tokens"] if "tokens" in sums else sums["source_tokens"] + sums["target_tokens"]


def lorakit_batch_lengths(batch: dict, family: str):
    """Per-example lengths of a lorakit micro-batch (packed or padded, causal or seq2seq)."""
    import torch

    if family == "causal":
        if "attention_mask" in batch:
            return batch["attention_mask"].sum(1).tolist()
        pos = batch["position_ids"][0]
        starts = torch.nonzero(pos == 0).flatten().tolist() + [pos.numel()]
        return [e - s for s, e in zip(starts[:-1], starts[1:], strict=True)]
    if "source_segments" in batch:
        src = torch.bincount(batch["source_segments"][0])[1:].tolist()
        tgt = torch.bincount(batch["target_segments"][0])[1:].tolist()
        return list(zip(src, tgt, strict=True))
    src = batch["attention_mask"].sum(1).tolist()
    tgt = (batch["labels"] != -100).sum(1).tolist()
    return list(zip(src, tgt, strict=True))


class StepRecorder:
    """Per optimizer step: end time (after a device sync) and the token/pair sums of its micro-batches."""

    def __init__(self, family: str, cuda: bool):
        self.family, self.cuda = family, cuda
        self.steps: list[dict] = []
        self.pending = self._zero()

    def _zero(self) -> dict:
        return dict.fromkeys(SUM_KEYS[self.family], 0)

    def add(self, lengths, slots: int) -> None:
        add_lengths(self.pending, self.family, lengths, slots)

    def end(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        self.steps.append({"end": time.perf_counter(), **self.pending})
        self.pending = self._zero()

    def timed(self, warmup: int) -> dict:
        """Sums and wall time of the steps after the first `warmup` ones."""
        if len(self.steps) <= warmup:
            raise RuntimeError(
                f"only {len(self.steps)} optimizer steps were recorded (warm-up {warmup}): the step "
                "instrumentation no longer sees the training loop, or the data is too small"
            )
        timed = self.steps[warmup:]
        sums = {k: sum(s[k] for s in timed) for k in SUM_KEYS[self.family]}
        ends = [s["end"] for s in self.steps]
        durations = [b - a for a, b in zip(ends[warmup - 1 :], ends[warmup:], strict=False)]
        return {
            "steps_recorded": len(self.steps),
            "warmup_steps": warmup,
            "timed_steps": len(timed),
            "timed_seconds": ends[-1] - ends[warmup - 1],
            "step_seconds_median": statistics.median(durations),
            "step_seconds_min": min(durations),
            "step_seconds_max": max(durations),
            "timed_sums": sums,
            "all_useful_tokens": sum(useful_tokens(s) for s in self.steps),
        }


# ----------------------------------------------------------------------------------------------- workers
def _memory(cuda: bool) -> dict:
    import resource

    import torch

    return {
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
        "peak_cpu_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def worker_probe(spec: dict) -> dict:
    """The device, its measured bf16 matmul rate, DeepSpeed's fused Adam (JIT-built here once), optional
    backends, versions."""
    import importlib.util

    import torch

    from lorakit import __version__ as lorakit_version
    from lorakit.rundir import versions

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    out: dict = {"device": dev, "versions": {**versions(), "lorakit": lorakit_version}}
    out["versions"]["torch_cuda"] = torch.version.cuda
    out["versions"]["cudnn"] = torch.backends.cudnn.version() if cuda else None
    for name in ("flash_attn", "pydantic", "bitsandbytes"):
        try:
            from importlib import metadata

            out["versions"][name] = metadata.version(name.replace("_", "-"))
        except Exception:
            out["versions"][name] = out["versions"].get(name)
    if cuda:
        props = torch.cuda.get_device_properties(0)
        out.update(
            gpu_name=props.name,
            gpu_memory_bytes=props.total_memory,
            multiprocessors=props.multi_processor_count,
            compute_capability=f"{props.major}.{props.minor}",
        )
        query = "name,driver_version,memory.total,clocks.max.sm,power.limit"
        smi = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True
        )
        out["nvidia_smi"] = dict(
            zip(query.split(","), (x.strip() for x in smi.stdout.split(",")), strict=False)
        )
    n = spec["matmul_n"]
    gen = torch.Generator(device=dev).manual_seed(0)
    dtype = getattr(torch, spec["dtype"])
    a = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
    times = []
    for i in range(13):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if cuda:
            torch.cuda.synchronize()
        if i >= 3:  # three warm-ups
            times.append(time.perf_counter() - start)
    out["matmul"] = {
        "n": n,
        "dtype": spec["dtype"],
        "data": "random normal",
        "repeats": len(times),
        "median_seconds": statistics.median(times),
        "flops_per_second": 2 * n**3 / statistics.median(times),
    }
    if cuda:
        start = time.perf_counter()
        try:
            from deepspeed.ops.op_builder import FusedAdamBuilder

            FusedAdamBuilder().load()
            out["fused_adam"] = {"ok": True, "seconds": time.perf_counter() - start}
        except Exception as e:  # reported; the lorakit sides will fail with the same cause
            out["fused_adam"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-2000:]}
    try:
        from bitsandbytes.functional import quantize_4bit

        quantize_4bit(torch.randn(64, 64, device=dev, dtype=dtype), quant_type="nf4")
        out["bitsandbytes"] = {"ok": True, "device": dev}
    except Exception as e:
        out["bitsandbytes"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-1000:]}
    from transformers import LlamaForCausalLM

    from lorakit.model.attention import choose_attention

    out["flash_attn_importable"] = importlib.util.find_spec("flash_attn") is not None
    out["lorakit_attention_auto"] = choose_attention("auto", LlamaForCausalLM)
    return out


def build_weights(model_dir: str, dtype: str) -> dict:
    """Random weights for the config saved in `model_dir`, made on the device, saved as safetensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    start = time.perf_counter()
    config = AutoConfig.from_pretrained(model_dir)
    seq2seq = bool(config.is_encoder_decoder)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(dev):
        model = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_config(
            config, dtype=getattr(torch, dtype)
        )
        if seq2seq:
            # FLAN-T5 checkpoints carry their own lm_head; transformers 5.x keeps it apart from the shared
            # embedding when both are saved with different values (as lorakit.testing does for tiny:t5).
            head = torch.empty_like(model.shared.weight).normal_(std=config.d_model**-0.5)
            model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(model_dir)
    params = sum(p.numel() for p in model.parameters())
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    files = list(Path(model_dir).glob("*.safetensors"))
    return {
        "seconds": time.perf_counter() - start,
        "params": params,
        "safetensors_bytes": sum(f.stat().st_size for f in files),
        "device": dev,
    }


def worker_setup(spec: dict) -> dict:
    """The probe, then the random weights of every model the run needs (one process for all of it)."""
    out = {"probe": worker_probe(spec), "builds": {}}
    for name, model_dir in spec["models"].items():
        try:
            out["builds"][name] = build_weights(model_dir, spec["dtype"])
        except Exception as e:  # reported per model: its workloads fail, the others run
            out["builds"][name] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
    return out


def _side_result(rec: StepRecorder, spec: dict, cuda: bool, extra: dict) -> dict:
    out = rec.timed(spec["warmup_steps"])
    out.update(_memory(cuda))
    out.update(extra)
    return out


def worker_lorakit(spec: dict) -> dict:
    """lorakit.train on the side's recipe, with a timer at the end of every optimizer step."""
    import torch

    import lorakit
    from lorakit.engine import loop
    from lorakit.recipe import recipe_from_dict

    cuda = torch.cuda.is_available()
    rec = StepRecorder(spec["family"], cuda)
    inner = loop.train_window

    def timed_window(*args, **kwargs):  # instrumentation only: reads the batches, changes nothing
        window = kwargs["window"] if "window" in kwargs else args[2]
        for b in window:
            rec.add(lorakit_batch_lengths(b, spec["family"]), int(b["num_token_slots"]))
        out = inner(*args, **kwargs)
        rec.end()
        return out

    loop.train_window = timed_window
    s = lorakit.train(recipe_from_dict(spec["recipe"])).summary
    return _side_result(
        rec,
        spec,
        cuda,
        {
            "attention": s["attention"],
            "optimizer_steps": s["steps"],
            "trainable_params": s["trainable_params"],
            "total_params": s["total_params"],
            "useful_tokens_epoch": s["train_tokens"],
            "token_slots_epoch": s["padded_tokens"],
            "loss_first": s["loss"]["first"],
            "loss_last": s["loss"]["last"],
            "lorakit_tokens_per_second": s["tokens_per_second"],
            "batching": s["batching"],
            "quantization": s.get("quantization"),
        },
    )


def _hf_args(cls, spec: dict, cuda: bool, deepspeed_config: dict | None):
    import dataclasses

    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {
        "output_dir": spec["work_dir"],
        "per_device_train_batch_size": spec["batch"],
        "num_train_epochs": 1,
        "learning_rate": LR[spec["method"]],
        "lr_scheduler_type": "linear",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "seed": SEED,
        "bf16": spec["dtype"] == "bfloat16",
        "logging_steps": max(1, spec["steps"] // 4),
        "report_to": "none",
        "save_strategy": "no",
        "eval_strategy": "no",
        "dataloader_num_workers": 0,
        "deepspeed": deepspeed_config,
        "use_cpu": not cuda,
    }
    # transformers renamed gradient_checkpointing to activation_checkpointing (5.2x keeps the old name as a
    # deprecated alias) and group_by_length to train_sampling_strategy: use whichever this version has.
    ckpt = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    kwargs[ckpt] = True
    kwargs[f"{ckpt}_kwargs"] = {"use_reentrant": False}
    if "train_sampling_strategy" in fields:
        kwargs["train_sampling_strategy"] = "group_by_length" if spec["group_by_length"] else "random"
    else:
        kwargs["group_by_length"] = spec["group_by_length"]
    return cls(**{k: v for k, v in kwargs.items() if k in fields})


def worker_hf(spec: dict) -> dict:
    """The usual Hugging Face recipe: Trainer + peft on the same tokenized rows, timed per optimizer step."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSeq2SeqLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    from lorakit.data.cache import load_cached

    cuda = torch.cuda.is_available()
    seq2seq = spec["family"] == "seq2seq"
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    splits, _ = load_cached(Path(spec["prepared"]))
    train = splits["train"]
    train = train.remove_columns([c for c in train.column_names if c not in ("input_ids", "labels")])
    set_seed(SEED)
    deepspeed_config = None
    if spec["zero_stage"] == 3:
        # One process: the launcher's variables DeepSpeed reads. The ZeRO-3 config of transformers' DeepSpeed
        # guide ("auto" filled in from the training arguments), with DeepSpeed's own AdamW as lorakit uses.
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(spec["master_port"]),
        )
        adam = {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
        if not cuda:
            adam["torch_adam"] = True  # DeepSpeed's fused Adam needs CUDA
        deepspeed_config = {
            "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": adam},
            "zero_optimization": {
                "stage": 3,
                "overlap_comm": cuda,
                "contiguous_gradients": True,
                "reduce_bucket_size": "auto",
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
                "stage3_gather_16bit_weights_on_model_save": True,
            },
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "zero_allow_untested_optimizer": True,
        }
    # Arguments before the model, so that under ZeRO-3 from_pretrained loads partitioned (zero.Init).
    args = _hf_args(Seq2SeqTrainingArguments if seq2seq else TrainingArguments, spec, cuda, deepspeed_config)
    load = {"dtype": getattr(torch, spec["dtype"]), "attn_implementation": spec["hf_attention"]}
    if spec["method"] == "qlora":
        from transformers import BitsAndBytesConfig

        load["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=load["dtype"],
        )
        if cuda:
            load["device_map"] = {"": 0}
    model = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(
        spec["model_dir"], **load
    )
    model.config.use_cache = False
    if spec["method"] == "qlora":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    if spec["method"] != "full":
        from peft import LoraConfig, TaskType, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=LORA["r"],
                lora_alpha=LORA["alpha"],
                lora_dropout=LORA["dropout"],
                target_modules=LORA["target_modules"],
                task_type=TaskType.SEQ_2_SEQ_LM if seq2seq else TaskType.CAUSAL_LM,
            ),
        )
    rec = StepRecorder(spec["family"], cuda)

    def count(module, args_, kwargs):  # instrumentation only: reads the forward's inputs
        mask = kwargs["attention_mask"]
        src = mask.sum(1).tolist()
        slots = kwargs["input_ids"].numel()
        if seq2seq:
            labels = kwargs["labels"]
            rec.add(list(zip(src, (labels != -100).sum(1).tolist(), strict=True)), slots + labels.numel())
        else:
            rec.add(src, slots)

    model.register_forward_pre_hook(count, with_kwargs=True)

    class StepEnd(TrainerCallback):
        def on_step_end(self, *a, **k):
            rec.end()

    trainer = (Seq2SeqTrainer if seq2seq else Trainer)(
        model=model,
        args=args,
        train_dataset=train,
        data_collator=DataCollatorForSeq2Seq(
            tokenizer, model=model if seq2seq else None, label_pad_token_id=-100
        ),
        processing_class=tokenizer,
        callbacks=[StepEnd()],
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    slots = sum(s["slots"] for s in rec.steps)
    return _side_result(
        rec,
        spec,
        cuda,
        {
            "attention": model.config._attn_implementation,
            "optimizer_steps": trainer.state.global_step,
            "trainable_params": sum(
                p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                for p in model.parameters()
                if p.requires_grad
            ),
            "useful_tokens_epoch": sum(useful_tokens(s) for s in rec.steps),
            "token_slots_epoch": slots,
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "optimizer": type(trainer.optimizer).__name__ if trainer.optimizer is not None else None,
        },
    )


WORKERS = {"setup": worker_setup, "lorakit": worker_lorakit, "hf": worker_hf}


# ------------------------------------------------------------------------------------------ orchestration
class Runner:
    """Runs workers in fresh interpreters under one time budget, appending their output to one log."""

    def __init__(self, tmp: Path, log_path: Path, budget: float, echo):
        self.tmp, self.log_path, self.echo = tmp, log_path, echo
        self.deadline = time.monotonic() + budget

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, kind: str, spec: dict, name: str, reserve: float = 20.0) -> dict:
        """The worker's JSON result; raises RuntimeError (with the output's tail) on failure or timeout."""
        spec_path, result_path = self.tmp / f"{name}.spec.json", self.tmp / f"{name}.result.json"
        spec_path.write_text(json.dumps(spec))
        result_path.unlink(missing_ok=True)
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
        # Nothing here needs the hub (local models, local data); offline, a missing file fails at once instead
        # of waiting on a network that a GPU machine may not have.
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("HF_DATASETS_OFFLINE", "1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        timeout = max(self.remaining() - reserve, 1.0)
        with open(self.log_path, "a") as log:
            log.write(f"\n===== {name} ({kind}) {datetime.now(timezone.utc).isoformat(timespec='seconds')}\n")
            log.flush()
            offset = log.tell()
            start = time.perf_counter()
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                kind,
                str(spec_path),
                str(result_path),
            ]
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)  # its own session: the worker and anything it started
                proc.wait()
                code = None
        seconds = time.perf_counter() - start
        if code != 0 or not result_path.is_file():
            with open(self.log_path) as f:
                f.seek(offset)
                tail = f.read()[-3000:]
            why = f"timed out after {timeout:.0f} s (budget)" if code is None else f"exit code {code}"
            raise RuntimeError(f"{name}: {why}; last output:\n{tail}")
        out = json.loads(result_path.read_text())
        out["process_seconds"] = seconds
        return out


def synthetic_rows(tokenizer, family: str, n: int, dist: dict, seed: int) -> list[dict]:
    """n instruction rows of random words whose token lengths follow `dist`: each word is one vocabulary
    entry with a leading space, so a text of k words is k tokens."""
    import numpy as np

    vocab = sorted(t for t in tokenizer.get_vocab() if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 2)
    words = [tokenizer.convert_tokens_to_string([t]) for t in vocab]
    rng = np.random.default_rng(seed)

    def lengths(median, sigma, low, high):
        return np.clip(np.round(rng.lognormal(math.log(median), sigma, n)), low, high).astype(int)

    def text(k: int) -> str:
        return "".join(words[i] for i in rng.integers(0, len(words), k))

    if family == "causal":
        total = lengths(*dist["total"])
        share = rng.uniform(*dist["prompt_share"], n)
        prompts = np.maximum(1, np.round(total * share)).astype(int)
        return [
            {"prompt": text(p), "response": text(max(1, t - p))} for p, t in zip(prompts, total, strict=True)
        ]
    src, tgt = lengths(*dist["source"]), lengths(*dist["target"])
    return [{"prompt": text(s), "response": text(t)} for s, t in zip(src, tgt, strict=True)]


def write_model_dir(path: Path, model: str, smoke: bool) -> dict:
    """Tokenizer (lorakit's tiny BPE) and config of a model; the weights come from the build worker."""
    from lorakit.testing import build_tiny_tokenizer

    family = MODELS[model]["family"]
    tokenizer = build_tiny_tokenizer(path, kind="t5" if family == "seq2seq" else "llama")
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    if family == "seq2seq":
        special["decoder_start_token_id"] = tokenizer.pad_token_id
    else:
        special["bos_token_id"] = tokenizer.bos_token_id
    config = make_config(model, smoke, special)
    # lorakit caps lengths at min(tokenizer, config) maximum; the tiny tokenizer says 512.
    tokenizer.model_max_length = getattr(config, "max_position_embeddings", None) or 512
    tokenizer.save_pretrained(str(path))
    config.save_pretrained(str(path))
    return accounting(config)


def recipe_for(
    w: dict,
    side: str,
    model_dir: Path,
    data_file: Path,
    cache: Path,
    out: Path,
    caps: dict,
    max_tokens: int | None,
) -> dict:
    """The lorakit recipe of one side of a workload."""
    from lorakit.recipe.schema import Recipe

    family = w["family"]
    packing = family == "causal" if side == "lorakit" else side == "lorakit_packed"
    method = {"kind": w["method"]} if w["method"] == "full" else {"kind": w["method"], **LORA}
    train = {
        "epochs": 1,
        "lr": LR[w["method"]],
        "micro_batch_size": w["batch"],
        "warmup_ratio": 0.0,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "seed": SEED,
        "log_every": 10**6,
    }
    if packing:
        train["max_tokens"] = max_tokens
    raw = {
        "model": {
            "name_or_path": str(model_dir),
            "dtype": w["dtype"],
            "attention": "auto",
            "gradient_checkpointing": True,
        },
        "method": method,
        "data": {
            "source": str(data_file),
            "split": "train",
            "eval_split": None,
            "format": "instruction",
            "input_column": "prompt",
            "target_column": "response",
            "prompt_template": "{input}",
            "max_samples": w["batch"] * w["steps"],
            "packing": packing,
            "group_by_length": True,
            "cache_dir": str(cache),
            **caps,
        },
        "train": train,
        "distributed": {"num_processes": 1, "zero_stage": w["zero_stage"]},
        "eval": {"enabled": False},
        "output": {"dir": str(out), "save_adapter": False},
    }
    if "checkpoint" in Recipe.model_fields:
        raw["checkpoint"] = {"at_epoch_end": False}  # a benchmark measures training, not checkpoint writes
    return raw


def packed_budget(lengths: list[int], batch: int) -> int:
    """Tokens per packed row: about `batch` examples of mean length (as many tokens as a padded micro-batch
    holds without its padding), a multiple of 256, at least the longest example."""
    need = math.ceil(batch * statistics.fmean(lengths) / 256) * 256
    return max(need, max(lengths))


def derive(side: dict, acc: dict, method: str, peak: dict) -> None:
    """Rates, FLOPs and MFU of one measured side (in place)."""
    sums, seconds = side["timed_sums"], side["timed_seconds"]
    side["useful_tokens_timed"] = useful_tokens(sums)
    side["useful_tokens_per_second"] = side["useful_tokens_timed"] / seconds
    side["padding_efficiency_timed"] = side["useful_tokens_timed"] / sums["slots"]
    side["model_flops_timed"] = model_flops(acc, method, sums)
    side["model_flops_per_second"] = side["model_flops_timed"] / seconds
    side["mfu"] = side["model_flops_per_second"] / peak["datasheet"] if peak.get("datasheet") else None
    side["mfu_vs_measured_matmul"] = side["model_flops_per_second"] / peak["measured_matmul"]


def peak_of(probe: dict) -> dict:
    name = probe.get("gpu_name") or ""
    match = next(((f, src) for key, f, src in DATASHEET_BF16 if key in name), (None, None))
    return {
        "device": name or "cpu",
        "datasheet": match[0],
        "datasheet_source": match[1] or "no datasheet peak known for this device: MFU is not reported",
        "measured_matmul": probe["matmul"]["flops_per_second"],
        "measured_matmul_how": f"{probe['matmul']['n']}^3 {probe['matmul']['dtype']} matmul on random data, median of "
        f"{probe['matmul']['repeats']} after 3 warm-ups",
    }


def run_workload(name: str, w: dict, ctx: dict) -> dict:
    """Prepare the data, run every side; returns the workload's result."""
    import lorakit
    from lorakit.recipe import recipe_from_dict

    runner, log, smoke = ctx["runner"], ctx["log"], ctx["smoke"]
    model = w["model"]
    family = MODELS[model]["family"]
    w = dict(w, family=family, dtype=ctx["dtype"])
    result = {
        "model": model,
        "like": MODELS[model]["like"],
        "family": family,
        "dtype": ctx["dtype"],
        **{k: w[k] for k in ("method", "zero_stage", "batch", "steps")},
        "sides": {},
    }
    if w.get("needs") == "bitsandbytes" and not ctx["probe"]["bitsandbytes"]["ok"]:
        return dict(
            result, status="skipped", reason="bitsandbytes unusable: " + ctx["probe"]["bitsandbytes"]["error"]
        )
    work = ctx["work"]
    model_dir = work / "models" / model
    built = ctx["models"][model]
    if "error" in built["build"]:
        raise RuntimeError(f"building {model} failed: {built['build']['error']}")
    acc = result["accounting"] = built["accounting"]
    result["build"] = built["build"]
    result["model_config"] = json.loads((model_dir / "config.json").read_text())

    from transformers import AutoTokenizer

    data_file = work / "data" / f"{family}.jsonl"
    if not data_file.exists():
        data_file.parent.mkdir(parents=True, exist_ok=True)
        rows = synthetic_rows(
            AutoTokenizer.from_pretrained(model_dir),
            family,
            ctx["max_rows"][family],
            ctx["lengths"][family],
            SEED,
        )
        data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    caps, cache = ctx["caps"][family], work / "cache"
    plain = recipe_for(w, "hf", model_dir, data_file, cache, work / "runs" / "prepare", caps, None)
    prepared = lorakit.prepare(recipe_from_dict(plain))
    lengths = [int(x) for x in prepared.train["length"]]
    max_tokens = packed_budget(lengths, w["batch"]) if family == "causal" else None
    result["data"] = {
        "rows": len(lengths),
        "tokens": sum(lengths),
        "mean_length": statistics.fmean(lengths),
        "max_length": max(lengths),
        "distribution": ctx["lengths"][family],
        "caps": caps,
        "packed_max_tokens": max_tokens,
    }
    if family == "seq2seq":
        result["data"]["target_tokens"] = sum(len(x) for x in prepared.train["labels"])
    sides = list(w["sides"]) + (list(w.get("extra_sides", ())) if ctx["extra_sides"] else [])
    if ctx["only_sides"]:
        sides = [s for s in sides if s in ctx["only_sides"]]
    hf_attention = "sdpa"
    if family == "causal" and ctx["probe"]["lorakit_attention_auto"] == "flash_attention_2":
        hf_attention = "flash_attention_2"  # like for like: the backend lorakit uses
    for side in sides:
        est = w.get("est_seconds", 0) if not smoke else 0
        if runner.remaining() < est + 20:
            result["sides"][side] = {
                "status": "skipped",
                "reason": f"budget: {runner.remaining():.0f} s left, a side takes about {est} s",
            }
            log(f"  {name}/{side}: skipped (budget)")
            continue
        spec = {
            "family": family,
            "method": w["method"],
            "zero_stage": w["zero_stage"],
            "batch": w["batch"],
            "dtype": ctx["dtype"],
            "steps": w["steps"],
            "warmup_steps": ctx["warmup_steps"],
            "model_dir": str(model_dir),
            "work_dir": str(work / "runs" / f"{name}-{side}"),
        }
        if side.startswith("lorakit"):
            budget = max_tokens
            if side == "lorakit_packed" and family == "seq2seq":
                budget = packed_budget([len(x) for x in prepared.train["input_ids"]], w["batch"])
            spec["recipe"] = recipe_for(
                w, side, model_dir, data_file, cache, Path(spec["work_dir"]), caps, budget
            )
            # Prepare (tokenize + cache) here so no timed run pays for it.
            lorakit.prepare(recipe_from_dict(spec["recipe"]))
            kind = "lorakit"
        else:
            from lorakit.engine.launch import free_port

            spec.update(
                prepared=str(prepared.path),
                group_by_length=side == "hf_grouped",
                hf_attention=hf_attention,
                master_port=free_port(),
            )
            kind = "hf"
        try:
            r = runner.run(kind, spec, f"{name}-{side}")
        except RuntimeError as e:
            result["sides"][side] = {"status": "failed", "error": str(e)[-3000:]}
            log(f"  {name}/{side}: FAILED ({str(e).splitlines()[0]})")
            continue
        derive(r, acc, w["method"], ctx["peak"])
        r.update(status="measured", description=SIDES[side])
        result["sides"][side] = r
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        mem = r["peak_gpu_memory_bytes"]
        log(
            f"  {name}/{side}: {r['useful_tokens_per_second']:,.0f} useful tok/s, MFU {mfu} "
            f"({r['mfu_vs_measured_matmul']:.1%} of measured matmul), efficiency "
            f"{r['padding_efficiency_timed']:.2f}, step {r['step_seconds_median']:.3f} s, peak "
            f"{mem / 2**30 if mem else 0:.1f} GiB, {r['process_seconds']:.0f} s in all"
        )
    measured = {s: r for s, r in result["sides"].items() if r.get("status") == "measured"}
    result["ratios"] = {
        f"{s}/{b}": measured[s]["useful_tokens_per_second"] / measured[b]["useful_tokens_per_second"]
        for s in measured
        if s.startswith("lorakit")
        for b in measured
        if b.startswith("hf")
    }
    result["checks"] = {
        # One epoch over the same rows on every side: the same useful tokens.
        "useful_tokens_epoch": {s: r["useful_tokens_epoch"] for s, r in measured.items()},
        "equal_on_all_sides": len({r["useful_tokens_epoch"] for r in measured.values()}) <= 1,
        "finite_losses": all(
            r["loss_last"] is None or math.isfinite(r["loss_last"]) for r in measured.values()
        ),
    }
    statuses = {r["status"] for r in result["sides"].values()}
    if len(measured) == len(sides):
        result["status"] = "measured"
    elif measured:
        result["status"] = "partial"
    else:
        result["status"] = "skipped" if statuses == {"skipped"} else "failed"
        if statuses == {"skipped"}:
            result["reason"] = "budget: no side fitted"
    return result


def evaluate_targets(workloads: dict) -> dict:
    out = {}
    for key, t in TARGETS.items():
        w = workloads.get(t["workload"], {})
        if "ratio" in t:
            value = w.get("ratios", {}).get(t["ratio"])
        else:
            value = w.get("sides", {}).get(t["side"], {}).get("mfu")
        out[key] = {**t, "measured": value, "met": None if value is None else bool(value >= t["at_least"])}
    return out


def table(result: dict) -> str:
    lines = [
        "workload              side             useful tok/s     MFU  %matmul  pad.eff  peak GiB   vs hf"
    ]
    for name, w in result["workloads"].items():
        for side, r in w.get("sides", {}).items():
            if r.get("status") != "measured":
                lines.append(f"{name:21s} {side:15s} {r.get('status', '?')}")
                continue
            ratio = w["ratios"].get(f"{side}/hf")
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
            mem = (r["peak_gpu_memory_bytes"] or 0) / 2**30
            lines.append(
                f"{name:21s} {side:15s} {r['useful_tokens_per_second']:13,.0f} {mfu:>7s} "
                f"{r['mfu_vs_measured_matmul']:7.1%} {r['padding_efficiency_timed']:8.2f} {mem:9.1f} "
                f"{f'x{ratio:.2f}' if ratio else '':>7s}"
            )
        if not w.get("sides") and w.get("status") in ("skipped", "failed"):
            why = w.get("reason") or w.get("error") or ""
            lines.append(f"{name:21s} {w['status']}: {why.splitlines()[0][:70] if why else ''}")
    return "\n".join(lines)


def write_result(result: dict, output: Path, out_dir: Path | None) -> None:
    from lorakit.rundir import write_json

    result["targets"] = evaluate_targets(result["workloads"])
    write_json(output, result)
    png = plot(result, output.with_suffix(".png"))
    if out_dir is not None and out_dir.resolve() != output.parent.resolve():
        write_json(out_dir / output.name, result)
        if png:
            plot(result, out_dir / output.with_suffix(".png").name)


def orchestrate(args) -> int:
    t0 = time.perf_counter()
    # Before anything imports huggingface_hub (it reads these once): see Runner.run.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    smoke = args.smoke
    out_dir = Path(args.out).resolve() if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="lorakit-gpu-bench-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    output = Path(args.output or (work / "gpu_bench_smoke.json" if smoke else DEFAULT_OUTPUT)).resolve()
    log_path = (out_dir or output.parent) / (output.stem + ".log")
    log_path.write_text("")

    def log(msg):
        print(msg, flush=True)

    # bf16 is what is measured; the CPU smoke run uses float32, since bf16 matmuls are emulated (slow) on CPUs.
    dtype = "float32" if smoke else "bfloat16"
    selected = args.workloads or list(WORKLOADS)
    workloads = {n: dict(WORKLOADS[n], **(SMOKE_STEPS if smoke else {})) for n in selected}
    max_rows = {}
    for w in workloads.values():
        fam = MODELS[w["model"]]["family"]
        max_rows[fam] = max(max_rows.get(fam, 0), w["batch"] * w["steps"])
    tmp = work / "ipc"
    tmp.mkdir(exist_ok=True)
    budget = args.budget_seconds or (float("inf") if smoke else 540.0)
    runner = Runner(tmp, log_path, budget, log)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    from lorakit.rundir import git_revision

    result = {
        "benchmark": "gpu_bench",
        "smoke": smoke,
        "measured": "useful (non-pad) tokens/s, MFU and peak GPU memory of lorakit.train vs HF Trainer + peft "
        "on random-weight models of real sizes, one process, same tokenized rows and examples per step",
        "dtype": dtype,
        "command": "python benchmarks/gpu_bench.py " + " ".join(args.argv),
        "date": started,
        "git_revision": git_revision(ROOT),
        "lorakit_source_sha256": source_digest(),
        "flop_accounting": FLOP_ACCOUNTING,
        "timing": "per optimizer step, device-synchronised at its end; the first warmup_steps steps are left "
        "out; useful tokens/s = non-pad tokens of the timed steps / their wall time, batch loading included",
        "sides": SIDES,
        "lora": LORA,
        "learning_rates": LR,
        "warmup_steps": SMOKE_STEPS["warmup_steps"] if smoke else WARMUP_STEPS,
        "host": cpu_machine(),
        "workloads": {},
        "notes": list(args.note or []),
    }
    # Tokenizer and config of every model here (no GPU needed); weights on the device in the setup worker.
    models = {}
    for m in dict.fromkeys(w["model"] for w in workloads.values()):
        (work / "models" / m).mkdir(parents=True, exist_ok=True)
        models[m] = {"accounting": write_model_dir(work / "models" / m, m, smoke)}
    dirs = {m: str(work / "models" / m) for m in models}
    spec = {"matmul_n": 512 if smoke else 8192, "dtype": dtype, "models": dirs}
    try:
        # On a GPU in its own process, so this one never holds device memory; the CPU smoke run saves the
        # start-up of one more interpreter.
        setup = worker_setup(spec) if smoke else runner.run("setup", spec, "setup")
    except RuntimeError as e:
        log(str(e))
        return 1
    probe = setup["probe"]
    for m, build in setup["builds"].items():
        models[m]["build"] = build
        if "error" in build:
            log(f"building {m} FAILED: {build['error']}")
        else:
            log(
                f"built {m}: {build['params'] / 1e9:.3f}B params, {build['safetensors_bytes'] / 2**30:.1f} GiB "
                f"in {build['seconds']:.0f} s"
            )
    result["device"] = {k: v for k, v in probe.items() if k != "versions"}
    result["versions"] = probe["versions"]
    result["peak_flops"] = peak = peak_of(probe)
    log(
        f"device: {peak['device']}; measured {dtype} matmul {peak['measured_matmul'] / 1e12:.2f} TFLOP/s; "
        f"datasheet bf16 peak {peak['datasheet'] / 1e12 if peak['datasheet'] else 'n/a'} TFLOP/s"
    )
    if probe.get("fused_adam"):
        log(f"DeepSpeed fused Adam: {probe['fused_adam']}")
    if args.run_gpu_tests:
        result["gpu_tests"] = run_gpu_tests(log_path, log)
    ctx = {
        "runner": runner,
        "log": log,
        "smoke": smoke,
        "probe": probe,
        "peak": peak,
        "work": work,
        "models": models,
        "max_rows": max_rows,
        "extra_sides": args.extra_sides,
        "only_sides": args.sides,
        "dtype": dtype,
        "warmup_steps": result["warmup_steps"],
        "lengths": SMOKE_LENGTHS if smoke else LENGTHS,
        "caps": SMOKE_CAPS if smoke else CAPS,
    }
    for i, (name, w) in enumerate(workloads.items()):
        log(
            f"workload {name}: {w['model']} {w['method']} ZeRO-{w['zero_stage']}, {runner.remaining():.0f} s left"
        )
        try:
            result["workloads"][name] = run_workload(name, w, ctx)
        except Exception as e:  # a setup failure (build, data) loses this workload, not the run
            result["workloads"][name] = {
                "model": w["model"],
                "status": "failed",
                "error": f"{type(e).__name__}: {e}",
            }
            log(f"  {name}: FAILED: {type(e).__name__}: {e}")
        # Free the disk of models no later workload uses (8B is 16 GB).
        later = {x["model"] for x in list(workloads.values())[i + 1 :]}
        for m in list(ctx["models"]):
            if m not in later:
                import shutil

                shutil.rmtree(work / "models" / m, ignore_errors=True)
                ctx["models"].pop(m)
        result["benchmark_wall_seconds"] = time.perf_counter() - t0
        write_result(result, output, out_dir)
    result["benchmark_wall_seconds"] = time.perf_counter() - t0
    write_result(result, output, out_dir)
    log(table(result))
    for t in result["targets"].values():
        value = t["measured"]
        shown = "not measured" if value is None else (f"{value:.1%}" if "side" in t else f"x{value:.2f}")
        log(
            f"target: {t['what']}: {shown} ({'met' if t['met'] else 'not met' if t['met'] is False else '-'})"
        )
    log(f"wrote {output} (log {log_path}) in {result['benchmark_wall_seconds']:.0f} s")
    failed = [n for n, w in result["workloads"].items() if w.get("status") in ("failed", "partial")]
    return 1 if failed else 0


def run_gpu_tests(log_path: Path, log) -> dict:
    """pytest -m gpu tests/gpu, output appended to the log; the counts go into the result."""
    start = time.perf_counter()
    with open(log_path, "a") as f:
        f.write("\n===== pytest -m gpu tests/gpu\n")
        f.flush()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        f.write(proc.stdout)
    summary = next((line for line in reversed(proc.stdout.splitlines()) if " in " in line), "")
    log(f"gpu tests: exit code {proc.returncode}: {summary}")
    return {
        "command": "python -m pytest -q -m gpu tests/gpu",
        "exit_code": proc.returncode,
        "summary": summary.strip("= "),
        "seconds": time.perf_counter() - start,
    }


def merge(paths: list[str], output: Path, out_dir: Path | None) -> int:
    """Combine the results of several invocations (one lease command each) into one result."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    devices = {p["peak_flops"]["device"] for p in parts}
    if len(devices) != 1:
        print(f"error: the parts were measured on different devices: {sorted(devices)}", file=sys.stderr)
        return 2
    result = dict(parts[0])
    result["workloads"] = {}
    for p in parts:
        for name, w in p["workloads"].items():
            if name in result["workloads"] and w.get("status") != "measured":
                continue  # keep an earlier measured copy over a later skipped or failed one
            result["workloads"][name] = w
    result["parts"] = [
        {
            k: p.get(k)
            for k in (
                "command",
                "date",
                "git_revision",
                "lorakit_source_sha256",
                "benchmark_wall_seconds",
                "versions",
                "gpu_tests",
            )
        }
        | {"workloads": list(p["workloads"])}
        for p in parts
    ]
    result["command"] = " ; ".join(p["command"] for p in parts)
    result["benchmark_wall_seconds"] = sum(p.get("benchmark_wall_seconds") or 0 for p in parts)
    tests = [p["gpu_tests"] for p in parts if p.get("gpu_tests")]
    result["gpu_tests"] = tests[-1] if tests else None
    write_result(result, output, out_dir)
    print(table(result))
    print(f"wrote {output}")
    return 0


def plot(result: dict, path: Path) -> bool:
    """Useful tokens/s (with ratio and MFU) and peak GPU memory per workload and side; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [
        n
        for n, w in result["workloads"].items()
        if any(r.get("status") == "measured" for r in w.get("sides", {}).values())
    ]
    if not names:
        return False
    sides = [
        s
        for s in SIDES
        if any(result["workloads"][n]["sides"].get(s, {}).get("status") == "measured" for n in names)
    ]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(max(10, 2.2 * len(names) + 4), 5.2))
    width = 0.8 / len(sides)
    for j, side in enumerate(sides):
        xs, tps, mem, labels = [], [], [], []
        for i, n in enumerate(names):
            r = result["workloads"][n]["sides"].get(side, {})
            if r.get("status") != "measured":
                continue
            xs.append(i + (j - (len(sides) - 1) / 2) * width)
            tps.append(r["useful_tokens_per_second"])
            mem.append((r["peak_gpu_memory_bytes"] or r["peak_cpu_rss_bytes"]) / 2**30)
            ratio = result["workloads"][n]["ratios"].get(f"{side}/hf")
            mfu = r["mfu"] if r["mfu"] is not None else r["mfu_vs_measured_matmul"]
            labels.append((f"x{ratio:.2f}\n" if ratio else "") + f"{mfu:.0%}")
        ax.bar(xs, tps, width, label=side, color=f"C{j}")
        ax2.bar(xs, mem, width, label=side, color=f"C{j}")
        for x, y, text in zip(xs, tps, labels, strict=True):
            ax.annotate(text, (x, y), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7)
    for a in (ax, ax2):
        a.set_xticks(range(len(names)), [n.replace("_", "\n", 1) for n in names], fontsize=8)
        a.legend(fontsize=8)
    basis = "MFU" if result["peak_flops"].get("datasheet") else "of measured matmul"
    ax.set_title(f"useful tokens / s (labels: lorakit/hf ratio, {basis})", fontsize=10)
    ax.set_yscale("log")
    ax.margins(y=0.25)
    ax2.set_title(
        "peak GPU memory allocated (GiB)"
        if result["peak_flops"].get("datasheet")
        else "peak memory (GiB; CPU RSS without a GPU)",
        fontsize=10,
    )
    v = result["versions"]
    fig.suptitle(
        f"{result['peak_flops']['device']}{' (smoke, tiny configs)' if result['smoke'] else ''}: "
        f"torch {v.get('torch')}, transformers {v.get('transformers')}, peft {v.get('peft')}, "
        f"deepspeed {v.get('deepspeed')}, {result['dtype']}, 1 process",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _workloads(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        kind, spec_path, result_path = argv[1:4]
        result = WORKERS[kind](json.loads(Path(spec_path).read_text()))
        Path(result_path).write_text(json.dumps(result))
        return 0
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--output", help=f"result JSON (default: {DEFAULT_OUTPUT.relative_to(ROOT)}; smoke: a temp file)"
    )
    p.add_argument("--out", help="also write the result JSON, PNG and log into this directory (e.g. $OUT)")
    p.add_argument("--workloads", type=_workloads, help=f"comma-separated subset of: {', '.join(WORKLOADS)}")
    p.add_argument(
        "--budget-seconds",
        type=float,
        help="wall-clock budget of the whole run; sides that no longer fit are skipped and reported as "
        "such (default: 540; --smoke: none)",
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny configs, a few steps, CPU is fine: tests the script"
    )
    p.add_argument("--run-gpu-tests", action="store_true", help="also run pytest -m gpu tests/gpu first")
    p.add_argument(
        "--extra-sides",
        action="store_true",
        help="also run the diagnostic sides (lorakit without packing for causal, packed T5)",
    )
    p.add_argument(
        "--sides",
        type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
        help=f"only these sides (comma-separated) of: {', '.join(SIDES)}",
    )
    p.add_argument("--work-dir", help="models, data and runs (default: a new temp directory)")
    p.add_argument("--note", action="append", help="a note to store in the result (repeatable)")
    p.add_argument("--merge", nargs="+", metavar="PART_JSON", help="combine parts into --output, then exit")
    p.add_argument("--plot-only", metavar="RESULT_JSON", help="only redraw the chart of an existing result")
    args = p.parse_args(argv)
    args.argv = argv
    if args.plot_only:
        path = Path(args.plot_only)
        if not plot(json.loads(path.read_text()), path.with_suffix(".png")):
            p.error("--plot-only needs matplotlib and a result with measured sides")
        return 0
    if args.merge:
        return merge(
            args.merge,
            Path(args.output or DEFAULT_OUTPUT).resolve(),
            Path(args.out).resolve() if args.out else None,
        )
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
