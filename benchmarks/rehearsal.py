"""Rehearsal at real shapes on a CPU: a model of a real checkpoint's shape built locally (random weights at
the family's init scales, sharded safetensors), a short ZeRO-3 LoRA run on 2 processes and a streaming merge,
with every process's private memory sampled and set against the planner's numbers.

    python benchmarks/rehearsal.py --shape flan-t5-xl-2l --steps 20    # XL width, 2+2 layers
    python benchmarks/rehearsal.py --shape flan-t5-xl --steps 3         # the 2.85B FLAN-T5-XL shape
    python benchmarks/rehearsal.py --shape llama3-8b-2l --steps 20      # Llama-3-8B width, 2 layers

Private memory is RssAnon (/proc/PID/status: no mmapped files). The phases (load, first step, steady state,
save) come from the run's own records; the merge runs as its own process (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # as a script: the harness and this lorakit

from benchmarks.harness import load_spec, memory  # noqa: E402
from benchmarks.harness.memory import Sampler, gib, step_times  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PIPED = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}  # output read as text

SPEC = load_spec("rehearsal")
SHAPES = {name: (s["family"], s.get("config", {})) for name, s in SPEC["shapes"].items()}  # (family, config)


def model_config(family: str, tokenizer, **over):
    """The real model's config (T5 v1.1 XL or Llama-3-8B), with `over` applied."""
    from transformers import LlamaConfig, T5Config

    f = SPEC["families"][family]
    ids = {key: getattr(tokenizer, attr) for key, attr in f["token_ids"].items()}
    return (T5Config if family == "t5" else LlamaConfig)(**{**f["config"], **ids, **over})


def init_std(family: str, key: str, c) -> float | None:
    """The init scale of a weight (None: a norm, ones), by the family's rules (specs/rehearsal.yaml)."""
    f = SPEC["families"][family]
    rules = (
        math.prod(getattr(c, a) for a in attrs) ** -0.5 for part, attrs in f["init_rules"] if part in key
    )
    return None if key.endswith("norm.weight") else next(rules, f["init_std"])


def build(shape: str, path: Path, shard_size: str = "2GB") -> dict:
    """Write the model (bf16 safetensors shards, config, generation config, tokenizer) tensor by tensor."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, GenerationConfig

    from lorakit.export.output import parse_size
    from lorakit.export.shards import ShardWriter, plan_shards, shard_names, write_index
    from lorakit.testing import build_tiny_tokenizer

    family, over = SHAPES[shape]
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, kind=family)
    config = model_config(family, tok, **over)
    auto = AutoModelForSeq2SeqLM if family == "t5" else AutoModelForCausalLM
    with torch.device("meta"):
        skeleton = auto.from_config(config)
    # Tied copies are not stored, except T5's head: transformers 5 ties it to `shared` whatever the config
    # says, unless the checkpoint stores its own with other values, as FLAN-T5's do.
    tied = set(getattr(skeleton, "all_tied_weights_keys", None) or {})
    if family == "t5":
        tied.discard("lm_head.weight")
    params = [(k, tuple(p.shape)) for k, p in skeleton.state_dict().items() if k not in tied]
    items = [(k, s, torch.bfloat16) for k, s in params]
    groups = plan_shards(items, parse_size(shard_size))
    names = shard_names(len(groups))
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for name, group in zip(names, groups, strict=True):
        writer = ShardWriter(path / name, [items[i] for i in group])
        for i in group:
            key, s, _ = items[i]
            std = init_std(family, key, config)
            if std is None:
                t = torch.ones(s, dtype=torch.bfloat16)
            else:  # by blocks of rows, so the float32 draw of a 128k x 4096 embedding never exists whole
                t = torch.cat(
                    [(torch.randn((min(8192, s[0] - r), *s[1:]), generator=gen) * std).bfloat16()
                     for r in range(0, s[0], 8192)]
                )  # fmt: skip
            writer.write(key, t)
            weight_map[key] = name
        writer.close()
        total += writer.size
    if len(groups) > 1:
        write_index(path, weight_map, total)
    config.dtype = torch.bfloat16
    config.architectures = [type(skeleton).__name__]
    config.save_pretrained(path)
    GenerationConfig.from_model_config(config).save_pretrained(path)
    n = sum(torch.Size(s).numel() for _, s in params)
    return {"shape": shape, "params": n, "bytes": total, "shards": len(groups)}


def train(model: Path, out: Path, steps: int, extra: list[str], env: dict, family: str = "t5") -> dict:
    """The ZeRO-3 run on 2 processes; its private memory per rank and per phase."""
    from lorakit.planner.phases import cpu_phases

    recipe, *shape = SPEC["families"][family]["recipe"]
    overrides = [f"model.name_or_path={model}", *SPEC["train_overrides"], *shape, f"train.max_steps={steps}"]
    overrides += [f"data.max_samples={max(64, 4 * steps)}", f"output.dir={out}", *extra]
    shutil.rmtree(out, ignore_errors=True)  # a fresh run, never a resume of an earlier one
    cmd = [sys.executable, "-m", "lorakit.run", str(ROOT / "recipes" / recipe), *overrides]
    step_t: dict[int, float] = {}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, **PIPED)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    with Sampler(proc.pid) as s:
        while proc.poll() is None:
            step_times(out, step_t, s.t0)
            time.sleep(0.2)
        step_times(out, step_t, s.t0)
        end = time.monotonic() - s.t0
    reader.join()
    if proc.returncode != 0:
        raise SystemExit(f"training failed ({proc.returncode}):\n" + "".join(lines[-40:]))
    summary = json.loads((out / "summary.json").read_text())
    plan, peaks = summary.get("plan") or {}, summary["peak_memory_bytes"]
    states = sum(i["bytes"] for i in (plan.get("recipe") or {}).get("items", []) if i.get("kind") == "state")
    memory_of = {"planned_per_device_gib": gib(plan.get("per_gpu_bytes") or 0)}
    memory_of["planned_per_node_cpu_gib"] = gib(plan.get("per_node_cpu_bytes") or 0)
    memory_of.update(planned_model_states_gib=gib(states), peak_cpu_rss_gib=gib(peaks["cpu_rss"]))
    memory_of["measured_model_states_gib"] = gib(peaks.get("model_states") or 0)
    memory_of.update({k: summary.get(k) for k in ("total_params", "trainable_params")})
    # The planner's bytes per process of each phase of this run on CPUs (lorakit/planner/phases.py).
    planned = {k: gib(v) for k, v in cpu_phases(out / "recipe.yaml").items()}
    return {"phases": memory.phases(s.samples, step_t, end), "per_step": memory.per_step(s.samples, step_t),
            "per_step_peak": memory.per_step_peak(s.samples, step_t), "summary": memory_of,
            "planned_phases_gib": planned, "seconds": end}  # fmt: skip


def merge(source: Path, out: Path, env: dict, base: Path | None = None, extra: tuple[str, ...] = ()) -> dict:
    """python -m lorakit.merge (streaming, no logits check unless `extra` asks) with its private memory
    sampled."""
    cmd = [sys.executable, "-m", "lorakit.merge", str(source), "--output", str(out), "--force",
           "--verify-logits", "never", "--max-shard-size", "2GB", *(["--base", str(base)] if base else []),
           *extra]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, **PIPED)
    with Sampler(proc.pid, every=0.05) as s:
        text = proc.communicate()[0]
    if proc.returncode != 0:
        raise SystemExit(f"merge failed ({proc.returncode}):\n{text[-3000:]}")
    peak = max((r.get(k, 0) for r in s.samples for k in r if k != "t"), default=0)
    shards = sorted(out.glob("*.safetensors"))
    return {"peak_private_gib": gib(peak), "seconds": round(time.monotonic() - t0, 1),
            "largest_shard_gib": gib(max(f.stat().st_size for f in shards)),
            "tensor_check": next((ln for ln in text.splitlines() if ln.startswith("tensors: ")), None),
            "logits_check": next((ln.strip() for ln in text.splitlines() if "max |logit diff|" in ln), None)}  # fmt: skip


def compare_outputs(a: Path, b: Path) -> dict:
    """Every tensor of two exports, one at a time: equal (bit for bit), or the largest difference."""
    from safetensors import safe_open

    def index(d: Path) -> dict[str, Path]:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(f, "pt") as h:
                out.update(dict.fromkeys(h.keys(), f))
        return out

    ia, ib = index(a), index(b)
    equal, worst, dtypes = 0, 0.0, set()
    for key in sorted(ia.keys() & ib.keys()):
        with safe_open(ia[key], "pt") as fa, safe_open(ib[key], "pt") as fb:
            ta, tb = fa.get_tensor(key), fb.get_tensor(key)
        dtypes.add(str(ta.dtype))
        if ta.dtype == tb.dtype and ta.shape == tb.shape and torch.equal(ta, tb):
            equal += 1
        else:
            worst = max(worst, (ta.float() - tb.float()).abs().max().item() if ta.shape == tb.shape else 1e30)
    return {"tensors": len(ia.keys() & ib.keys()), "identical": equal, "only_in_stream": len(ia.keys() - ib.keys()),
            "only_in_memory": len(ib.keys() - ia.keys()), "largest_difference": worst, "dtypes": sorted(dtypes)}  # fmt: skip


def merge_compare(model: Path, work: Path, env: dict) -> dict:
    """The streaming and the in-memory merge of one random adapter in float32, compared tensor for tensor;
    then the bfloat16 streaming merge with the whole-model logits check. Peaks against the must-show bound:
    1.5 x the base's largest shard + the adapter."""
    adapter = _random_adapter(model, work / "adapter")
    adapter_gib = gib(sum(f.stat().st_size for f in adapter.glob("*.safetensors")))
    shard = gib(max(f.stat().st_size for f in model.glob("*.safetensors")))
    out = {"base_largest_shard_gib": shard, "adapter_gib": adapter_gib}
    out["bound_gib"] = round(1.5 * shard + adapter_gib, 3)
    for strategy in ("stream", "memory"):
        extra = ("--dtype", "float32", "--strategy", strategy)
        out[f"{strategy}_fp32"] = merge(adapter, work / f"{strategy}32", env, base=model, extra=extra)
    out["fp32_stream_vs_memory"] = compare_outputs(work / "stream32", work / "memory32")
    for d in ("stream32", "memory32"):
        shutil.rmtree(work / d, ignore_errors=True)
    extra = ("--dtype", "bfloat16", "--strategy", "stream", "--verify-logits", "always")
    out["stream_bf16_verified"] = merge(adapter, work / "stream16", env, base=model, extra=extra)
    return out


def plot(results: list[Path], png: Path) -> None:
    """Per phase: each rank's measured private memory against the plan per device; per step: each rank's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(r.read_text()) for r in results]
    runs = [r for r in runs if "train" in r]
    fig, axes = plt.subplots(len(runs), 2, figsize=(11, 3.6 * len(runs)), squeeze=False)
    for (ax_phase, ax_step), r in zip(axes, runs, strict=True):
        t, names = r["train"], ["load", "first_step", "steady", "save"]
        ranks = sorted(t["phases"]["load"])
        for i, rk in enumerate(ranks):
            ax_phase.bar([j + 0.35 * i for j in range(len(names))], [t["phases"][n][rk] for n in names], 0.35,
                         label=rk)  # fmt: skip
        planned = r["measured_over_planned"]["planned_per_process_gib"]
        ax_phase.scatter([j + 0.175 for j in range(len(names))], [planned[n] for n in names], marker="_",
                         s=900, color="k", zorder=3, label="plan per process (phase)")  # fmt: skip
        ax_phase.bar(len(names) + 0.2, r["merge"]["peak_private_gib"], 0.5, color="tab:green", label="merge")
        if planned.get("merge"):
            ax_phase.scatter([len(names) + 0.2], [planned["merge"]], marker="_", s=900, color="k", zorder=3)
        ax_phase.set_xticks([*range(len(names)), len(names) + 0.2], [*names, "merge"])
        ax_phase.set_ylabel("private memory, GiB")
        what = r.get("label") or " ".join(r.get("env") or []) or "lorakit's defaults"
        ax_phase.set_title(f"{r['shape']} ({what}): peak per phase", fontsize=9)
        ax_phase.legend(fontsize=7)
        by_step = t.get("per_step_peak") or t["per_step"]  # results from before per_step_peak: at each record
        steps = sorted(by_step, key=int)
        for rk in ranks:
            ax_step.plot([int(s) for s in steps], [by_step[s][rk] for s in steps], marker=".", label=rk)
        ax_step.set_ylim(bottom=0)
        ax_step.set_xlabel("optimizer step")
        title = "peak private memory within each step"
        title = title if "per_step_peak" in t else "private memory at each step's record"
        ax_step.set_title(title)
        ax_step.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plot-only", nargs="+", type=Path, help="redraw results/rehearsal.png from result files")
    p.add_argument("--shape", choices=sorted(SHAPES), default="flan-t5-xl-2l")
    p.add_argument("--label", default=None, help="what this run tried, for the plot's titles")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--work", type=Path, default=Path("/tmp/lorakit-rehearsal"))
    p.add_argument("--merge-compare", action="store_true",
                   help="no training: a random adapter merged streaming and in memory in float32, compared "
                        "tensor for tensor, and streaming in bfloat16 with the logits check (the in-memory merge holds the model in float32: ~12 GiB at the full XL shape, 1.4 GiB at flan-t5-xl-2l)")  # fmt: skip
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for the run's processes")
    p.add_argument("--override", action="append", default=[], help="recipe override for the run")
    p.add_argument("--out", type=Path, help="results JSON (default results/rehearsal_SHAPE.json)")
    args = p.parse_args(argv)
    if args.plot_only:
        plot(args.plot_only, RESULTS / "rehearsal.png")
        return 0
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    env.update(dict(e.split("=", 1) for e in args.env))
    model = args.work / args.shape / "base"
    t0 = time.monotonic()
    built = build(args.shape, model) if not (model / "config.json").is_file() else {"shape": args.shape}
    built["build_seconds"] = round(time.monotonic() - t0, 1)
    result = {"shape": args.shape, "model": built, "env": args.env, "overrides": args.override}
    result["label"] = args.label
    print(json.dumps(built), flush=True)
    if args.merge_compare:
        result["merge_compare"] = merge_compare(model, args.work / args.shape / "compare", env)
    else:
        run = args.work / args.shape / "run"
        result["train"] = train(model, run, args.steps, args.override, env, SHAPES[args.shape][0])
        result["merge"] = merge(run, args.work / args.shape / "merged", env)
        result["measured_over_planned"] = memory.against_plan(result)
    out = args.out or RESULTS / f"rehearsal_{args.shape}{'_merge' if args.merge_compare else ''}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def _random_adapter(model: Path, out: Path) -> Path:
    """A rank-16 all-linear LoRA adapter with random B for `model`, built on the meta skeleton (no weights
    loaded): the tensors peft would save."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config = AutoConfig.from_pretrained(model)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    with torch.device("meta"):
        skeleton = auto.from_config(config)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, mod in skeleton.named_modules():
        if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head"):
            lora = f"base_model.model.{name}.lora_"
            tensors[lora + "A.weight"] = torch.randn(16, mod.in_features, generator=gen) / 64
            tensors[lora + "B.weight"] = torch.randn(mod.out_features, 16, generator=gen) / 64
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    cfg = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": "all-linear",
           "base_model_name_or_path": str(model),
           "task_type": "SEQ_2_SEQ_LM" if config.is_encoder_decoder else "CAUSAL_LM"}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


if __name__ == "__main__":
    sys.exit(main())
