"""GPU validation and benchmark: lorakit vs HF Trainer + peft on realistic model sizes with random weights.

    python benchmarks/gpu_bench.py [--out DIR] [--workloads causal_1b_lora,...] [--budget-seconds S]
                                   [--run-gpu-tests] [--extra-sides] [--work-dir DIR] [--output PATH]
    python benchmarks/gpu_bench.py --smoke            # the same code on CPU, tiny configs
    python benchmarks/gpu_bench.py --merge PART1.json PART2.json [--output benchmarks/results/gpu_h200.json]
    python benchmarks/gpu_bench.py --plot-only benchmarks/results/gpu_h200.json

Every workload (specs/gpu_bench.yaml) trains one model shape with one method (LoRA, full, QLoRA; ZeRO-0 or
ZeRO-3, one process) on synthetic instruction data through lorakit (`lorakit.train`: causal LMs packed, T5
grouped by length) and through the usual Hugging Face recipe (Trainer + peft, DataCollatorForSeq2Seq, the
random sampler; `hf_grouped`: grouped by length), on the same tokenized rows and examples per step. Every
run is a fresh subprocess, timed per optimizer step with a device synchronisation at its end; the first
warm-up steps are left out. MFU = model FLOPs of the timed steps (the spec's flop_accounting) / their wall
time / the GPU's dense bf16 peak, and again / the bf16 matmul rate measured at start. benchmarks/README.md
and docs/gpu.md say more; benchmarks/gpu_lease_plan.md is the plan for this project's lent H200.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from a checkout: the harness and this lorakit

from benchmarks.harness import load_spec, main  # noqa: E402
from benchmarks.harness.provenance import source_digest  # noqa: E402
from benchmarks.harness.runner import Runner  # noqa: E402
from benchmarks.harness.workers import lorakit_worker, one_process_env, train, training_args, with_lora  # noqa: E402

SPEC = load_spec("gpu_bench")
MODELS, WORKLOADS, LORA, LR = SPEC["models"], SPEC["workloads"], SPEC["lora"], SPEC["learning_rates"]


def check_args(args, error) -> None:
    unknown = [n for n in args.workloads or [] if n not in WORKLOADS]
    if unknown or args.workloads == []:
        error(f"argument --workloads: unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")


# ------------------------------------------------------------------------------------------- accounting
def make_config(model: str, smoke: bool, special: dict):
    """The transformers config of a spec model (tiny in smoke mode) with the tokenizer's special ids."""
    from transformers import AutoConfig

    kwargs = {**MODELS[model]["config"], **(MODELS[model]["smoke"] if smoke else {})}
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs, **special)


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
        attention = {"encoder_layers": config.num_layers, "decoder_layers": config.num_decoder_layers}
        attention.update(heads=config.num_heads, head_dim=config.d_kv)
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        attention = {
            "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads,
            "head_dim": head_dim,
        }
    out = {"family": "seq2seq" if seq2seq else "causal", "matmul_params_per_token": params}
    return {**out, "lora_params_per_token": lora, "lora_r": r, "attention": attention}


def model_flops(acc: dict, method: str, sums: dict) -> float:
    """Training FLOPs of `sums` (token and attention-pair counts) under the spec's flop_accounting."""
    base, adapters = (6, 0) if method == "full" else (4, 6)
    p, lo, a = acc["matmul_params_per_token"], acc["lora_params_per_token"], acc["attention"]
    per_pair = 12 * a["heads"] * a["head_dim"]  # 4 FLOPs per pair forward (QK^T, AV), x3 for training
    if acc["family"] == "causal":
        matmul = (base * p["token"] + adapters * lo["token"]) * sums["tokens"]
        return float(matmul + per_pair * a["layers"] * sums["pairs"])
    matmul = sum((base * p[s] + adapters * lo[s]) * sums[f"{s}_tokens"] for s in ("source", "target"))
    decoder = a["decoder_layers"] * (sums["decoder_pairs"] + sums["cross_pairs"])
    return float(matmul + per_pair * (a["encoder_layers"] * sums["encoder_pairs"] + decoder))


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
    tgt = (batch["labels"] != -100).sum(1).tolist()
    return list(zip(batch["attention_mask"].sum(1).tolist(), tgt, strict=True))


class StepRecorder:
    """Per optimizer step: end time (after a device sync) and the token/pair sums of its micro-batches."""

    def __init__(self, family: str, cuda: bool):
        self.family, self.cuda = family, cuda
        self.steps: list[dict] = []
        self.pending = dict.fromkeys(SUM_KEYS[family], 0)

    def add(self, lengths, slots: int) -> None:
        add_lengths(self.pending, self.family, lengths, slots)

    def end(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        self.steps.append({"end": time.perf_counter(), **self.pending})
        self.pending = dict.fromkeys(SUM_KEYS[self.family], 0)

    def result(self, warmup: int, extra: dict) -> dict:
        """Sums and wall time of the steps after the first `warmup` ones, peak memory, and `extra`."""
        import resource

        import torch

        if len(self.steps) <= warmup:
            raise RuntimeError(
                f"only {len(self.steps)} optimizer steps were recorded (warm-up {warmup}): the step "
                "instrumentation no longer sees the training loop, or the data is too small"
            )
        ends = [s["end"] for s in self.steps]
        durations = [b - a for a, b in zip(ends[warmup - 1 :], ends[warmup:], strict=False)]
        out = {
            "steps_recorded": len(self.steps),
            "warmup_steps": warmup,
            "timed_steps": len(self.steps) - warmup,
        }
        out.update(
            timed_seconds=ends[-1] - ends[warmup - 1], step_seconds_median=statistics.median(durations)
        )
        out.update(step_seconds_min=min(durations), step_seconds_max=max(durations))
        out["timed_sums"] = {k: sum(s[k] for s in self.steps[warmup:]) for k in SUM_KEYS[self.family]}
        out["all_useful_tokens"] = sum(useful_tokens(s) for s in self.steps)
        out["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated() if self.cuda else None
        out["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved() if self.cuda else None
        out["peak_cpu_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {**out, **extra}


# ----------------------------------------------------------------------------------------------- workers
def worker_probe(spec: dict) -> dict:
    """The device, its measured bf16 matmul rate, DeepSpeed's fused Adam (JIT-built here once), optional
    backends, versions."""
    import importlib.util
    from importlib import metadata

    import torch
    from transformers import LlamaForCausalLM

    from benchmarks.harness.provenance import versions
    from lorakit.model.attention import choose_attention

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    out: dict = {"device": dev, "versions": versions()}
    out["versions"].update(
        torch_cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version() if cuda else None
    )
    for name in ("flash_attn", "pydantic", "bitsandbytes"):
        try:
            out["versions"][name] = metadata.version(name.replace("_", "-"))
        except Exception:
            out["versions"][name] = out["versions"].get(name)
    if cuda:
        props = torch.cuda.get_device_properties(0)
        out.update(gpu_name=props.name, gpu_memory_bytes=props.total_memory)
        out.update(
            multiprocessors=props.multi_processor_count, compute_capability=f"{props.major}.{props.minor}"
        )
        query = "name,driver_version,memory.total,clocks.max.sm,power.limit"
        smi = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True
        )
        out["nvidia_smi"] = dict(
            zip(query.split(","), (x.strip() for x in smi.stdout.split(",")), strict=False)
        )
    n, dtype = spec["matmul_n"], getattr(torch, spec["dtype"])
    gen = torch.Generator(device=dev).manual_seed(0)
    a, b = (torch.randn(n, n, device=dev, dtype=dtype, generator=gen) for _ in range(2))
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
    seconds = statistics.median(times)
    out["matmul"] = {"n": n, "dtype": spec["dtype"], "data": "random normal", "repeats": len(times)}
    out["matmul"].update(median_seconds=seconds, flops_per_second=2 * n**3 / seconds)
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
    out["flash_attn_importable"] = importlib.util.find_spec("flash_attn") is not None
    out["lorakit_attention_auto"] = choose_attention("auto", LlamaForCausalLM)
    return out


def build_weights(model_dir: str, dtype: str) -> dict:
    """Random weights for the config saved in `model_dir`, made on the device, saved as safetensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    start = time.perf_counter()
    config = AutoConfig.from_pretrained(model_dir)
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
    return {
        "seconds": time.perf_counter() - start,
        "params": params,
        "safetensors_bytes": size,
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


def worker_lorakit(spec: dict) -> dict:
    """lorakit.train on the side's recipe, with a timer at the end of every optimizer step."""
    import torch

    from lorakit.engine import loop

    rec = StepRecorder(spec["family"], torch.cuda.is_available())
    inner = loop.train_window

    def timed_window(*args, **kwargs):  # instrumentation only: reads the batches, changes nothing
        for b in kwargs["window"] if "window" in kwargs else args[2]:
            rec.add(lorakit_batch_lengths(b, spec["family"]), int(b["num_token_slots"]))
        out = inner(*args, **kwargs)
        rec.end()
        return out

    loop.train_window = timed_window
    return rec.result(spec["warmup_steps"], lorakit_worker(dict(spec, fields=SPEC["worker_fields"])))


def worker_hf(spec: dict) -> dict:
    """The usual Hugging Face recipe: Trainer + peft on the same tokenized rows, timed per optimizer step."""
    import torch
    import transformers as hf

    from lorakit.data.cache import load_cached

    cuda, seq2seq, method = torch.cuda.is_available(), spec["family"] == "seq2seq", spec["method"]
    tokenizer = hf.AutoTokenizer.from_pretrained(spec["model_dir"])
    rows = load_cached(Path(spec["prepared"]))[0]["train"]
    rows = rows.remove_columns([c for c in rows.column_names if c not in ("input_ids", "labels")])
    hf.set_seed(SPEC["seed"])
    deepspeed = None
    if spec["zero_stage"] == 3:
        one_process_env(spec["master_port"])
        deepspeed = json.loads(json.dumps(SPEC["hf_zero3"]))
        deepspeed["zero_optimization"]["overlap_comm"] = cuda
        if not cuda:
            deepspeed["optimizer"]["params"]["torch_adam"] = True  # DeepSpeed's fused Adam needs CUDA
    # Arguments before the model, so that under ZeRO-3 from_pretrained loads partitioned (zero.Init).
    args = training_args(
        hf.Seq2SeqTrainingArguments if seq2seq else hf.TrainingArguments,
        checkpointing=True,
        group_by_length=spec["group_by_length"],
        **SPEC["hf_args"],
        output_dir=spec["work_dir"],
        per_device_train_batch_size=spec["batch"],
        learning_rate=LR[method],
        bf16=spec["dtype"] == "bfloat16",
        logging_steps=max(1, spec["steps"] // 4),
        deepspeed=deepspeed,
        use_cpu=not cuda,
    )
    load = {"dtype": getattr(torch, spec["dtype"]), "attn_implementation": spec["hf_attention"]}
    if method == "qlora":
        nf4 = {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
        load["quantization_config"] = hf.BitsAndBytesConfig(
            load_in_4bit=True, **nf4, bnb_4bit_compute_dtype=load["dtype"]
        )
        load.update({"device_map": {"": 0}} if cuda else {})
    model = (hf.AutoModelForSeq2SeqLM if seq2seq else hf.AutoModelForCausalLM).from_pretrained(
        spec["model_dir"], **load
    )
    model.config.use_cache = False
    if method == "qlora":
        from peft import prepare_model_for_kbit_training

        kwargs = {"use_reentrant": False}
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs
        )
    if method != "full":
        model = with_lora(model, LORA, seq2seq)
    rec = StepRecorder(spec["family"], cuda)

    def count(module, args_, kwargs):  # instrumentation only: reads the forward's inputs
        src, slots = kwargs["attention_mask"].sum(1).tolist(), kwargs["input_ids"].numel()
        if seq2seq:
            labels = kwargs["labels"]
            rec.add(list(zip(src, (labels != -100).sum(1).tolist(), strict=True)), slots + labels.numel())
        else:
            rec.add(src, slots)

    model.register_forward_pre_hook(count, with_kwargs=True)

    class StepEnd(hf.TrainerCallback):
        def on_step_end(self, *a, **k):
            rec.end()

    collator = hf.DataCollatorForSeq2Seq(tokenizer, model=model if seq2seq else None, label_pad_token_id=-100)
    kwargs = {"train_dataset": rows, "data_collator": collator, "processing_class": tokenizer}
    trainer = (hf.Seq2SeqTrainer if seq2seq else hf.Trainer)(
        model=model, args=args, **kwargs, callbacks=[StepEnd()]
    )
    _, losses = train(trainer)
    trainable = [
        p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters() if p.requires_grad
    ]
    out = {"attention": model.config._attn_implementation, "optimizer_steps": trainer.state.global_step}
    out.update(trainable_params=sum(trainable), useful_tokens_epoch=sum(useful_tokens(s) for s in rec.steps))
    out.update(token_slots_epoch=sum(s["slots"] for s in rec.steps), **losses)
    out["optimizer"] = type(trainer.optimizer).__name__ if trainer.optimizer is not None else None
    return rec.result(spec["warmup_steps"], out)


WORKERS = {"setup": worker_setup, "lorakit": worker_lorakit, "hf": worker_hf}


# ------------------------------------------------------------------------------------------ orchestration
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
        prompts = np.maximum(1, np.round(total * rng.uniform(*dist["prompt_share"], n))).astype(int)
        return [
            {"prompt": text(p), "response": text(max(1, t - p))} for p, t in zip(prompts, total, strict=True)
        ]
    src, tgt = lengths(*dist["source"]), lengths(*dist["target"])
    return [{"prompt": text(s), "response": text(t)} for s, t in zip(src, tgt, strict=True)]


def write_model_dir(path: Path, model: str, smoke: bool) -> dict:
    """Tokenizer (lorakit's tiny BPE) and config of a model; the weights come from the setup worker."""
    from lorakit.testing import build_tiny_tokenizer

    seq2seq = MODELS[model]["family"] == "seq2seq"
    tokenizer = build_tiny_tokenizer(path, kind="t5" if seq2seq else "llama")
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    if seq2seq:
        special["decoder_start_token_id"] = tokenizer.pad_token_id
    else:
        special["bos_token_id"] = tokenizer.bos_token_id
    config = make_config(model, smoke, special)
    # lorakit caps lengths at min(tokenizer, config) maximum; the tiny tokenizer says 512.
    tokenizer.model_max_length = getattr(config, "max_position_embeddings", None) or 512
    tokenizer.save_pretrained(str(path))
    config.save_pretrained(str(path))
    return accounting(config)


def packed_budget(lengths: list[int], batch: int) -> int:
    """Tokens per packed row: about `batch` examples of mean length (as many tokens as a padded micro-batch
    holds without its padding), a multiple of 256, at least the longest example."""
    return max(math.ceil(batch * statistics.fmean(lengths) / 256) * 256, max(lengths))


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
    """The peaks MFU is measured against: the datasheet's (when the device is known) and the measured one."""
    name, m = probe.get("gpu_name") or "", probe["matmul"]
    sheet, source = next(((f, src) for key, f, src in SPEC["datasheet_bf16"] if key in name), (None, None))
    out = {"device": name or "cpu", "datasheet": sheet}
    out["datasheet_source"] = source or "no datasheet peak known for this device: MFU is not reported"
    out["measured_matmul"] = m["flops_per_second"]
    how = f"{m['n']}^3 {m['dtype']} matmul on random data, median of {m['repeats']} after 3 warm-ups"
    return {**out, "measured_matmul_how": how}


class Session:
    """One invocation on a device: the models built, the probe, the budget; runs workloads side by side."""

    def __init__(self, bench, work: Path, runner: Runner, dtype: str):
        self.bench, self.work, self.runner, self.dtype = bench, work, runner, dtype
        self.smoke = bench.args.smoke
        pick = "smoke_" if self.smoke else ""
        self.lengths, self.caps = SPEC[f"{pick}lengths"], SPEC[f"{pick}caps"]
        self.warmup = SPEC["smoke_steps"]["warmup_steps"] if self.smoke else SPEC["warmup_steps"]
        self.models: dict = {}
        self.max_rows: dict[str, int] = {}
        self.probe = self.peak = None

    def recipe(self, w: dict, side: str, data_file: Path, out: Path, max_tokens: int | None) -> dict:
        """The lorakit recipe of one side of a workload: the spec's, with the workload's model and sizes."""
        packing = w["family"] == "causal" if side == "lorakit" else side == "lorakit_packed"
        method = {"kind": w["method"]} if w["method"] == "full" else {"kind": w["method"], **LORA}
        model_dir, cache = self.work / "models" / w["model"], self.work / "cache"
        over = {"model.name_or_path": str(model_dir), "model.dtype": self.dtype, "method": method}
        over.update({"data.source": str(data_file), "data.packing": packing, "data.cache_dir": str(cache)})
        over["data.max_samples"] = w["batch"] * w["steps"]
        over.update({f"data.{k}": v for k, v in self.shape(w)[2].items()})
        over.update({"train.lr": LR[w["method"]], "train.micro_batch_size": w["batch"]})
        over.update({"distributed.zero_stage": w["zero_stage"], "output.dir": str(out)})
        if packing:
            over["train.max_tokens"] = max_tokens
        over.update(w.get("recipe", {}))  # the workload's own settings (e.g. no gradient checkpointing)
        return self.bench.recipe(None, over)

    def shape(self, w: dict) -> tuple[str, dict, dict]:
        """(data key, length distribution, caps) of a workload: its own where the spec gives them (not in
        smoke mode, which keeps every workload tiny), else its family's."""
        fam, own = w["family"], not self.smoke and "lengths" in w
        return (
            (w["data"] if own else fam),
            (w["lengths"] if own else self.lengths[fam]),
            (w["caps"] if own else self.caps[fam]),
        )

    def workload(self, name: str, w: dict) -> dict:
        """Prepare the data, run every side; returns the workload's result."""
        from transformers import AutoTokenizer

        import lorakit
        from lorakit.recipe import recipe_from_dict

        model = w["model"]
        family = MODELS[model]["family"]
        w = dict(w, family=family)
        result = {"model": model, "like": MODELS[model]["like"], "family": family, "dtype": self.dtype}
        result.update({k: w[k] for k in ("method", "zero_stage", "batch", "steps")}, sides={})
        bnb = self.probe["bitsandbytes"]
        if w.get("needs") == "bitsandbytes" and not bnb["ok"]:
            return dict(result, status="skipped", reason="bitsandbytes unusable: " + bnb["error"])
        model_dir, built = self.work / "models" / model, self.models[model]
        if "error" in built["build"]:
            raise RuntimeError(f"building {model} failed: {built['build']['error']}")
        result.update(accounting=built["accounting"], build=built["build"])
        result["model_config"] = json.loads((model_dir / "config.json").read_text())
        key, dist, caps = self.shape(w)
        data_file = self.work / "data" / f"{key}.jsonl"
        if not data_file.exists():
            data_file.parent.mkdir(parents=True, exist_ok=True)
            tokenizer, seed = AutoTokenizer.from_pretrained(model_dir), SPEC["seed"]
            rows = synthetic_rows(tokenizer, family, self.max_rows[key], dist, seed)
            data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
        plain = self.recipe(w, "hf", data_file, self.work / "runs" / "prepare", None)
        prepared = lorakit.prepare(recipe_from_dict(plain))
        lengths = [int(x) for x in prepared.train["length"]]
        max_tokens = packed_budget(lengths, w["batch"]) if family == "causal" else None
        data = {"rows": len(lengths), "tokens": sum(lengths), "mean_length": statistics.fmean(lengths)}
        data.update(max_length=max(lengths), distribution=dist, caps=caps)
        result["data"] = {**data, "packed_max_tokens": max_tokens}
        if family == "seq2seq":
            result["data"]["target_tokens"] = sum(len(x) for x in prepared.train["labels"])
        sides = list(w["sides"]) + (list(w.get("extra_sides", ())) if self.bench.args.extra_sides else [])
        sides = [s for s in sides if not self.bench.args.sides or s in self.bench.args.sides]
        # Like for like: the HF sides use the backend lorakit uses for unpacked causal batches.
        flash = family == "causal" and self.probe["lorakit_attention_auto"] == "flash_attention_2"
        for side in sides:
            budget = max_tokens
            if side == "lorakit_packed" and family == "seq2seq":
                budget = packed_budget([len(x) for x in prepared.train["input_ids"]], w["batch"])
            extra = {"prepared": str(prepared.path), "hf_attention": "flash_attention_2" if flash else "sdpa"}
            result["sides"][side] = self.side(name, w, side, data_file, budget, extra)
        measured = {s: r for s, r in result["sides"].items() if r.get("status") == "measured"}
        tps = {s: r["useful_tokens_per_second"] for s, r in measured.items()}
        result["ratios"] = {
            f"{s}/{b}": tps[s] / tps[b] for s in tps if s.startswith("lorakit") for b in tps if b[:2] == "hf"
        }
        tokens = {s: r["useful_tokens_epoch"] for s, r in measured.items()}
        # One epoch over the same rows on every side: the same useful tokens.
        losses = [r["loss_last"] for r in measured.values() if r["loss_last"] is not None]
        result["checks"] = {
            "useful_tokens_epoch": tokens,
            "equal_on_all_sides": len(set(tokens.values())) <= 1,
        }
        result["checks"]["finite_losses"] = all(math.isfinite(x) for x in losses)
        statuses = {r["status"] for r in result["sides"].values()}
        if len(measured) == len(sides):
            result["status"] = "measured"
        elif measured:
            result["status"] = "partial"
        elif statuses == {"skipped"}:
            result.update(status="skipped", reason="budget: no side fitted")
        else:
            result["status"] = "failed"
        return result

    def side(self, name: str, w: dict, side: str, data_file: Path, budget, extra: dict) -> dict:
        """One side of a workload in a fresh worker: measured, skipped (budget) or failed."""
        import lorakit
        from lorakit.engine.launch import free_port
        from lorakit.recipe import recipe_from_dict

        runner, log, est = self.runner, self.bench.log, 0 if self.smoke else w.get("est_seconds", 0)
        if runner.remaining() < est + 20:
            log(f"  {name}/{side}: skipped (budget)")
            why = f"budget: {runner.remaining():.0f} s left, a side takes about {est} s"
            return {"status": "skipped", "reason": why}
        work, model_dir = self.work / "runs" / f"{name}-{side}", self.work / "models" / w["model"]
        spec = {k: w[k] for k in ("family", "method", "zero_stage", "batch", "steps")}
        spec.update(dtype=self.dtype, warmup_steps=self.warmup, model_dir=str(model_dir), work_dir=str(work))
        if side.startswith("lorakit"):
            spec["recipe"] = self.recipe(w, side, data_file, work, budget)
            # Tokenize and cache here, so no timed run pays for it.
            lorakit.prepare(recipe_from_dict(spec["recipe"]))
        else:
            spec.update(extra, group_by_length=side == "hf_grouped", master_port=free_port())
        try:
            r = runner.run("lorakit" if side.startswith("lorakit") else "hf", spec, f"{name}-{side}")
        except RuntimeError as e:
            log(f"  {name}/{side}: FAILED ({str(e).splitlines()[0]})")
            return {"status": "failed", "error": str(e)[-3000:]}
        derive(r, self.models[w["model"]]["accounting"], w["method"], self.peak)
        r.update(status="measured", description=SPEC["sides"][side])
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        mem = (r["peak_gpu_memory_bytes"] or 0) / 2**30
        log(
            f"  {name}/{side}: {r['useful_tokens_per_second']:,.0f} useful tok/s, MFU {mfu} "
            f"({r['mfu_vs_measured_matmul']:.1%} of measured matmul), efficiency {r['padding_efficiency_timed']:.2f}, "
            f"step {r['step_seconds_median']:.3f} s, peak {mem:.1f} GiB, {r['process_seconds']:.0f} s in all"
        )
        return r


def evaluate_targets(workloads: dict) -> dict:
    """Each target of the spec with its measured value and whether it was met (None: not measured)."""
    out = {}
    for key, t in SPEC["targets"].items():
        w = workloads.get(t["workload"], {})
        value = (
            w.get("ratios", {}).get(t["ratio"])
            if "ratio" in t
            else w.get("sides", {}).get(t["side"], {}).get("mfu")
        )
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
            ratio, mem = w["ratios"].get(f"{side}/hf"), (r["peak_gpu_memory_bytes"] or 0) / 2**30
            mfu, vs = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a", f"x{ratio:.2f}" if ratio else ""
            rate, eff = r["useful_tokens_per_second"], r["padding_efficiency_timed"]
            lines.append(
                f"{name:21s} {side:15s} {rate:13,.0f} {mfu:>7s} {r['mfu_vs_measured_matmul']:7.1%} {eff:8.2f} {mem:9.1f} {vs:>7s}"
            )
        if not w.get("sides") and w.get("status") in ("skipped", "failed"):
            why = (w.get("reason") or w.get("error") or "").splitlines() or [""]
            lines.append(f"{name:21s} {w['status']}: {why[0][:70]}")
    return "\n".join(lines)


def write_result(result: dict, output: Path, out_dir: Path | None) -> None:
    """The JSON (targets evaluated) and its chart at `output`, copies in `out_dir`; written after every
    workload, so a command killed at its time limit still leaves the finished workloads."""
    from benchmarks.harness.plots import render
    from lorakit.rundir import write_json

    result["targets"] = evaluate_targets(result["workloads"])
    for path in [output] + ([out_dir / output.name] if out_dir and out_dir != output.parent else []):
        write_json(path, result)
        render(sys.modules[__name__], result, path.with_suffix(".png"))


def run_gpu_tests(log_path: Path, log, tests: str = "tests/gpu", timeout: float = 300.0) -> dict:
    """pytest -m gpu tests/gpu, output appended to the log and a junit XML beside it; the counts, and whether
    they passed (gpu_tests_passed), go into the result. A run past `timeout` counts as failed."""
    start = time.perf_counter()
    # One process on the one GPU, and no pytest-xdist there: the machine has pytest, not the dev extra.
    junit = log_path.with_name("gpu_tests_junit.xml")
    command = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=-ra", "-m", "gpu", tests]
    command += ["-p", "no:cacheprovider", f"--junitxml={junit}"]
    try:
        proc = subprocess.run(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        proc = subprocess.CompletedProcess(command, 124, out + f"\n= timed out after {timeout:.0f} s in =")
    with open(log_path, "a") as f:
        f.write("\n===== pytest -m gpu tests/gpu\n" + proc.stdout)
    summary = next((line for line in reversed(proc.stdout.splitlines()) if " in " in line), "").strip("= ")
    log(f"gpu tests: exit code {proc.returncode}: {summary}")
    out = {
        "command": f"python -m pytest -q -m gpu {tests}",
        "exit_code": proc.returncode,
        "summary": summary,
    }
    out["passed"] = gpu_tests_passed(out)
    return {**out, "seconds": time.perf_counter() - start}


def gpu_tests_passed(gpu_tests: dict) -> bool:
    """Whether the GPU tests passed: pytest exited 0 and at least one test ran and passed (tests that all
    skipped, on a machine without CUDA say, checked nothing)."""
    ran = re.search(r"(\d+) passed", gpu_tests.get("summary") or "")
    return gpu_tests.get("exit_code") == 0 and ran is not None and int(ran.group(1)) > 0


def exit_status(result: dict) -> int:
    """The script's exit status for a measured result: 1 when a workload failed or is partial, or when GPU
    tests were asked for (--run-gpu-tests) and did not pass; else 0."""
    failed = [n for n, w in result["workloads"].items() if w.get("status") in ("failed", "partial")]
    gpu = result.get("gpu_tests")
    return 1 if failed or (gpu is not None and not gpu_tests_passed(gpu)) else 0


def merge(paths: list[str], output: Path, out_dir: Path | None) -> int:
    """Combine the results of several invocations (one lease command each) into one result."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    devices = {p["peak_flops"]["device"] for p in parts}
    if len(devices) != 1:
        print(f"error: the parts were measured on different devices: {sorted(devices)}", file=sys.stderr)
        return 2
    result = dict(parts[0], workloads={})
    for p in parts:
        for name, w in p["workloads"].items():
            earlier = result["workloads"].get(name, {"status": "skipped"})
            if w.get("status") == "measured" or earlier.get("status") == "skipped":
                # an earlier measured copy beats a later skipped or failed one; a later try beats a skip
                result["workloads"][name] = w
    keys = ("command", "date", "git_revision", "lorakit_source_sha256", "benchmark_wall_seconds", "versions")
    result["parts"] = [
        {k: p.get(k) for k in (*keys, "gpu_tests")} | {"workloads": list(p["workloads"])} for p in parts
    ]
    result["command"] = " ; ".join(p["command"] for p in parts)
    result["benchmark_wall_seconds"] = sum(p.get("benchmark_wall_seconds") or 0 for p in parts)
    result["gpu_tests"] = ([p["gpu_tests"] for p in parts if p.get("gpu_tests")] or [None])[-1]
    write_result(result, output, out_dir)
    print(table(result))
    print(f"wrote {output}")
    return 0


def measure(bench) -> int:
    args, log, smoke = bench.args, bench.log, bench.args.smoke
    out_dir = Path(args.out).resolve() if args.out else None
    if args.merge:
        return merge(args.merge, bench.output, out_dir)
    # Before anything imports huggingface_hub (it reads these once): nothing here needs the hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="lorakit-gpu-bench-")).resolve()
    (work / "ipc").mkdir(parents=True, exist_ok=True)
    output = bench.output
    log_path = (out_dir or output.parent) / (output.stem + ".log")
    log_path.write_text("")
    # bf16 is what is measured; the CPU smoke run uses float32, since bf16 matmuls are emulated (slow) on CPUs.
    dtype = "float32" if smoke else "bfloat16"
    runner = Runner(__file__, work / "ipc", log_path, args.budget_seconds or (math.inf if smoke else 540.0))
    s = Session(bench, work, runner, dtype)
    workloads = {
        n: dict(WORKLOADS[n], **(SPEC["smoke_steps"] if smoke else {})) for n in args.workloads or WORKLOADS
    }
    for w in workloads.values():
        key = s.shape(dict(w, family=MODELS[w["model"]]["family"]))[0]
        s.max_rows[key] = max(s.max_rows.get(key, 0), w["batch"] * w["steps"])
    digest = source_digest(bench.provenance.files)
    result = bench.result(
        smoke=smoke, dtype=dtype, lorakit_source_sha256=digest, flop_accounting=SPEC["flop_accounting"]
    )
    result.update(sides=SPEC["sides"], lora=LORA, learning_rates=LR, warmup_steps=s.warmup)
    result.update(host=result.pop("machine"), workloads={})
    # Tokenizer and config of every model here (no GPU needed); weights on the device in the setup worker.
    for m in dict.fromkeys(w["model"] for w in workloads.values()):
        (work / "models" / m).mkdir(parents=True, exist_ok=True)
        s.models[m] = {"accounting": write_model_dir(work / "models" / m, m, smoke)}
    spec = {
        "matmul_n": 512 if smoke else 8192,
        "dtype": dtype,
        "models": {m: str(work / "models" / m) for m in s.models},
    }
    try:
        # On a GPU in its own process, so this one never holds device memory; the CPU smoke run saves the
        # start-up of one more interpreter.
        setup = worker_setup(spec) if smoke else runner.run("setup", spec, "setup")
    except RuntimeError as e:
        log(str(e))
        return 1
    s.probe = setup["probe"]
    for m, build in setup["builds"].items():
        s.models[m]["build"] = build
        if "error" in build:
            log(f"building {m} FAILED: {build['error']}")
        else:
            size = f"{build['params'] / 1e9:.3f}B params, {build['safetensors_bytes'] / 2**30:.1f} GiB"
            log(f"built {m}: {size} in {build['seconds']:.0f} s")
    result.update(device={k: v for k, v in s.probe.items() if k != "versions"}, versions=s.probe["versions"])
    result["peak_flops"] = s.peak = peak_of(s.probe)
    sheet = f"{s.peak['datasheet'] / 1e12:.0f}" if s.peak["datasheet"] else "n/a"
    log(
        f"device: {s.peak['device']}; measured {dtype} matmul {s.peak['measured_matmul'] / 1e12:.2f} TFLOP/s; datasheet bf16 peak {sheet} TFLOP/s"
    )
    if s.probe.get("fused_adam"):
        log(f"DeepSpeed fused Adam: {s.probe['fused_adam']}")
    if args.run_gpu_tests:
        result["gpu_tests"] = run_gpu_tests(log_path, log)
    for i, (name, w) in enumerate(workloads.items()):
        log(
            f"workload {name}: {w['model']} {w['method']} ZeRO-{w['zero_stage']}, {runner.remaining():.0f} s left"
        )
        try:
            result["workloads"][name] = s.workload(name, w)
        except Exception as e:  # a setup failure (build, data) loses this workload, not the run
            result["workloads"][name] = {
                "model": w["model"],
                "status": "failed",
                "error": f"{type(e).__name__}: {e}",
            }
            log(f"  {name}: FAILED: {type(e).__name__}: {e}")
        # Free the disk of models no later workload uses (8B is 16 GB).
        later = {x["model"] for x in list(workloads.values())[i + 1 :]}
        for m in [m for m in s.models if m not in later]:
            shutil.rmtree(work / "models" / m, ignore_errors=True)
            s.models.pop(m)
        result["benchmark_wall_seconds"] = time.perf_counter() - bench.provenance.t0
        write_result(result, output, out_dir)
    log(table(result))
    for t in result["targets"].values():
        value, met = t["measured"], {True: "met", False: "not met", None: "-"}[t["met"]]
        shown = "not measured" if value is None else (f"{value:.1%}" if "side" in t else f"x{value:.2f}")
        log(f"target: {t['what']}: {shown} ({met})")
    log(f"wrote {output} (log {log_path}) in {result['benchmark_wall_seconds']:.0f} s")
    if result.get("gpu_tests") is not None and not gpu_tests_passed(result["gpu_tests"]):
        log(f"gpu tests did not pass ({result['gpu_tests']['summary']}): exit status 1")
    return exit_status(result)


def plot(result: dict, plt):
    """Useful tokens/s (with ratio and MFU) and peak GPU memory per workload and side; None when no side was
    measured."""
    workloads = result["workloads"]
    names = [
        n
        for n, w in workloads.items()
        if any(r.get("status") == "measured" for r in w.get("sides", {}).values())
    ]
    if not names:
        return None
    sides = [
        s
        for s in SPEC["sides"]
        if any(workloads[n]["sides"].get(s, {}).get("status") == "measured" for n in names)
    ]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(max(10, 2.2 * len(names) + 4), 5.2))
    width = 0.8 / len(sides)
    for j, side in enumerate(sides):
        xs, tps, mem, labels = [], [], [], []
        for i, n in enumerate(names):
            r = workloads[n]["sides"].get(side, {})
            if r.get("status") != "measured":
                continue
            xs.append(i + (j - (len(sides) - 1) / 2) * width)
            tps.append(r["useful_tokens_per_second"])
            mem.append((r["peak_gpu_memory_bytes"] or r["peak_cpu_rss_bytes"]) / 2**30)
            ratio, mfu = workloads[n]["ratios"].get(f"{side}/hf"), r["mfu"]
            mfu = r["mfu_vs_measured_matmul"] if mfu is None else mfu
            labels.append((f"x{ratio:.2f}\n" if ratio else "") + f"{mfu:.0%}")
        ax.bar(xs, tps, width, label=side, color=f"C{j}")
        ax2.bar(xs, mem, width, label=side, color=f"C{j}")
        for x, y, text in zip(xs, tps, labels, strict=True):
            ax.annotate(text, (x, y), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7)
    for a in (ax, ax2):
        a.set_xticks(range(len(names)), [n.replace("_", "\n", 1) for n in names], fontsize=8)
        a.legend(fontsize=8)
    on_gpu = bool(result["peak_flops"].get("datasheet"))
    ax.set_title(
        f"useful tokens / s (labels: lorakit/hf ratio, {'MFU' if on_gpu else 'of measured matmul'})",
        fontsize=10,
    )
    ax.set_yscale("log")
    ax.margins(y=0.25)
    ax2.set_title(
        "peak GPU memory allocated (GiB)" if on_gpu else "peak memory (GiB; CPU RSS without a GPU)",
        fontsize=10,
    )
    v, smoke = result["versions"], " (smoke, tiny configs)" if result["smoke"] else ""
    versions = f"torch {v.get('torch')}, transformers {v.get('transformers')}, peft {v.get('peft')}, deepspeed {v.get('deepspeed')}"
    fig.suptitle(
        f"{result['peak_flops']['device']}{smoke}: {versions}, {result['dtype']}, 1 process", fontsize=9
    )
    return fig


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
