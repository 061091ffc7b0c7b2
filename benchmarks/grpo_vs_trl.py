"""lorakit's GRPO vs TRL's GRPOTrainer on one CPU process: recipes/quickstart_grpo.yaml's job (tiny Llama, LoRA
r 8 / alpha 16 all-linear, 16 prompts, G 8, 4 new tokens at temperature 0.5, regex reward, dapo, beta 0,
lr 2e-2) both ways. Per run: seconds per optimizer step after the first, generate()'s token slots per second,
mean reward per step. Sides interleaved, order reversed every other round, round i seeded seeds[i] on both sides.
Needs `pip install 'lorakit[bench-trl]'`.

    python benchmarks/grpo_vs_trl.py [--rounds 3] [--seeds 42 43 44] [--steps 12] [--output PATH.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness.provenance import ROOT, Provenance  # noqa: E402

RECIPE = ROOT / "recipes" / "quickstart_grpo.yaml"
SIDES = ("lorakit", "trl")


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


def worker(side: str, steps: int, threads: int, seed: int, result: Path) -> None:
    import torch
    import yaml

    torch.set_num_threads(threads)
    out = {
        "side": side,
        "steps": steps,
        "threads": threads,
        "seed": seed,
        "gen_seconds": 0.0,
        "gen_tokens": 0,
    }
    out.update(reward=[], stamps=[])
    instrument(out)
    with tempfile.TemporaryDirectory() as work:
        recipe = yaml.safe_load(RECIPE.read_text())
        recipe["train"]["seed"] = seed  # LoRA init, prompt order, sampling: each side from the same seed
        (run_lorakit if side == "lorakit" else run_trl)(recipe, Path(work), out)
    stamps = out.pop("stamps")  # before training, then each optimizer step's end
    out["step_seconds"] = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    later, n = out["step_seconds"][1:], min(5, len(out["reward"]) // 2)  # step 1 pays one-off costs
    out.update(step_median=statistics.median(later), step_min=min(later), step_max=max(later))
    out["gen_tokens_per_second"] = out["gen_tokens"] / out["gen_seconds"]
    first, last = statistics.mean(out["reward"][:n]), statistics.mean(out["reward"][-n:])
    out.update(reward_first=first, reward_last=last)
    result.write_text(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per run")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks/results/grpo_vs_trl.json")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[42, 43, 44], help="each round's seed (cycled), both sides"
    )
    parser.add_argument("--note", default="")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)  # SIDE STEPS THREADS SEED RESULT
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], *map(int, args.worker[1:4]), Path(args.worker[4]))
    prov, runs, cpu = Provenance(), [], Path("/proc/cpuinfo")
    result = {"benchmark": "grpo_vs_trl", **prov.start(), "note": args.note, "recipe": RECIPE.name}
    result["versions"]["trl"] = __import__("trl").__version__
    result["machine"]["avx512_bf16"] = cpu.is_file() and "avx512_bf16" in cpu.read_text()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    for i in range(args.rounds):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                load = os.getloadavg()[0]
                seed = args.seeds[i % len(args.seeds)]
                opts = map(str, (args.steps, args.threads, seed))
                cmd = [sys.executable, __file__, "--worker", side, *opts, f.name]
                subprocess.run(cmd, env=env, check=True, cwd=ROOT)
                runs.append({**json.loads(Path(f.name).read_text()), "round": i, "load_1min_before": load})
            print(json.dumps({k: v for k, v in runs[-1].items() if not isinstance(v, list)}), flush=True)
    med = {s: {k: statistics.median(r[k] for r in runs if r["side"] == s) for k in KEYS} for s in SIDES}
    pairs = zip(*([r for r in runs if r["side"] == s] for s in SIDES), strict=True)
    per_round = [{k: a[k] / b[k] for k in ("step_median", "gen_tokens_per_second")} for a, b in pairs]
    result.update(runs=runs, median_over_runs=med, lorakit_over_trl_per_round=per_round, **prov.end())
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"median_over_runs": med, "lorakit_over_trl_per_round": per_round}, indent=1))


KEYS = ("step_median", "gen_tokens_per_second", "reward_first", "reward_last")

if __name__ == "__main__":
    main()
