"""lorakit vs the Seq2SeqTrainer recipe people copy: useful tokens per second over one epoch.

    python benchmarks/seq2seq_padding.py [--max-samples N] [--repeats K] [--torch-threads T] [--smoke] ...
    python benchmarks/seq2seq_padding.py --plot-only benchmarks/results/seq2seq_padding.json

The baseline is the recipe of Philipp Schmid's "Fine-tune FLAN-T5 XL/XXL using DeepSpeed & Hugging Face
Transformers" (padding="max_length", Seq2SeqTrainer, with peft LoRA), without and with its ZeRO-3; the expert
pads dynamically and groups by length; lorakit trains the same rows. Sides: specs/seq2seq_padding.yaml.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script: the harness and this lorakit

from benchmarks.harness import load_spec, main, plots  # noqa: E402
from benchmarks.harness.runner import claims, first_of  # noqa: E402
from benchmarks.harness.workers import dig, guide_preprocess, one_process_env, train, training_args, with_lora  # noqa: E402

SPEC = load_spec("seq2seq_padding")
SIDES = list(SPEC["sides"])


def default_output(args) -> str:
    return SPEC["datasets"][args.dataset]["output"]


def data_overrides(bench) -> dict:
    """The recipe's data keys of --dataset; `code` rows are generated into the invocation's temp dir."""
    data = dict(SPEC["datasets"][bench.args.dataset]["data"])
    if data.get("source") == "generated":
        from benchmarks.prepare_speed import write_rows

        (bench.tmp / "code").mkdir(exist_ok=True)
        write_rows(bench.tmp / "code" / "train.jsonl", bench.args.max_samples, "code")
        data["source"] = str(bench.tmp / "code")
    return {f"data.{k}": v for k, v in data.items()}


def check_args(args, error) -> None:
    unknown = sorted(set(args.sides or ()) - set(SIDES))
    if unknown:
        error(f"--sides: unknown side(s) {', '.join(unknown)}; the sides are {', '.join(SIDES)}")


def hf_worker(spec: dict) -> dict:
    """One Seq2SeqTrainer run: the guide's pipeline (padding to max_length) or the expert's (dynamic)."""
    import datasets
    import torch
    import transformers as hf

    from lorakit.data.samples import builtin_dataset_dir
    from lorakit.testing import resolve_model_source

    recipe, dynamic = spec["recipe"], spec["hf"]["padding"] == "dynamic"
    data, cfg = recipe["data"], recipe["train"]
    source = resolve_model_source(recipe["model"]["name_or_path"], data["cache_dir"])
    tokenizer = hf.AutoTokenizer.from_pretrained(source)
    builtin = data["source"].startswith("builtin:")
    where = builtin_dataset_dir(data["source"].removeprefix("builtin:")) if builtin else Path(data["source"])
    path = where / "train.jsonl"
    rows = datasets.load_dataset("json", data_files={"train": str(path)}, split="train")
    rows = rows.select(range(data["max_samples"]))
    # The guide pads every row to the caps; the expert leaves padding to the collator, batch by batch.
    columns = (data["input_column"], data["target_column"])
    caps = (spec["max_source_length"], spec["max_target_length"])
    padding = "do_not_pad" if dynamic else "max_length"
    preprocess = guide_preprocess(tokenizer, data["prompt_template"], columns, caps, padding)
    rows = rows.map(preprocess, batched=True, remove_columns=rows.column_names)
    hf.set_seed(cfg["seed"])
    dtype, attention = getattr(torch, recipe["model"]["dtype"]), spec["attention"]
    model = hf.AutoModelForSeq2SeqLM.from_pretrained(source, dtype=dtype, attn_implementation=attention)
    model.config.use_cache = False
    model = with_lora(model, recipe["method"], seq2seq=True)
    collator = hf.DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    out = {"useful_tokens": 0, "token_slots": 0, "samples": 0}
    out.update(epoch_seconds=0.0, epoch_cpu_seconds=0.0, step_seconds=0.0)

    def counting_collator(features):  # counts what every trained batch holds; the batch itself is untouched
        batch = collator(features)
        out["useful_tokens"] += int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())
        out["token_slots"] += batch["input_ids"].numel() + batch["labels"].numel()
        out["samples"] += batch["input_ids"].shape[0]
        return batch

    marks = {}

    class Timer(hf.TrainerCallback):
        def on_train_begin(self, *a, **k):
            # DeepSpeed's initialisation inside the Trainer resets torch's thread count (to one per core);
            # pin it again so every side computes with the same number of threads.
            if spec.get("torch_threads"):
                torch.set_num_threads(spec["torch_threads"])

        def on_epoch_begin(self, *a, **k):
            marks.update(epoch=time.perf_counter(), cpu=time.process_time())

        def on_epoch_end(self, *a, **k):
            out["epoch_seconds"] += time.perf_counter() - marks["epoch"]
            out["epoch_cpu_seconds"] += time.process_time() - marks["cpu"]

        def on_step_begin(self, *a, **k):
            marks["step"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            out["step_seconds"] += time.perf_counter() - marks["step"]

    deepspeed = None
    if spec["hf"].get("zero3"):  # the model is loaded before the arguments, as in the guide's script
        one_process_env(spec["master_port"])
        deepspeed = spec["guide_zero3"]
    # group_by_length: the expert's LengthGroupedSampler; the guide samples at random.
    kwargs = {k: dig(recipe, key) for k, key in SPEC["hf_from_recipe"].items()}
    kwargs.update(spec["hf_args"], deepspeed=deepspeed, output_dir=spec["work_dir"], group_by_length=dynamic)
    args = training_args(hf.Seq2SeqTrainingArguments, **kwargs)
    trainer, metrics, losses = train(
        hf.Seq2SeqTrainer, model, args, rows, counting_collator, tokenizer, Timer()
    )
    params = list(model.parameters())
    out.update(steps=trainer.state.global_step, trainer_train_runtime=metrics["train_runtime"], **losses)
    out.update(attention=model.config._attn_implementation, total_params=sum(p.numel() for p in params))
    out["trainable_params"] = sum(p.numel() for p in params if p.requires_grad)
    out.update(torch_threads=torch.get_num_threads(), train_sampling_strategy=args.train_sampling_strategy)
    out["max_source_length"] = max(map(len, rows["input_ids"]))
    out["max_target_length"] = max(map(len, rows["labels"]))
    return out


WORKERS = {"hf": hf_worker}


def analysis(medians: dict, first: dict) -> dict:
    """Arithmetic on the medians (derived, not separately measured): where the epoch time goes. Differences
    that need a side which was not run (--sides) are left out."""
    sides = list(first)
    epoch = {s: medians[s]["epoch_seconds"] for s in sides}
    out = {"steps_per_epoch": {s: first[s]["steps"] for s in sides}}
    out["seconds_per_step"] = {s: medians[s]["seconds_per_step"] for s in sides}
    out["cpu_seconds_per_wall_second"] = {s: medians[s]["epoch_cpu_seconds"] / epoch[s] for s in sides}
    lorakit = "lorakit_zero0"
    for other in ("baseline", "expert"):
        if other in first and lorakit in first:
            slots = first[other]["token_slots"] / first[lorakit]["token_slots"]
            out[f"token_slots_{other}_over_lorakit"] = slots
            steps = first[other]["steps"]
            out[f"{other}_minus_zero0_seconds_per_step"] = (epoch[other] - epoch[lorakit]) / steps
    if {"lorakit_zero0", "lorakit_zero3"} <= set(sides):
        z3, z0 = epoch["lorakit_zero3"], epoch["lorakit_zero0"]
        out["zero3_minus_zero0_seconds_per_step"] = (z3 - z0) / first["lorakit_zero0"]["steps"]
        out["zero3_minus_zero0_share_of_zero3_epoch"] = (z3 - z0) / z3
    if {"baseline", "baseline_zero3"} <= set(sides):
        z3, z0 = epoch["baseline_zero3"], epoch["baseline"]
        out["baseline_zero3_minus_baseline_seconds_per_step"] = (z3 - z0) / first["baseline"]["steps"]
    out["how_to_read"] = SPEC["analysis_how_to_read"]
    return out


def measure(bench) -> int:
    from transformers import T5ForConditionalGeneration

    import lorakit
    from lorakit.engine.launch import free_port
    from lorakit.model import load_config
    from lorakit.model.attention import choose_attention
    from lorakit.recipe import recipe_from_dict

    args, spec, log = bench.args, bench.spec, bench.log
    data_keys = data_overrides(bench)
    recipe = recipe_from_dict(bench.recipe("lorakit_zero3", data_keys))
    data = lorakit.prepare(recipe)  # builds the tiny T5, tokenizes and caches; the lorakit runs reuse it
    log(data.describe())
    _, config = load_config(recipe)
    lengths = {"max_source_length": data.lengths.max_source_length}
    lengths["max_target_length"] = data.lengths.max_target_length
    hf_spec = {**lengths, "attention": choose_attention("auto", T5ForConditionalGeneration)}
    hf_spec.update(guide_zero3=spec["guide_zero3"], hf_args=spec["hf_args"])

    def run(side: str, _round: int) -> dict:
        hf = spec["sides"][side].get("hf")
        if hf is None:
            return bench.run(side, overrides=data_keys)
        worker = {**hf_spec, "recipe": bench.recipe(side, data_keys), "hf": hf, "master_port": free_port()}
        return bench.run(side, kind="hf", spec=worker)

    sides = [s for s in SIDES if s in (args.sides or SIDES)]
    runs = bench.rounds(sides, args.repeats, run)
    # Only the comparisons and claims whose two sides both ran.
    comparisons = [c for c in spec["comparisons"] if set(c) <= set(sides)]
    medians, ratios = bench.summarise(runs, sides, comparisons)
    tokens = {r["useful_tokens"] for r in runs}
    equal = len(tokens) == 1
    first = {side: next(r for r in runs if r["side"] == side) for side in sides}
    judged = [c for c in spec["claims"] if {c["side"], c["versus"]} <= set(sides)]
    measured = claims(judged, ratios, medians, equal, spec["ratio_key"])
    met = bool(measured) and all(c["claim_met"] for c in measured)
    result = bench.result(claims=measured, claims_met=met)
    # The first claim's pair; none when --sides left out both claims' sides.
    head = measured[0] if measured else None
    result["headline_pair"] = spec["ratio_key"].format(**head) if head else None
    result["headline_ratio"] = head["measured_ratio"] if head else None
    base = {**spec["recipe"]["data"], **{k.removeprefix("data."): v for k, v in data_keys.items()}}
    source = base["source"] if base["source"].startswith("builtin:") else SPEC["generated_source"]
    data_setup = {"dataset": args.dataset, "source": source, "split": base["split"]}
    data_setup["rows"] = args.max_samples
    data_setup.update(prompt_template=base["prompt_template"], **lengths, lengths_from=spec["lengths_from"])
    stats = ("source_tokens_untruncated", "target_tokens_untruncated", "truncated_sources")
    stats += ("truncated_targets",)
    data_setup.update({k: data.stats.get(k) for k in stats})
    checkpointing = {"use_reentrant": False} if args.gradient_checkpointing else None
    whole = next((s for s in sides if "zero3" not in s), sides[0])  # ZeRO-3 sides count a partition
    setup = bench.setup(runs, sides, config, data_setup, dtype_why=spec["dtype_why"])
    setup["model"]["total_params"] = first[whole]["total_params"]
    setup["model"]["trainable_params"] = first_of(runs, sides, "trainable_params")
    setup.update(gradient_checkpointing_kwargs=checkpointing, evaluation="disabled on all sides")
    setup["saving"] = "disabled on all sides"
    result.update(setup=setup, sides=bench.describe(sides), **bench.per_side(runs, sides, equal, medians))
    result.update(medians=medians, ratios=ratios, runs=runs, analysis=analysis(medians, first))
    log(f"useful tokens: {result['useful_tokens']['per_side']} (equal: {equal})")
    return bench.finish(result, equal)


def plot(result: dict, plt):
    """Per-run and median useful tokens/s of each side (ratios to its pairs above), and padding efficiency."""
    fig, (ax, ax2) = plots.panels(plt, [1, 1], scale=7.0)
    labels = {s: SPEC["sides"][s]["label"] for s in result["medians"]}

    plots.speed_bars(ax, result, labels, None, name=lambda s: labels[s].replace("\n", " "))
    efficiency = [result["padding_efficiency"][s] for s in labels]
    no_runs, no_notes = [[]] * len(labels), [""] * len(labels)
    plots.bars(ax2, list(labels.values()), efficiency, no_runs, no_notes, "padding efficiency")
    ax2.set_ylim(0, 1)
    return fig


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
