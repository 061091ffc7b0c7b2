"""LoRA vs full fine-tuning of the same briefly pre-trained tiny model: quality, memory, speed.

    python benchmarks/lora_vs_full.py [--output benchmarks/results/lora_vs_full.json] [--lrs 3e-4,1e-3,3e-3,1e-2,3e-2]
                                      [--max-samples N] [--pretrain-epochs E] [--cache-dir DIR]
                                      [--torch-threads T] [--note TEXT]
    python benchmarks/lora_vs_full.py --plot-only benchmarks/results/lora_vs_full.json

1. Pre-training: `lorakit.train` with `method.kind: full` and `data.format: completion` trains every weight of
   the random `tiny:llama` on the articles of the builtin news_summaries train split, so the fine-tuning
   sides start from a model that has learned something (LoRA adapts it; on a random model LoRA would be
   adapting noise). The saved run_dir/model is the base of step 2.
2. Fine-tuning: the downstream task is summarisation (instruction format: article -> highlights, loss on the
   summary). LoRA (r 16, all linear layers) and full fine-tuning train on the same rows, in the same packed
   micro-batches, for the same epochs: the same tokens. Each method is run at every learning rate of --lrs
   (a method's best learning rate differs; each is judged at its best, by eval loss on the validation split).
   Round i runs both methods at lr_i, back to back, alternating which goes first, so speed ratios are paired
   within a round (speed does not depend on the learning rate: the same batches, the same computation).
3. `lorakit.compare` puts the best LoRA and the best full run side by side: report.md and its plots are kept
   next to the result (benchmarks/results/lora_vs_full/).

Memory: lorakit's summary records peak RSS (CPU); on a model this small it is mostly the Python and library
runtime, so the worker also measures the model state it holds: the bytes of weights, gradients (summed over
p.grad at each optimizer step) and optimizer state (the AdamW moments in optimizer.state).
Every run is a fresh subprocess of this script (benchmarks.common.run_worker).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from a checkout: benchmarks.common and this lorakit

from benchmarks.common import (  # noqa: E402
    changed_files,
    load_average,
    machine,
    median,
    paired_ratios,
    run_worker,
    source_digest,
    source_dirty,
    source_files,
    versions,
)

DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "lora_vs_full.json"
PROMPT = "Summarize the following news article:\n{input}\nSummary:\n"  # recipes/quickstart_causal.yaml
METHODS = ("lora", "full")
LORA = {"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"}
MAX_TOKENS = 1024  # tokens per packed micro-batch: ~7.6 examples of the mean length 134
PRETRAIN_LR = 3e-3  # a random tiny model wants a large step
MEASURED = {
    "eval_loss": "lorakit's eval loss (mean per target token) on the first --eval-samples validation rows, "
    "after the last epoch (summary.json eval.loss)",
    "tokens_per_second": "lorakit's summary.json tokens_per_second: useful (non-pad) tokens / train_seconds "
    "(the training steps; evaluation, model build and data preparation excluded)",
    "peak_rss_bytes": "summary.json peak_memory_bytes.cpu_rss: the worker process's peak resident memory",
    "model_state_bytes": "measured in the worker: weights = bytes of every parameter after training; grads = "
    "the most bytes held in p.grad at any optimizer step; optimizer = bytes of every tensor in the AdamW "
    "state after training",
    "tokens_per_cpu_second": "useful tokens / CPU seconds of this process inside the training windows "
    "(lorakit.engine.loop.train_window: forward, backward, optimizer step), measured in the worker. With one "
    "torch thread it is the speed on a quiet core, and far less sensitive than wall time to other jobs "
    "taking the core; the headline speed ratio uses it",
    "run_cpu_per_wall": "CPU seconds / wall seconds of lorakit.engine.loop.Trainer.run with 1 torch thread: "
    "well below 1 means another job took the core",
}


def _recipe(spec: dict) -> dict:
    """The recipe of one run: pre-training (completion, full) or a fine-tuning side."""
    common = {
        "distributed": {"num_processes": 1, "zero_stage": 0},
        "output": {"dir": spec["run_dir"], "save_adapter": spec["phase"] == "pretrain"},
        "eval": {"generate": False},
    }
    data = {
        "source": "builtin:news_summaries",
        "max_samples": spec["max_samples"],
        "max_eval_samples": spec["eval_samples"],
        "packing": True,
        "cache_dir": spec["cache_dir"],
    }
    if spec["phase"] == "pretrain":
        return {
            **common,
            "model": {"name_or_path": "tiny:llama", "dtype": "float32", "gradient_checkpointing": False},
            "method": {"kind": "full"},
            "data": {**data, "format": "completion", "text_column": "article"},
            "train": {
                "epochs": spec["epochs"],
                "lr": PRETRAIN_LR,
                "max_tokens": MAX_TOKENS,
                "warmup_ratio": 0.05,
                "seed": 0,
            },
        }
    method = {"kind": spec["method"], **(LORA if spec["method"] == "lora" else {})}
    return {
        **common,
        "model": {"name_or_path": spec["base"], "dtype": "float32", "gradient_checkpointing": True},
        "method": method,
        "data": {
            **data,
            "format": "instruction",
            "input_column": "article",
            "target_column": "highlights",
            "prompt_template": PROMPT,
        },
        "train": {
            "epochs": spec["epochs"],
            "lr": spec["lr"],
            "max_tokens": MAX_TOKENS,
            "warmup_ratio": 0.05,
            "lr_schedule": "linear",
            "seed": 42,
        },
    }


# ----------------------------------------------------------------------------------------------- worker
def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def worker(spec: dict) -> dict:
    """One lorakit.train run in this process, instrumented for wall/CPU time and model-state bytes."""
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    import lorakit
    from lorakit.engine import loop
    from lorakit.recipe import recipe_from_dict

    measured: dict = {"grads": 0, "train_cpu_seconds": 0.0}
    step = DeepSpeedEngine.step

    def measured_step(self, *args, **kwargs):
        if self.is_gradient_accumulation_boundary():
            grads = _bytes(p.grad for p in self.module.parameters() if p.grad is not None)
            measured["grads"] = max(measured["grads"], grads)
        return step(self, *args, **kwargs)

    window = loop.train_window

    def measured_window(*args, **kwargs):
        cpu = time.process_time()
        try:
            return window(*args, **kwargs)
        finally:
            measured["train_cpu_seconds"] += time.process_time() - cpu

    run = loop.Trainer.run

    def measured_run(self):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return run(self)
        finally:
            measured["run_wall_seconds"] = time.perf_counter() - wall
            measured["run_cpu_seconds"] = time.process_time() - cpu
            module = self.engine.module
            # DeepSpeed keeps the torch optimizer inside its wrappers; at ZeRO-0 in fp32 it is the optimizer.
            opt = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
            measured["weights"] = _bytes(module.parameters())
            measured["trainable_weights"] = _bytes(p for p in module.parameters() if p.requires_grad)
            measured["optimizer"] = _bytes(
                t for state in opt.state.values() for t in state.values() if torch.is_tensor(t)
            )

    DeepSpeedEngine.step, loop.Trainer.run, loop.train_window = measured_step, measured_run, measured_window
    s = lorakit.train(recipe_from_dict(_recipe(spec))).summary
    state = {k: measured[k] for k in ("weights", "trainable_weights", "grads", "optimizer")}
    state["total"] = state["weights"] + state["grads"] + state["optimizer"]
    return {
        "method": s["method"],
        "steps": s["steps"],
        "train_tokens": s["train_tokens"],
        "loss_tokens": s["data"].get("loss_tokens"),
        "tokens_per_second": s["tokens_per_second"],
        "train_seconds": s["train_seconds"],
        "train_cpu_seconds": measured["train_cpu_seconds"],
        "tokens_per_cpu_second": s["train_tokens"] / measured["train_cpu_seconds"],
        "eval_loss": (s.get("eval") or {}).get("loss"),
        "loss_first": s["loss"]["first"],
        "loss_last": s["loss"]["last"],
        "trainable_params": s["trainable_params"],
        "total_params": s["total_params"],
        "peak_rss_bytes": s["peak_memory_bytes"]["cpu_rss"],
        "model_state_bytes": state,
        "run_wall_seconds": measured["run_wall_seconds"],
        "run_cpu_per_wall": measured["run_cpu_seconds"] / measured["run_wall_seconds"],
        "torch_threads": torch.get_num_threads(),
        "model_dir": s.get("model_dir"),
    }


# ------------------------------------------------------------------------------------------ orchestration
def _run(spec: dict, tmp: Path, name: str, log) -> dict:
    spec = dict(spec, run_dir=str(tmp / "runs" / name))
    r = run_worker(__file__, spec, tmp, name.replace("/", "-"))
    r.update(run_dir=spec["run_dir"], lr=spec.get("lr"))
    log(
        f"  {name:22s} eval loss {r['eval_loss']:.4f}  {r['tokens_per_second']:8.1f} tok/s  "
        f"{r['tokens_per_cpu_second']:8.1f} tok/cpu-s  "
        f"model state {r['model_state_bytes']['total'] / 2**20:6.2f} MiB  cpu/wall {r['run_cpu_per_wall']:.2f}"
    )
    return r


def _summarise(runs: list[dict], best: dict[str, dict]) -> dict:
    """Ratios full / LoRA: speed per round (paired), memory and quality at each method's best lr."""
    lora, full = best["lora"], best["full"]
    cpu = paired_ratios(runs, "lora", "full", "tokens_per_cpu_second")
    wall = paired_ratios(runs, "lora", "full", "tokens_per_second")
    return {
        "lora_over_full_tokens_per_cpu_second": {"paired_per_round": cpu, "median": median(cpu)},
        "lora_over_full_tokens_per_second": {"paired_per_round": wall, "median": median(wall)},
        "full_over_lora_model_state_bytes": full["model_state_bytes"]["total"]
        / lora["model_state_bytes"]["total"],
        "full_over_lora_peak_rss": median(r["peak_rss_bytes"] for r in runs if r["side"] == "full")
        / median(r["peak_rss_bytes"] for r in runs if r["side"] == "lora"),
        "full_over_lora_trainable_params": full["trainable_params"] / lora["trainable_params"],
        "eval_loss_best": {"lora": lora["eval_loss"], "full": full["eval_loss"]},
        "eval_loss_full_minus_lora": full["eval_loss"] - lora["eval_loss"],
        "best_lr": {"lora": lora["lr"], "full": full["lr"]},
    }


def orchestrate(args) -> int:
    t0 = time.perf_counter()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    import lorakit
    from lorakit.rundir import git_revision, write_json

    revision, digest, files = git_revision(ROOT), source_digest(), source_files()
    dirty = source_dirty() if revision else None

    def log(msg):
        print(msg, flush=True)

    shared = {
        "cache_dir": str(Path(args.cache_dir).expanduser().resolve()),
        "max_samples": args.max_samples,
        "eval_samples": args.eval_samples,
        "torch_threads": args.torch_threads,
    }
    output = Path(args.output).expanduser().resolve()
    report_dir = output.with_suffix("")
    with tempfile.TemporaryDirectory(prefix="lorakit-lora-vs-full-") as name:
        tmp = Path(name)
        log(f"pre-training tiny:llama (full, completion on articles, {args.pretrain_epochs} epochs)")
        pre = _run(dict(shared, phase="pretrain", epochs=args.pretrain_epochs), tmp, "pretrain", log)
        runs = []
        for i, lr in enumerate(args.lrs):
            order = METHODS if i % 2 == 0 else METHODS[::-1]
            log(f"round {i + 1}/{len(args.lrs)}: lr {lr:g}, {' -> '.join(order)}")
            for position, method in enumerate(order):
                spec = dict(shared, phase="finetune", method=method, lr=lr, epochs=1, base=pre["model_dir"])
                r = _run(spec, tmp, f"lr{lr:g}/{method}", log)
                runs.append(dict(r, side=method, repeat=i, position=position))
        best = {m: min((r for r in runs if r["side"] == m), key=lambda r: r["eval_loss"]) for m in METHODS}
        # The report compares the two best runs; its tables and plots are lorakit.compare's own.
        comparison = lorakit.compare(
            [best["lora"]["run_dir"], best["full"]["run_dir"]],
            output=report_dir,
            gpu_hour_price=args.gpu_hour_price,
        )
        log(comparison.table())
    tokens = sorted({r["train_tokens"] for r in runs})
    steps = sorted({r["steps"] for r in runs})
    summary = _summarise(runs, best)
    result = {
        "benchmark": "lora_vs_full",
        "measured": "LoRA vs full fine-tuning of the same pre-trained tiny Llama on the same rows, batches and "
        "tokens: eval loss at each method's best learning rate, model-state bytes and peak RSS, tokens/s "
        "(paired per round), trainable parameters",
        "command": "python benchmarks/lora_vs_full.py " + " ".join(args.argv),
        "date": started,
        "load_average_at_start": load_average(),
        "measures": MEASURED,
        "setup": {
            "model": "tiny:llama (lorakit.testing): hidden 64, intermediate 128, 2 layers, 4 heads (2 KV), vocab "
            "2000, random init, then pre-trained here",
            "pretrain": {
                "method": "full",
                "data": "builtin:news_summaries train split, format completion, text_column article",
                "epochs": args.pretrain_epochs,
                "lr": PRETRAIN_LR,
                "max_tokens": MAX_TOKENS,
            },
            "finetune": {
                "data": "builtin:news_summaries, format instruction (article -> highlights, loss on the "
                f"summary), template {PROMPT!r}, packed rows of {MAX_TOKENS} tokens",
                "rows": args.max_samples,
                "eval_rows": args.eval_samples,
                "epochs": 1,
                "lrs": args.lrs,
                "schedule": "linear, 5% warmup, torch AdamW (betas 0.9/0.999, no weight decay), clipping 1.0, "
                "seed 42",
                "lora": LORA,
            },
            "engine": "DeepSpeed, ZeRO stage 0, 1 process, float32, gradient checkpointing on (fine-tuning), "
            "SDPA per example on packed rows",
            "torch_threads": sorted({r["torch_threads"] for r in runs}),
        },
        "machine": machine(),
        "versions": versions(),
        "git_revision": revision,
        "checks": {
            "same_train_tokens_on_every_run": len(tokens) == 1,
            "same_steps_on_every_run": len(steps) == 1,
            "train_tokens": tokens,
            "steps": steps,
        },
        "pretrain": {k: pre[k] for k in ("eval_loss", "loss_first", "loss_last", "steps", "train_tokens")},
        "best": {m: {k: v for k, v in best[m].items() if k != "model_dir"} for m in METHODS},
        "summary": summary,
        "compare": {
            "report": str(comparison.report.relative_to(ROOT))
            if comparison.report.is_relative_to(ROOT)
            else "",
            "plots": sorted(p.name for p in comparison.plots.values()),
        },
        "runs": [{k: v for k, v in r.items() if k != "model_dir"} for r in runs],
        "notes": list(args.note or []),
    }
    end = source_digest()
    result["lorakit_source"] = {
        "uncommitted_changes_at_start": dirty,
        "sha256_at_start": digest,
        "sha256_at_end": end,
        "unchanged_during_run": digest == end,
        # Other work goes on in the same checkout: which of lorakit's files changed while this ran.
        "changed_during_run": changed_files(files, source_files()),
    }
    result["benchmark_wall_seconds"] = time.perf_counter() - t0
    write_json(output, result)
    s = summary
    log(
        f"best lr: lora {s['best_lr']['lora']:g}, full {s['best_lr']['full']:g}; eval loss lora "
        f"{s['eval_loss_best']['lora']:.4f}, full {s['eval_loss_best']['full']:.4f}; tokens per CPU-second lora/full "
        f"{s['lora_over_full_tokens_per_cpu_second']['median']:.2f}x (wall "
        f"{s['lora_over_full_tokens_per_second']['median']:.2f}x); model state full/lora "
        f"{s['full_over_lora_model_state_bytes']:.2f}x"
    )
    log(f"wrote {output} and {report_dir}/ in {result['benchmark_wall_seconds']:.0f} s")
    if plot(result, output.with_suffix(".png")):
        log(f"wrote {output.with_suffix('.png')}")
    if not (
        result["checks"]["same_train_tokens_on_every_run"] and result["checks"]["same_steps_on_every_run"]
    ):
        print("error: the runs did not train on the same tokens and steps", file=sys.stderr)
        return 1
    return 0


def plot(result: dict, path: Path) -> bool:
    """Eval loss against learning rate, tokens/s per round, model-state bytes; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = result["runs"]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4.4))
    for i, m in enumerate(METHODS):
        mine = sorted((r for r in runs if r["side"] == m), key=lambda r: r["lr"])
        a1.plot([r["lr"] for r in mine], [r["eval_loss"] for r in mine], "o-", color=f"C{i}", label=m)
        rounds = [r["repeat"] for r in mine]
        a2.bar(
            [x + (i - 0.5) * 0.38 for x in rounds],
            [r["tokens_per_cpu_second"] for r in mine],
            0.38,
            color=f"C{i}",
            label=m,
        )
    a1.set_xscale("log")
    a1.set(xlabel="learning rate", ylabel="eval loss (summaries)", title="quality: eval loss after 1 epoch")
    lrs = result["setup"]["finetune"]["lrs"]
    a2.set_xticks(range(len(lrs)), [f"lr {lr:g}" for lr in lrs])
    speed = result["summary"]["lora_over_full_tokens_per_cpu_second"]["median"]
    a2.set(
        ylabel="useful tokens per CPU-second (1 thread)",
        title=f"speed per round (LoRA / full, median of rounds: {speed:.2f}x)",
    )
    best = result["best"]
    parts = ("weights", "grads", "optimizer")
    bottom = [0.0, 0.0]
    for j, part in enumerate(parts):
        values = [best[m]["model_state_bytes"][part] / 2**20 for m in METHODS]
        a3.bar(METHODS, values, bottom=bottom, color=f"C{j + 2}", label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ratio = result["summary"]["full_over_lora_model_state_bytes"]
    a3.set(ylabel="MiB", title=f"model state (full / LoRA: {ratio:.2f}x)")
    for a in (a1, a2, a3):
        a.legend(fontsize=8)
        a.grid(alpha=0.3, axis="y")
    v = result["versions"]
    fig.suptitle(
        f"tiny Llama pre-trained {result['setup']['pretrain']['epochs']} epochs, then LoRA vs full on "
        f"{result['setup']['finetune']['rows']} rows; CPU ({result['machine']['cpu_count']} cores), torch "
        f"{v['torch']}, transformers {v['transformers']}, deepspeed {v['deepspeed']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _lrs(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"learning rates must be > 0, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        spec = json.loads(Path(argv[1]).read_text())
        if spec.get("torch_threads"):
            import torch

            torch.set_num_threads(spec["torch_threads"])
        Path(argv[2]).write_text(json.dumps(worker(spec)))
        return 0
    p = argparse.ArgumentParser(
        prog="python benchmarks/lora_vs_full.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--output", default=str(DEFAULT_OUTPUT), help="result JSON (default: %(default)s)")
    p.add_argument(
        "--lrs", type=_lrs, default=_lrs("3e-4,1e-3,3e-3,1e-2,3e-2"), help="fine-tuning learning rates"
    )
    p.add_argument("--max-samples", type=int, default=1000, help="training rows (default: all 1000)")
    p.add_argument("--eval-samples", type=int, default=100, help="validation rows (default: all 100)")
    p.add_argument("--pretrain-epochs", type=int, default=3, help="pre-training epochs (default: 3)")
    p.add_argument(
        "--cache-dir", default="~/.cache/lorakit", help="lorakit cache: tiny model, tokenized data"
    )
    p.add_argument("--torch-threads", type=int, default=1, help="torch threads per run (default: 1)")
    p.add_argument("--gpu-hour-price", type=float, default=4.1, help="for lorakit.compare's cost column")
    p.add_argument("--note", action="append", help="a note to store in the result (repeatable)")
    p.add_argument("--plot-only", metavar="RESULT_JSON", help="only redraw the chart of an existing result")
    args = p.parse_args(argv)
    args.argv = argv
    if args.plot_only:
        path = Path(args.plot_only)
        if not plot(json.loads(path.read_text()), path.with_suffix(".png")):
            p.error("--plot-only needs matplotlib (pip install matplotlib)")
        return 0
    for name in ("max_samples", "eval_samples", "pretrain_epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
