"""GPU validation and benchmark: lorakit vs HF Trainer + peft on random-weight models of real sizes, each
workload of specs/gpu_bench.yaml both ways on the same tokenized rows, each side a fresh process timed per
optimizer step. Commands: benchmarks/README.md; what is measured: docs/gpu.md; the GPUs: gpu_lease_plan.md.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script: the harness and this lorakit

from benchmarks.harness import device, gpu_result, load_spec, main, steps  # noqa: E402
from benchmarks.harness.provenance import source_digest  # noqa: E402

SPEC = load_spec("gpu_bench")
MODELS, WORKLOADS, LORA, LR = SPEC["models"], SPEC["workloads"], SPEC["lora"], SPEC["learning_rates"]


WORKERS = {"setup": device.setup_worker, "lorakit": steps.lorakit_worker, "hf": steps.hf_worker}


def synthetic_rows(tokenizer, family: str, n: int, dist: dict, seed: int) -> list[dict]:
    """n instruction rows of random words (one token each) whose token lengths follow `dist`."""
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
        sizes = [(p, max(1, t - p)) for p, t in zip(prompts, total, strict=True)]
    else:
        sizes = list(zip(lengths(*dist["source"]), lengths(*dist["target"]), strict=True))
    return [{"prompt": text(a), "response": text(b)} for a, b in sizes]


def packed_budget(lengths: list[int], batch: int) -> int:
    """Tokens per packed row: `batch` examples of mean length, a multiple of 256, at least the longest one."""
    return max(math.ceil(batch * statistics.fmean(lengths) / 256) * 256, max(lengths))


class Session:
    """One invocation on a device: the models built, the probe, the budget; runs workloads side by side."""

    def __init__(self, bench, work: Path, dtype: str):
        self.bench, self.work, self.runner, self.dtype = bench, work, bench.runner, dtype
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
        """(data key, length distribution, caps) of a workload: its own (not if smoke), else its family's."""
        if not self.smoke and "lengths" in w:
            return w["data"], w["lengths"], w["caps"]
        return w["family"], self.lengths[w["family"]], self.caps[w["family"]]

    def workload(self, name: str, w: dict) -> dict:
        """Prepare the data, run every side; returns the workload's result."""
        from transformers import AutoTokenizer

        import lorakit
        from lorakit.recipe import recipe_from_dict

        model, family = w["model"], MODELS[w["model"]]["family"]
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
        extra = {"prepared": str(prepared.path), "hf_attention": "flash_attention_2" if flash else "sdpa"}
        for side in sides:
            budget = max_tokens
            if side == "lorakit_packed" and family == "seq2seq":
                budget = packed_budget([len(x) for x in prepared.train["input_ids"]], w["batch"])
            result["sides"][side] = self.side(name, w, side, data_file, budget, extra)
        done = {s: r for s, r in result["sides"].items() if gpu_result.measured(r)}
        tps = {s: r["useful_tokens_per_second"] for s, r in done.items()}
        pairs = [(s, b) for s in tps if s.startswith("lorakit") for b in tps if b[:2] == "hf"]
        ratios = {f"{s}/{b}": tps[s] / tps[b] for s, b in pairs}
        # One epoch over the same rows on every side: the same useful tokens.
        tokens = {s: r["useful_tokens_epoch"] for s, r in done.items()}
        losses = [r["loss_last"] for r in done.values() if r["loss_last"] is not None]
        checks = {"useful_tokens_epoch": tokens, "equal_on_all_sides": len(set(tokens.values())) <= 1}
        checks["finite_losses"] = all(math.isfinite(x) for x in losses)
        result.update(ratios=ratios, checks=checks)
        if len(done) == len(sides):
            result["status"] = "measured"
        elif done:
            result["status"] = "partial"
        elif {r["status"] for r in result["sides"].values()} == {"skipped"}:
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
            spec.update(recipe=self.recipe(w, side, data_file, work, budget), fields=SPEC["worker_fields"])
            spec["profile"] = bool(w.get("profile"))  # one warm-up step under torch.profiler
            spec["env"] = {k: str(v) for k, v in w.get("env", {}).items()}
            lorakit.prepare(recipe_from_dict(spec["recipe"]))  # tokenize and cache here: no timed run pays
        else:
            spec.update(extra, group_by_length=side == "hf_grouped", master_port=free_port(), lora=LORA)
            spec.update({k: SPEC[k] for k in ("seed", "hf_zero3", "hf_args")}, lr=LR[w["method"]])
        try:
            r = runner.run("lorakit" if side.startswith("lorakit") else "hf", spec, f"{name}-{side}")
        except RuntimeError as e:
            log(f"  {name}/{side}: FAILED ({str(e).splitlines()[0]})")
            return {"status": "failed", "error": str(e)[-3000:]}
        steps.rates(r, self.models[w["model"]]["accounting"], w["method"], self.peak)
        if side.startswith("lorakit"):
            r["plan"] = gpu_result.against_plan(spec["recipe"], r, self.probe.get("gpu_memory_bytes"))
        r.update(status="measured", description=SPEC["sides"][side])
        mfu = f"{gpu_result.share(r['mfu'])} (NeMo's LoRA count {gpu_result.share(r['mfu_nemo'])})"
        mem = (r["peak_gpu_memory_bytes"] or 0) / 2**30
        rate, eff = f"{r['useful_tokens_per_second']:,.0f} useful tok/s", r["padding_efficiency_timed"]
        matmul, step = r["mfu_vs_measured_matmul"], r["step_seconds_median"]
        what = f"MFU {mfu} ({matmul:.1%} of measured matmul), efficiency {eff:.2f}, step {step:.3f} s"
        log(f"  {name}/{side}: {rate}, {what}, peak {mem:.1f} GiB, {r['process_seconds']:.0f} s in all")
        for line in gpu_result.describe_extras(r):
            log(f"    {line}")
        return r


def write_result(result: dict, output: Path, out_dir: Path | None) -> None:
    """The JSON (targets evaluated) and its chart at `output`, copies in `out_dir` (after every workload)."""
    from benchmarks.harness.plots import render
    from lorakit.rundir import write_json

    result["targets"] = gpu_result.evaluate_targets(result["workloads"], SPEC["targets"])
    for path in [output] + ([out_dir / output.name] if out_dir and out_dir != output.parent else []):
        write_json(path, result)
        render(sys.modules[__name__], result, path.with_suffix(".png"))


def measure(bench) -> int:
    args, log, smoke = bench.args, bench.log, bench.args.smoke
    out_dir = Path(args.out).resolve() if args.out else None
    if args.merge:
        return gpu_result.merge(args.merge, bench.output, lambda r: write_result(r, bench.output, out_dir))
    # Before anything imports huggingface_hub (it reads these once): nothing here needs the hub.
    os.environ.update({k: os.environ.get(k, "1") for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")})
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="lorakit-gpu-bench-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    output = bench.output
    log_path = (out_dir or output.parent) / (output.stem + ".log")
    log_path.write_text("")
    # bf16 is what is measured; the CPU smoke run uses float32, since bf16 matmuls are emulated (slow) on CPUs.
    dtype = "float32" if smoke else "bfloat16"
    budget = args.budget_seconds or (math.inf if smoke else 540.0)
    # The invocation's runner (its fork server in a smoke run), with this script's log and time budget.
    runner = bench.runner
    runner.log_path, runner.deadline = log_path, time.monotonic() + budget
    s = Session(bench, work, dtype)
    small = SPEC["smoke_steps"] if smoke else {}
    workloads = {n: dict(WORKLOADS[n], **small) for n in args.workloads or WORKLOADS}
    for w in workloads.values():
        key = s.shape(dict(w, family=MODELS[w["model"]]["family"]))[0]
        s.max_rows[key] = max(s.max_rows.get(key, 0), w["batch"] * w["steps"])
    digest, flops = source_digest(bench.provenance.files), SPEC["flop_accounting"]
    result = bench.result(smoke=smoke, dtype=dtype, lorakit_source_sha256=digest, flop_accounting=flops)
    result.update(sides=SPEC["sides"], lora=LORA, learning_rates=LR, warmup_steps=s.warmup)
    result.update(host=result.pop("machine"), workloads={})
    # Tokenizer and config of every model here (no GPU needed); weights on the device in the setup worker.
    for m in dict.fromkeys(w["model"] for w in workloads.values()):
        shape = {**MODELS[m]["config"], **(MODELS[m]["smoke"] if smoke else {})}
        config = device.write_model_dir(work / "models" / m, shape)
        s.models[m] = {"accounting": steps.accounting(config, LORA["r"])}
    spec = {"matmul_n": 512 if smoke else 8192, "dtype": dtype}
    if args.run_gpu_tests:
        spec["gpu_tests"] = str(log_path)
    spec["models"] = {m: str(work / "models" / m) for m in s.models}
    try:
        # On a GPU in its own process, so this one never holds device memory (the CPU smoke run: in this one).
        setup = device.setup_worker(spec) if smoke else runner.run("setup", spec, "setup")
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
            log(f"built {m}: {size} in {build['seconds']:.0f} s{' (reused)' if build.get('reused') else ''}")
    result.update(device={k: v for k, v in s.probe.items() if k != "versions"}, versions=s.probe["versions"])
    result["peak_flops"] = s.peak = steps.peak_of(s.probe, SPEC["datasheet_bf16"])
    sheet = f"{s.peak['datasheet'] / 1e12:.0f}" if s.peak["datasheet"] else "n/a"
    rate = f"measured {dtype} matmul {s.peak['measured_matmul'] / 1e12:.2f} TFLOP/s"
    log(f"device: {s.peak['device']}; {rate}; datasheet bf16 peak {sheet} TFLOP/s")
    if s.probe.get("t5_sdpa_backends"):
        log(f"SDPA kernels that take T5's attention: {s.probe['t5_sdpa_backends']}")
    if args.run_gpu_tests:
        result["gpu_tests"] = setup.get("gpu_tests") or {"exit_code": None, "summary": "did not finish"}
        log(f"gpu tests (beside the weight builds): {result['gpu_tests']['summary']}")
    for i, (name, w) in enumerate(workloads.items()):
        what = f"{w['model']} {w['method']} ZeRO-{w['zero_stage']}"
        log(f"workload {name}: {what}, {runner.remaining():.0f} s left")
        try:
            result["workloads"][name] = s.workload(name, w)
        except Exception as e:  # a setup failure (build, data) loses this workload, not the run
            error = f"{type(e).__name__}: {e}"
            result["workloads"][name] = {"model": w["model"], "status": "failed", "error": error}
            log(f"  {name}: FAILED: {error}")
        # Free the disk of models no later workload uses (8B is 16 GB), but a skipped or failed workload's.
        later = {x["model"] for x in list(workloads.values())[i + 1 :]}
        later |= {x["model"] for x in result["workloads"].values() if x["status"] != "measured"}
        for m in [m for m in s.models if m not in later]:
            shutil.rmtree(work / "models" / m, ignore_errors=True)
            s.models.pop(m)
        result["benchmark_wall_seconds"] = time.perf_counter() - bench.provenance.t0
        write_result(result, output, out_dir)
    log(gpu_result.table(result))
    for t in result["targets"].values():
        value, met = t["measured"], {True: "met", False: "not met", None: "-"}[t["met"]]
        share = "at_least" in t and "side" in t  # an MFU; the others are ratios
        shown = "not measured" if value is None else (f"{value:.1%}" if share else f"x{value:.2f}")
        log(f"target: {t['what']}: {shown} ({met})")
    log(f"wrote {output} (log {log_path}) in {result['benchmark_wall_seconds']:.0f} s")
    if result.get("gpu_tests") is not None and not device.gpu_tests_passed(result["gpu_tests"]):
        log(f"gpu tests did not pass ({result['gpu_tests']['summary']}): exit status 1")
    return gpu_result.exit_status(result)


def plot(result: dict, plt):
    """Useful tokens/s (ratio, MFU) and peak GPU memory per workload and side; None when none was measured."""
    workloads, measured = result["workloads"], gpu_result.measured
    names = [n for n, w in workloads.items() if any(map(measured, w.get("sides", {}).values()))]
    if not names:
        return None
    sides = [s for s in SPEC["sides"] if any(measured(workloads[n]["sides"].get(s, {})) for n in names)]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(max(10, 2.2 * len(names) + 4), 5.2))
    width = 0.8 / len(sides)
    for j, side in enumerate(sides):
        offset = (j - (len(sides) - 1) / 2) * width
        bars = [(i + offset, n, workloads[n]["sides"].get(side, {})) for i, n in enumerate(names)]
        bars = [(x, n, r) for x, n, r in bars if measured(r)]
        tps = [r["useful_tokens_per_second"] for _, _, r in bars]
        mem = [(r["peak_gpu_memory_bytes"] or r["peak_cpu_rss_bytes"]) / 2**30 for _, _, r in bars]
        ax.bar([x for x, _, _ in bars], tps, width, label=side, color=f"C{j}")
        ax2.bar([x for x, _, _ in bars], mem, width, label=side, color=f"C{j}")
        for (x, n, r), y in zip(bars, tps, strict=True):
            ratio = workloads[n]["ratios"].get(f"{side}/hf")
            mfu = r["mfu_vs_measured_matmul"] if r["mfu"] is None else r["mfu"]
            text = (f"x{ratio:.2f}\n" if ratio else "") + f"{mfu:.0%}"
            ax.annotate(text, (x, y), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7)
    for a in (ax, ax2):
        a.set_xticks(range(len(names)), [n.replace("_", "\n", 1) for n in names], fontsize=8)
        a.legend(fontsize=8)
    on_gpu = bool(result["peak_flops"].get("datasheet"))
    rate = f"useful tokens / s (labels: lorakit/hf ratio, {'MFU' if on_gpu else 'of measured matmul'})"
    ax.set_title(rate, fontsize=10)
    ax.set_yscale("log")
    ax.margins(y=0.25)
    memory = "peak GPU memory allocated (GiB)" if on_gpu else "peak memory (GiB; CPU RSS without a GPU)"
    ax2.set_title(memory, fontsize=10)
    v, smoke = result["versions"], " (smoke, tiny configs)" if result["smoke"] else ""
    versions = ", ".join(f"{k} {v.get(k)}" for k in ("torch", "transformers", "peft", "deepspeed"))
    device_name = result["peak_flops"]["device"]
    fig.suptitle(f"{device_name}{smoke}: {versions}, {result['dtype']}, 1 process", fontsize=9)
    return fig


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
