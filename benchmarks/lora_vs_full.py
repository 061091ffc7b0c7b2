"""LoRA vs full fine-tuning of the same briefly pre-trained tiny model: quality, memory, speed.

    python benchmarks/lora_vs_full.py [--lrs 3e-4,1e-3,3e-3,1e-2,3e-2] [--max-samples N] [--smoke] ...
    python benchmarks/lora_vs_full.py --plot-only benchmarks/results/lora_vs_full.json

`lorakit.train` pre-trains every weight of the random `tiny:llama`; LoRA and full fine-tuning of it then train
on the same packed rows at every lr of --lrs (round i: both at lr_i, paired), each judged at its best eval loss,
and `lorakit.compare` reports the best runs. The worker also measures the model state it holds (weights,
gradients, AdamW state). Sides and texts: specs/lora_vs_full.yaml; benchmarks/README.md says more.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # as a script: the harness and this lorakit

from benchmarks.harness import load_spec, main, plots  # noqa: E402
from benchmarks.harness.runner import median, paired_ratios  # noqa: E402
from benchmarks.harness.workers import Clock, lorakit_worker  # noqa: E402

SPEC = load_spec("lora_vs_full")
METHODS = ("lora", "full")
TIMER_CPU = ("epoch_cpu_seconds", "eval_cpu_seconds")  # the run's own CPU times replace the timer's


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def worker(spec: dict) -> dict:
    """One lorakit.train run, instrumented for CPU time in the training windows and model-state bytes."""
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    measured, clock, step = {"grads": 0}, Clock(), DeepSpeedEngine.step

    def measured_step(self, *args, **kwargs):
        if self.is_gradient_accumulation_boundary():
            grads = _bytes(p.grad for p in self.module.parameters() if p.grad is not None)
            measured["grads"] = max(measured["grads"], grads)
        return step(self, *args, **kwargs)

    def model_state(trainer) -> None:
        module = trainer.engine.module
        # lorakit's Engine wraps DeepSpeed's (`inner`), which keeps the torch optimizer inside its wrappers;
        # at ZeRO-0 in fp32 it is the optimizer.
        ds = trainer.engine.inner
        opt = getattr(ds.optimizer, "optimizer", ds.optimizer)
        measured["weights"] = _bytes(module.parameters())
        measured["trainable_weights"] = _bytes(p for p in module.parameters() if p.requires_grad)
        states = [t for state in opt.state.values() for t in state.values() if torch.is_tensor(t)]
        measured["optimizer"] = _bytes(states)

    DeepSpeedEngine.step = measured_step
    clock.patch({"window": "lorakit.engine.loop:train_window"})
    r = lorakit_worker(spec, at_run_end=model_state, clock=clock)
    r = {k: v for k, v in r.items() if k not in ("epoch_seconds", "eval_seconds", *TIMER_CPU)}
    state = {k: measured[k] for k in ("weights", "trainable_weights", "grads", "optimizer")}
    state["total"] = state["weights"] + state["grads"] + state["optimizer"]
    # The whole of Trainer.run, the evaluation after the epoch included.
    wall, cpu = clock.wall["run"], clock.cpu["run"]
    r.update(train_cpu_seconds=clock.cpu["window"], model_state_bytes=state, run_wall_seconds=wall)
    return {**r, "run_cpu_per_wall": cpu / wall}


WORKERS = {"lorakit": worker}


def summarise(runs: list[dict], best: dict[str, dict]) -> dict:
    """Ratios full / LoRA: speed per round (paired), memory and quality at each method's best lr."""
    lora, full = best["lora"], best["full"]
    cpu = paired_ratios(runs, "lora", "full", "tokens_per_cpu_second")
    wall = paired_ratios(runs, "lora", "full", "tokens_per_second")
    rss = {m: median(r["peak_rss_bytes"] for r in runs if r["side"] == m) for m in METHODS}
    out = {"lora_over_full_tokens_per_cpu_second": {"paired_per_round": cpu, "median": median(cpu)}}
    out["lora_over_full_tokens_per_second"] = {"paired_per_round": wall, "median": median(wall)}
    state = full["model_state_bytes"]["total"] / lora["model_state_bytes"]["total"]
    out.update(full_over_lora_model_state_bytes=state, full_over_lora_peak_rss=rss["full"] / rss["lora"])
    out["full_over_lora_trainable_params"] = full["trainable_params"] / lora["trainable_params"]
    out["eval_loss_best"] = {"lora": lora["eval_loss"], "full": full["eval_loss"]}
    out["eval_loss_full_minus_lora"] = full["eval_loss"] - lora["eval_loss"]
    return {**out, "best_lr": {"lora": lora["lr"], "full": full["lr"]}}


def measure(bench) -> int:
    import lorakit

    args, spec, log = bench.args, bench.spec, bench.log
    report_dir = bench.output.with_suffix("")

    def run(side: str, name: str, **overrides) -> dict:
        # The run directory's name is the run's name in lorakit.compare's report: the method, under its lr.
        run_dir = str(bench.tmp / "runs" / name)
        fields = {"run_dir": run_dir, "lr": overrides.get("train.lr")}
        return bench.run(side, name.replace("/", "-"), {"output.dir": run_dir, **overrides}, **fields)

    log(f"pre-training tiny:llama (full, completion on articles, {args.pretrain_epochs} epochs)")
    pre = run("pretrain", "pretrain", **{"train.epochs": args.pretrain_epochs})

    def finetune(method: str, rnd: int) -> dict:
        lr = args.lrs[rnd]
        return run(method, f"lr{lr:g}/{method}", **{"train.lr": lr, "model.name_or_path": pre["model_dir"]})

    runs = bench.rounds(list(METHODS), len(args.lrs), finetune, "round (one learning rate each)")
    best = {m: min((r for r in runs if r["side"] == m), key=lambda r: r["eval_loss"]) for m in METHODS}
    # The report compares the two best runs; its tables and plots are lorakit.compare's own.
    best_dirs = [best["lora"]["run_dir"], best["full"]["run_dir"]]
    comparison = lorakit.compare(best_dirs, output=report_dir, gpu_hour_price=args.gpu_hour_price)
    log(comparison.table())
    tokens, steps = sorted({r["train_tokens"] for r in runs}), sorted({r["steps"] for r in runs})
    text, recipe = spec["setup"], spec["recipe"]
    pretrain = spec["sides"]["pretrain"]["recipe"]
    pretrain_setup = {"method": "full", "data": text["pretrain_data"], "epochs": args.pretrain_epochs}
    pretrain_setup.update({k: pretrain["train"][k] for k in ("lr", "max_tokens")})
    template, max_tokens = repr(recipe["data"]["prompt_template"]), recipe["train"]["max_tokens"]
    finetune = {"data": text["finetune_data"].format(template=template, max_tokens=max_tokens)}
    finetune.update(rows=args.max_samples, eval_rows=args.eval_samples, epochs=recipe["train"]["epochs"])
    lora = {k: v for k, v in spec["sides"]["lora"]["recipe"]["method"].items() if k != "kind"}
    finetune.update(lrs=args.lrs, schedule=text["schedule"], lora=lora)
    setup = {"model": text["model"], "pretrain": pretrain_setup, "finetune": finetune}
    setup["engine"] = text["engine"]
    setup["torch_threads"] = sorted({r["torch_threads"] for r in runs})
    checks = {"same_train_tokens_on_every_run": len(tokens) == 1, "same_steps_on_every_run": len(steps) == 1}
    checks.update(train_tokens=tokens, steps=steps)
    report = comparison.report
    compare = {"report": str(report.relative_to(ROOT)) if report.is_relative_to(ROOT) else ""}
    compare["plots"] = sorted(p.name for p in comparison.plots.values())
    result = bench.result(measures=spec["measures"])
    result.update(setup=setup, checks=checks)
    kept = ("eval_loss", "loss_first", "loss_last", "steps", "train_tokens")
    result["pretrain"] = {k: pre[k] for k in kept}
    result["best"] = {m: {k: v for k, v in best[m].items() if k != "model_dir"} for m in METHODS}
    result.update(summary=summarise(runs, best), compare=compare)
    result["runs"] = [{k: v for k, v in r.items() if k != "model_dir"} for r in runs]
    s = result["summary"]
    cpu = s["lora_over_full_tokens_per_cpu_second"]["median"]
    wall = s["lora_over_full_tokens_per_second"]["median"]
    log(
        f"best lr: lora {s['best_lr']['lora']:g}, full {s['best_lr']['full']:g}; eval loss lora "
        f"{s['eval_loss_best']['lora']:.4f}, full {s['eval_loss_best']['full']:.4f}; tokens per CPU-second "
        f"lora/full {cpu:.2f}x (wall {wall:.2f}x); model state full/lora "
        f"{s['full_over_lora_model_state_bytes']:.2f}x; report in {report_dir}/"
    )
    same = checks["same_train_tokens_on_every_run"] and checks["same_steps_on_every_run"]
    return bench.finish(result, same)


def plot(result: dict, plt):
    """Eval loss against learning rate, tokens per CPU-second per round, model-state bytes."""
    runs = result["runs"]
    fig, (a1, a2, a3) = plots.panels(plt, [1, 1, 1], height=4.4, scale=4.7)
    for i, m in enumerate(METHODS):
        mine = sorted((r for r in runs if r["side"] == m), key=lambda r: r["lr"])
        a1.plot([r["lr"] for r in mine], [r["eval_loss"] for r in mine], "o-", color=f"C{i}", label=m)
        xs = [r["repeat"] + (i - 0.5) * 0.38 for r in mine]
        a2.bar(xs, [r["tokens_per_cpu_second"] for r in mine], 0.38, color=f"C{i}", label=m)
    a1.set_xscale("log")
    a1.set(xlabel="learning rate", ylabel="eval loss (summaries)", title="quality: eval loss after 1 epoch")
    lrs = result["setup"]["finetune"]["lrs"]
    a2.set_xticks(range(len(lrs)), [f"lr {lr:g}" for lr in lrs])
    speed = result["summary"]["lora_over_full_tokens_per_cpu_second"]["median"]
    title = f"speed per round (LoRA / full, median of rounds: {speed:.2f}x)"
    a2.set(ylabel="useful tokens per CPU-second (1 thread)", title=title)
    bottom = [0.0, 0.0]
    for j, part in enumerate(("weights", "grads", "optimizer")):
        values = [result["best"][m]["model_state_bytes"][part] / 2**20 for m in METHODS]
        a3.bar(METHODS, values, bottom=bottom, color=f"C{j + 2}", label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ratio = result["summary"]["full_over_lora_model_state_bytes"]
    a3.set(ylabel="MiB", title=f"model state (full / LoRA: {ratio:.2f}x)")
    for a in (a1, a2, a3):
        a.legend(fontsize=8)
        a.grid(alpha=0.3, axis="y")
    return fig


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
