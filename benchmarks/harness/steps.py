"""Per optimizer step, for the GPU benchmark: what a model costs (the spec's flop_accounting), a recorder that
times steps and sums what they held, and the two sides' workers: lorakit's, and Trainer + peft."""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path

from benchmarks.harness import workers

SEQ2SEQ_SUMS = ("source_tokens", "target_tokens", "encoder_pairs", "decoder_pairs", "cross_pairs")
CAUSAL_SUMS = ("tokens", "pairs", "examples", "slots")
SUM_KEYS = {"causal": CAUSAL_SUMS, "seq2seq": (*SEQ2SEQ_SUMS, "examples", "slots")}


def accounting(config, r: int) -> dict:
    """Matmul parameters per token of each stream and attention dimensions, counted on a meta-device model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    with torch.device("meta"):
        model = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_config(config)
    head, params, lora = model.get_output_embeddings(), {}, {}
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
        attention = {"layers": config.num_hidden_layers, "heads": config.num_attention_heads}
        attention["head_dim"] = head_dim
    out = {"family": "seq2seq" if seq2seq else "causal", "matmul_params_per_token": params}
    return {**out, "lora_params_per_token": lora, "lora_r": r, "attention": attention}


def flop_parts(acc: dict, sums: dict) -> tuple[int, int, int]:
    """(frozen matmul parameters x their tokens, LoRA parameters x their tokens, the attention's forward
    FLOPs: 4 per (query, key) pair and head dimension) of `sums`."""
    p, lo, a = acc["matmul_params_per_token"], acc["lora_params_per_token"], acc["attention"]
    per_pair = 4 * a["heads"] * a["head_dim"]
    if acc["family"] == "causal":
        tokens = sums["tokens"]
        return p["token"] * tokens, lo["token"] * tokens, per_pair * a["layers"] * sums["pairs"]
    frozen = sum(p[s] * sums[f"{s}_tokens"] for s in ("source", "target"))
    lora = sum(lo[s] * sums[f"{s}_tokens"] for s in ("source", "target"))
    decoder = a["decoder_layers"] * (sums["decoder_pairs"] + sums["cross_pairs"])
    return frozen, lora, per_pair * (a["encoder_layers"] * sums["encoder_pairs"] + decoder)


def model_flops(acc: dict, method: str, sums: dict, count: str = "lorakit") -> float:
    """Training FLOPs of `sums` under the spec's flop_accounting (`count`: lorakit's LoRA count or NeMo's)."""
    from lorakit.meter import lora_training_flops

    frozen, lora, attention = flop_parts(acc, sums)
    if method == "full":
        return float(6 * frozen + 3 * attention)
    return float(lora_training_flops(frozen, lora, attention)[count])


def peak_of(probe: dict, datasheets: list) -> dict:
    """The peaks MFU is measured against: the device's datasheet peak and the probe's matmul rate."""
    name, m = probe.get("gpu_name") or "", probe["matmul"]
    sheet, source = next(((f, src) for key, f, src in datasheets if key in name), (None, None))
    out = {"device": name or "cpu", "datasheet": sheet}
    out["datasheet_source"] = source or "no datasheet peak known for this device: MFU is not reported"
    out["measured_matmul"] = m["flops_per_second"]
    how = f"{m['n']}^3 {m['dtype']} matmul on random data, median of {m['repeats']} after 3 warm-ups"
    return {**out, "measured_matmul_how": how}


def rates(side: dict, acc: dict, method: str, peak: dict) -> None:
    """Rates, FLOPs and MFU of one measured side (in place)."""
    sums, seconds = side["timed_sums"], side["timed_seconds"]
    side["useful_tokens_timed"] = useful_tokens(sums)
    side["useful_tokens_per_second"] = side["useful_tokens_timed"] / seconds
    side["padding_efficiency_timed"] = side["useful_tokens_timed"] / sums["slots"]
    side["model_flops_timed"] = model_flops(acc, method, sums)
    side["model_flops_per_second"] = side["model_flops_timed"] / seconds
    side["mfu"] = side["model_flops_per_second"] / peak["datasheet"] if peak.get("datasheet") else None
    side["mfu_vs_measured_matmul"] = side["model_flops_per_second"] / peak["measured_matmul"]
    # NeMo's LoRA count of the same step, so its published MFU and ours are the same measure.
    side["model_flops_nemo_timed"] = model_flops(acc, method, sums, "nemo")
    nemo_rate = side["model_flops_nemo_timed"] / seconds
    side["mfu_nemo"] = nemo_rate / peak["datasheet"] if peak.get("datasheet") else None


def useful_tokens(sums: dict) -> int:
    return sums["tokens"] if "tokens" in sums else sums["source_tokens"] + sums["target_tokens"]


def lorakit_batch_lengths(batch: dict, family: str):
    """Per-example lengths of a lorakit micro-batch (packed or padded; causal: L, seq2seq: (Ls, Lt))."""
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
        """One micro-batch: its examples' lengths (causal: L; seq2seq: (Ls, Lt)) and its token slots."""
        sums = self.pending
        sums["slots"] += slots
        for item in lengths:
            sums["examples"] += 1
            if self.family == "causal":
                sums["tokens"] += int(item)
                sums["pairs"] += int(item) * (int(item) + 1) // 2
                continue
            s, t = (int(x) for x in item)
            sums["source_tokens"] += s
            sums["target_tokens"] += t
            sums["encoder_pairs"] += s * s
            sums["decoder_pairs"] += t * (t + 1) // 2
            sums["cross_pairs"] += t * s

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
        n = len(self.steps)
        out = {"steps_recorded": n, "warmup_steps": warmup, "timed_steps": n - warmup}
        out["timed_seconds"] = ends[-1] - ends[warmup - 1]
        out["step_seconds_median"] = statistics.median(durations)
        out.update(step_seconds_min=min(durations), step_seconds_max=max(durations))
        out["timed_sums"] = {k: sum(s[k] for s in self.steps[warmup:]) for k in SUM_KEYS[self.family]}
        out["all_useful_tokens"] = sum(useful_tokens(s) for s in self.steps)
        out["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated() if self.cuda else None
        out["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved() if self.cuda else None
        out["peak_cpu_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {**out, **extra}


def lorakit_worker(spec: dict) -> dict:
    """workers.lorakit_worker with a timer at the end of every optimizer step; the recorder's result."""
    import os

    import torch

    from lorakit.engine import loop

    os.environ.update(spec.get("env", {}))  # an A/B workload's switch (specs/gpu_bench.yaml `env`)
    rec, inner = StepRecorder(spec["family"], torch.cuda.is_available()), loop.train_window
    # The last warm-up step runs under torch.profiler (it is not timed; the profiler stops inside it).
    profile_at, profiled = (spec["warmup_steps"] - 1 if spec.get("profile") else None), {}

    def timed_window(*args, **kwargs):  # instrumentation only: reads the batches, changes nothing
        for b in kwargs["window"] if "window" in kwargs else args[2]:
            rec.add(lorakit_batch_lengths(b, spec["family"]), int(b["num_token_slots"]))
        prof = torch.profiler.profile() if len(rec.steps) == profile_at else None  # CPU, and CUDA if present
        if prof is not None:
            prof.start()
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        if prof is not None:
            if rec.cuda:
                torch.cuda.synchronize()
            profiled.update(prof=prof, step=len(rec.steps), seconds=time.perf_counter() - start)
            prof.stop()
        rec.end()
        return out

    loop.train_window = timed_window
    result = rec.result(spec["warmup_steps"], workers.lorakit_worker(spec))
    if profiled:
        from benchmarks.harness.gpu_result import profile_summary

        result["profile"] = profile_summary(**profiled)
    return result


def hf_worker(spec: dict) -> dict:
    """The usual Hugging Face recipe, Trainer + peft, on the rows lorakit prepared, timed per step."""
    import torch
    import transformers as hf

    from lorakit.data.cache import load_cached

    cuda, seq2seq, method = torch.cuda.is_available(), spec["family"] == "seq2seq", spec["method"]
    tokenizer = hf.AutoTokenizer.from_pretrained(spec["model_dir"])
    rows = load_cached(Path(spec["prepared"]))[0]["train"]
    rows = rows.remove_columns([c for c in rows.column_names if c not in ("input_ids", "labels")])
    hf.set_seed(spec["seed"])
    deepspeed = None
    if spec["zero_stage"] == 3:
        zero3 = json.loads(json.dumps(spec["hf_zero3"]))  # a copy: changed below
        deepspeed = workers.one_process_deepspeed(spec["master_port"], zero3)
        deepspeed["zero_optimization"]["overlap_comm"] = cuda
        if not cuda:
            deepspeed["optimizer"]["params"]["torch_adam"] = True  # DeepSpeed's fused Adam needs CUDA
    # Arguments before the model, so that under ZeRO-3 from_pretrained loads partitioned (zero.Init).
    kwargs = {"per_device_train_batch_size": spec["batch"], "logging_steps": max(1, spec["steps"] // 4)}
    kwargs.update(spec["hf_args"], output_dir=spec["work_dir"], learning_rate=spec["lr"], deepspeed=deepspeed)
    kwargs.update(bf16=spec["dtype"] == "bfloat16", use_cpu=not cuda, checkpointing=True)
    kwargs["group_by_length"] = spec["group_by_length"]
    args = workers.training_args(hf.Seq2SeqTrainingArguments if seq2seq else hf.TrainingArguments, **kwargs)
    load = {"dtype": getattr(torch, spec["dtype"]), "attn_implementation": spec["hf_attention"]}
    if method == "qlora":
        nf4 = {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
        nf4.update(load_in_4bit=True, bnb_4bit_compute_dtype=load["dtype"])
        load["quantization_config"] = hf.BitsAndBytesConfig(**nf4)
        load.update({"device_map": {"": 0}} if cuda else {})
    model = workers.hf_model(spec["model_dir"], None if method == "full" else spec["lora"], seq2seq, **load)
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
    trainer_class = hf.Seq2SeqTrainer if seq2seq else hf.Trainer
    trainer, _, losses = workers.train(trainer_class, model, args, rows, collator, tokenizer, StepEnd())
    trainable = [getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad]
    out = {"attention": model.config._attn_implementation, "optimizer_steps": trainer.state.global_step}
    out.update(trainable_params=sum(trainable), useful_tokens_epoch=sum(map(useful_tokens, rec.steps)))
    out.update(token_slots_epoch=sum(s["slots"] for s in rec.steps), **losses)
    out["optimizer"] = type(trainer.optimizer).__name__ if trainer.optimizer is not None else None
    return rec.result(spec["warmup_steps"], out)
