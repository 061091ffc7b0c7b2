"""lorakit's GRPO vs TRL's GRPOTrainer on one CPU process, recipes/quickstart_grpo.yaml's job both ways; needs
`pip install 'lorakit[bench-trl]'` (what is measured and set alike: benchmarks/README.md, docs/grpo.md).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script: the harness and this lorakit

from benchmarks.harness import ROOT, load_spec, main  # noqa: E402
from benchmarks.harness.runner import medians_of, pairs  # noqa: E402

SPEC = load_spec("grpo_vs_trl")
RECIPE = ROOT / "recipes" / "quickstart_grpo.yaml"
SIDES = ("lorakit", "trl")
KEYS = ("step_median", "gen_tokens_per_second", "reward_first", "reward_last")


def instrument(out: dict) -> None:
    """Times every generate() call and counts the token slots it generated (rows x new positions)."""
    from transformers.generation.utils import GenerationMixin

    generate = GenerationMixin.generate

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        ids = generate(self, *args, **kwargs)
        out["gen_seconds"] += time.perf_counter() - t0
        prompt = kwargs.get("input_ids", args[0] if args else None)
        out["gen_tokens"] += ids.shape[0] * (ids.shape[1] - prompt.shape[1])
        out.setdefault("first_call_prompt_width", prompt.shape[1])
        return ids

    GenerationMixin.generate = timed


def run_lorakit(recipe: dict, work: Path, out: dict) -> None:
    from benchmarks.harness.workers import lorakit_worker
    from lorakit.engine import loop

    account = loop.Trainer._account

    def recorded(self, epoch, stats, seconds):  # the same clock as TRL's side: wall between steps' ends
        out["stamps"].append(time.perf_counter())
        out["reward"].append(stats.get("metrics", {}).get("reward"))
        return account(self, epoch, stats, seconds)

    loop.Trainer._account = recorded
    recipe["train"]["max_steps"], recipe["output"]["dir"] = out["steps"], str(work / "lorakit")
    # TRL's checkpointing is off too (nothing to save on a tiny model), and it runs without DeepSpeed.
    recipe["model"]["gradient_checkpointing"], recipe["distributed"]["zero_stage"] = False, 0
    out["stamps"].append(time.perf_counter())
    lorakit_worker({"recipe": recipe, "torch_threads": out["threads"]})


def run_trl(recipe: dict, work: Path, out: dict) -> None:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lorakit.model.families.tiny import resolve_model_source
    from lorakit.objectives.rewards import regex_reward

    m, d, t, g = recipe["method"], recipe["data"], recipe["train"], recipe["grpo"]
    path = resolve_model_source(recipe["model"]["name_or_path"], Path("~/.cache/lorakit").expanduser())
    rows = [json.loads(x) for x in (ROOT / "lorakit/data/samples/preference_pairs/train.jsonl").open()]
    prompts = [d["prompt_template"].format(input=r[d["input_column"]]) for r in rows[: d["max_samples"]]]

    reward = regex_reward(g["rewards"][0]["pattern"])  # the recipe's reward, lorakit's code: the same scores

    def digit(completions, **_):
        return [reward(c, {}) for c in completions]

    class Stamp(TrainerCallback):  # at each optimizer step's end, before its record is logged
        def on_step_end(self, args, state, control, **kw):
            out["stamps"].append(time.perf_counter())

    config = GRPOConfig(
        output_dir=str(work / "trl"), max_steps=out["steps"], learning_rate=t["lr"], seed=t["seed"],
        per_device_train_batch_size=t["micro_batch_size"] * g["num_generations"],
        gradient_accumulation_steps=t.get("gradient_accumulation_steps", 1),  # TRL generates for all of them
        num_generations=g["num_generations"], max_completion_length=g["max_new_tokens"],
        temperature=g["temperature"], top_p=1.0, top_k=0, beta=g["beta"], loss_type=g["loss"],
        scale_rewards="group", num_iterations=1, epsilon=0.2, warmup_steps=0, weight_decay=0.0,
        lr_scheduler_type="linear", max_grad_norm=1.0, bf16=False, gradient_checkpointing=False, use_cpu=True,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    lora = LoraConfig(
        r=m["r"], lora_alpha=m["alpha"], lora_dropout=m["dropout"], target_modules=m["target_modules"],
        task_type="CAUSAL_LM",
    )  # fmt: skip
    torch.manual_seed(t["seed"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model, reward_funcs=digit, args=config, train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=AutoTokenizer.from_pretrained(path), peft_config=lora, callbacks=[Stamp()],
    )  # fmt: skip
    torch.set_num_threads(out["threads"])
    out["stamps"].append(time.perf_counter())
    trainer.train()
    out["reward"] = [h["reward"] for h in trainer.state.log_history if "reward" in h]


def worker(spec: dict) -> dict:
    """One run of `spec['side']` (the harness has set its torch threads) in this fresh process."""
    import yaml

    out = {k: spec[k] for k in ("side", "steps", "seed")}
    out.update(threads=spec["torch_threads"], gen_seconds=0.0, gen_tokens=0, reward=[], stamps=[])
    instrument(out)
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["train"]["seed"] = spec["seed"]  # LoRA init, prompt order, sampling: each side from the same seed
    (run_lorakit if spec["side"] == "lorakit" else run_trl)(recipe, Path(spec["work_dir"]), out)
    stamps = out.pop("stamps")  # before training, then each optimizer step's end
    out["step_seconds"] = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    later, n = out["step_seconds"][1:], min(5, len(out["reward"]) // 2)  # step 1 pays one-off costs
    out.update(step_median=statistics.median(later), step_min=min(later), step_max=max(later))
    out["gen_tokens_per_second"] = out["gen_tokens"] / out["gen_seconds"]
    first, last = statistics.mean(out["reward"][:n]), statistics.mean(out["reward"][-n:])
    return {**out, "reward_first": first, "reward_last": last}


WORKERS = dict.fromkeys(SIDES, worker)


def measure(bench) -> int:
    a = bench.args
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the workers inherit this process's variables

    def run(side: str, rnd: int) -> dict:
        seed = a.seeds[rnd % len(a.seeds)]
        spec = {"side": side, "steps": a.steps, "torch_threads": a.threads, "seed": seed}
        return bench.run(side, kind=side, spec=spec)

    runs = bench.rounds(list(SIDES), a.rounds, run)
    med = {s: medians_of([r for r in runs if r["side"] == s], KEYS) for s in SIDES}
    per_round = [{k: x[k] / y[k] for k in KEYS[:2]} for y, x in pairs(runs, "lorakit", "trl")]
    result = bench.result(recipe=RECIPE.name, runs=runs, median_over_runs=med)
    result["lorakit_over_trl_per_round"] = per_round
    result["versions"]["trl"] = metadata.version("trl")
    bench.log(json.dumps({"median_over_runs": med, "lorakit_over_trl_per_round": per_round}, indent=1))
    return bench.finish(result)


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
