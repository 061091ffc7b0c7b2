"""The GPU benchmark's Hugging Face side in its worker: Trainer + peft on the same tokenized rows as lorakit,
with the step recorder of harness/steps.py timing every optimizer step."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.harness.steps import StepRecorder, useful_tokens
from benchmarks.harness.workers import one_process_env, train, training_args, with_lora


def hf_worker(spec: dict) -> dict:
    """The usual Hugging Face recipe: Trainer + peft on the rows lorakit prepared (`spec['prepared']`), timed per
    optimizer step; `spec` also holds the method, LoRA settings, lr, seed, ZeRO-3 config and Trainer args."""
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
        one_process_env(spec["master_port"])
        deepspeed = json.loads(json.dumps(spec["hf_zero3"]))
        deepspeed["zero_optimization"]["overlap_comm"] = cuda
        if not cuda:
            deepspeed["optimizer"]["params"]["torch_adam"] = True  # DeepSpeed's fused Adam needs CUDA
    # Arguments before the model, so that under ZeRO-3 from_pretrained loads partitioned (zero.Init).
    kwargs = {"per_device_train_batch_size": spec["batch"], "logging_steps": max(1, spec["steps"] // 4)}
    kwargs.update(spec["hf_args"], output_dir=spec["work_dir"], learning_rate=spec["lr"], deepspeed=deepspeed)
    kwargs.update(bf16=spec["dtype"] == "bfloat16", use_cpu=not cuda, checkpointing=True)
    kwargs["group_by_length"] = spec["group_by_length"]
    args = training_args(hf.Seq2SeqTrainingArguments if seq2seq else hf.TrainingArguments, **kwargs)
    load = {"dtype": getattr(torch, spec["dtype"]), "attn_implementation": spec["hf_attention"]}
    if method == "qlora":
        nf4 = {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
        nf4.update(load_in_4bit=True, bnb_4bit_compute_dtype=load["dtype"])
        load["quantization_config"] = hf.BitsAndBytesConfig(**nf4)
        load.update({"device_map": {"": 0}} if cuda else {})
    auto = hf.AutoModelForSeq2SeqLM if seq2seq else hf.AutoModelForCausalLM
    model = auto.from_pretrained(spec["model_dir"], **load)
    model.config.use_cache = False
    if method == "qlora":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, True, {"use_reentrant": False})
    if method != "full":
        model = with_lora(model, spec["lora"], seq2seq)
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
    trainer, _, losses = train(trainer_class, model, args, rows, collator, tokenizer, StepEnd())
    trainable = [getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad]
    out = {"attention": model.config._attn_implementation, "optimizer_steps": trainer.state.global_step}
    out.update(trainable_params=sum(trainable), useful_tokens_epoch=sum(map(useful_tokens, rec.steps)))
    out.update(token_slots_epoch=sum(s["slots"] for s in rec.steps), **losses)
    out["optimizer"] = type(trainer.optimizer).__name__ if trainer.optimizer is not None else None
    return rec.result(spec["warmup_steps"], out)
