"""What runs inside a worker process: `lorakit.train` with our timers and counters (`Clock`: lorakit's loop
has no hooks, so they wrap its internals; benchmarks/README.md), and what the Trainer baselines share."""

from __future__ import annotations

import time
from collections import defaultdict


class Clock:
    """Wall and CPU seconds per phase, and how many times each ran, of the functions it wraps."""

    def __init__(self) -> None:
        self.wall, self.cpu, self.calls = defaultdict(float), defaultdict(float), defaultdict(int)
        self.times = defaultdict(list)  # (wall, cpu) of each call

    def add(self, phase: str, wall: float, cpu: float) -> None:
        self.wall[phase] += wall
        self.cpu[phase] += cpu
        self.calls[phase] += 1
        self.times[phase].append((wall, cpu))

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - w, time.process_time() - c)

        return timed

    def patch(self, targets: dict) -> None:
        """Wraps each `phase: 'module:Owner.name'` (instrumentation only: times, changes nothing)."""
        import functools
        import importlib

        for phase, path in targets.items():
            module, attribute = path.split(":")
            *owners, name = attribute.split(".")
            owner = functools.reduce(getattr, owners, importlib.import_module(module))
            setattr(owner, name, self.wrap(phase, getattr(owner, name)))


def dig(summary: dict, path: str):
    """`summary['a']['b']` for path 'a.b'; None where any part is missing (e.g. no eval section)."""
    node = summary
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def count_batches(counts: dict, window: list[dict], family: str) -> None:
    """Adds what each micro-batch of a window holds (instrumentation only: reads, changes nothing)."""
    for b in window:
        ids, labels, mask = b["input_ids"], b["labels"], b.get("attention_mask")
        loss = int((labels != -100).sum())
        add = {"examples": int(b.get("num_examples", ids.shape[0])), "micro_batches": 1, "rows": ids.shape[0]}
        if family == "causal":
            useful = int(mask.sum()) if mask is not None else ids.numel()
            widest = {"widest_row": ids.shape[1]}
        else:  # encoder tokens (packed rows mark them by segment) + target tokens
            source = int(mask.sum()) if mask is not None else int((b["source_segments"] > 0).sum())
            useful, add["source_tokens"] = source + loss, source
            widest = {"widest_source_row": ids.shape[1], "widest_target_row": labels.shape[1]}
        for key, n in {**add, "loss_tokens": loss, "counted_useful_tokens": useful}.items():
            counts[key] = counts.get(key, 0) + n
        counts.update({k: max(counts.get(k, 0), n) for k, n in widest.items()})


def lorakit_worker(spec: dict) -> dict:
    """`lorakit.train(spec['recipe'])` in this process: `spec['fields']` of its summary (`{name: dotted
    path}`), the epoch's (and evaluation's) seconds, and with `spec['count']` what the micro-batches held."""
    import torch

    import lorakit
    from lorakit.engine import loop
    from lorakit.recipe import recipe_from_dict

    clock, counts, timer = Clock(), {}, {}
    clock.patch({"run": "lorakit.engine.loop:Trainer.run", "eval": "lorakit.engine.session:Job.evaluate"})
    run, window = loop.Trainer.run, loop.train_window

    def pinned_run(self):
        # DeepSpeed's initialisation can reset torch's thread count; pin it again before the clock starts.
        if spec.get("torch_threads"):
            torch.set_num_threads(spec["torch_threads"])
        try:
            return run(self)
        finally:
            wall, cpu = clock.wall.get("eval", 0.0), clock.cpu.get("eval", 0.0)
            if self.evaluate is not None:
                timer.update(eval_seconds=wall, eval_cpu_seconds=cpu)
            timer.update(epoch_seconds=clock.wall["run"] - wall, epoch_cpu_seconds=clock.cpu["run"] - cpu)
            timer["torch_threads"] = torch.get_num_threads()

    def counted_window(engine, inputs, batches, *args, **kwargs):
        if spec.get("count"):
            count_batches(counts, batches, spec["count"])
        return window(engine, inputs, batches, *args, **kwargs)

    loop.Trainer.run, loop.train_window = pinned_run, counted_window
    summary = lorakit.train(recipe_from_dict(spec["recipe"])).summary
    return {**timer, **counts, **{name: dig(summary, path) for name, path in spec.get("fields", {}).items()}}


def one_process_deepspeed(port: int, config: dict) -> dict:
    """`config` for the Trainer's `deepspeed=`, after setting the launcher's variables for one process."""
    import os

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return config


def training_args(cls, *, checkpointing: bool, group_by_length: bool, **kwargs):
    """`cls(**kwargs)` (Seq2Seq)TrainingArguments with the names this transformers version has."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(cls)}
    ckpt = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    kwargs[ckpt] = checkpointing
    kwargs[f"{ckpt}_kwargs"] = {"use_reentrant": False} if checkpointing else None
    if "train_sampling_strategy" in fields:
        kwargs["train_sampling_strategy"] = "group_by_length" if group_by_length else "random"
    else:
        kwargs["group_by_length"] = group_by_length
    return cls(**{k: v for k, v in kwargs.items() if k in fields})


def hf_model(path: str, lora: dict | None, seq2seq: bool, **load):
    """A Trainer baseline's model: from_pretrained(path, **load) without its generation cache (ready for
    k-bit training when `load` quantizes it), with peft's LoRA from a recipe's method section unless None."""
    import transformers as hf
    from peft import LoraConfig, TaskType, get_peft_model, prepare_model_for_kbit_training

    model = (hf.AutoModelForSeq2SeqLM if seq2seq else hf.AutoModelForCausalLM).from_pretrained(path, **load)
    model.config.use_cache = False
    if "quantization_config" in load:
        model = prepare_model_for_kbit_training(model, True, {"use_reentrant": False})
    if lora is None:
        return model
    task = TaskType.SEQ_2_SEQ_LM if seq2seq else TaskType.CAUSAL_LM
    kwargs = {"r": lora["r"], "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"]}
    return get_peft_model(model, LoraConfig(**kwargs, target_modules=lora["target_modules"], task_type=task))


def guide_preprocess(tokenizer, template: str, columns: tuple, caps: tuple, padding: str = "max_length"):
    """The preprocess_function of the FLAN-T5 DeepSpeed guide: inputs and targets (`columns`) tokenized,
    padded to the `caps` (unless `padding` is "do_not_pad") and truncated, pad ids in labels -100."""
    pad = {"padding": padding, "truncation": True}

    def preprocess_function(sample):
        sources = [template.format(input=x) for x in sample[columns[0]]]
        model_inputs = tokenizer(sources, max_length=caps[0], **pad)
        labels = tokenizer(text_target=sample[columns[1]], max_length=caps[1], **pad)["input_ids"]
        model_inputs["labels"] = [[t if t != tokenizer.pad_token_id else -100 for t in ids] for ids in labels]
        return model_inputs

    return preprocess_function


def train(cls, model, args, rows, collator, tokenizer, callback) -> tuple:
    """`cls` (Seq2Seq)Trainer trained on `rows`: (trainer, metrics, first and last logged loss)."""
    kwargs = {"train_dataset": rows, "data_collator": collator, "processing_class": tokenizer}
    trainer = cls(model=model, args=args, **kwargs, callbacks=[callback])
    metrics = trainer.train().metrics
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h] or [None]
    return trainer, metrics, {"loss_first": losses[0], "loss_last": losses[-1]}
