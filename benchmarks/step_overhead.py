"""Time to the first step and the share of per-step work outside forward, backward and optimizer step, on the
quickstart; with --compile-ab a step's CPU time compiled against eager (benchmarks/README.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script: the harness and this lorakit

from benchmarks.harness import ROOT, load_spec, main  # noqa: E402
from benchmarks.harness.workers import Clock  # noqa: E402

SPEC = load_spec("step_overhead")


def phases_worker(spec: dict) -> dict:
    """The recipe trained in this process (under torchrun: this rank) with the loop's parts timed."""
    import lorakit
    from lorakit.engine import steps

    clock, windows = Clock(), steps.accumulation_windows

    def timed_windows(loader, accumulation):  # the loader's next: batch loading and collation
        it, loading = windows(loader, accumulation), clock.wrap("data", next)
        while (window := loading(it, None)) is not None:
            yield window

    steps.accumulation_windows = timed_windows
    clock.patch(SPEC["phases"])
    summary = lorakit.train(lorakit.load_recipe(spec["recipe"], spec["overrides"])).summary
    out = {"wall": clock.wall, "cpu": clock.cpu, "calls": clock.calls, "steps": summary["steps"]}
    return {**out, "window_times": clock.times["window"], "compile": summary.get("compile")}


WORKERS = {"phases": phases_worker}


def shares(rank: dict) -> dict:
    """Per-step work outside forward/backward/optimizer step, from one rank's phase sums."""
    out = {}
    for kind in ("wall", "cpu"):
        t = {p: rank[kind].get(p, 0.0) for p in ("data", *SPEC["phases"])}
        compute = t["forward"] + t["backward"] + t["optimizer"]
        window_rest, steps = t["window"] - compute, t["data"] + t["window"] + t["record"]
        other = t["data"] + window_rest + t["record"]
        out[kind] = {"compute": compute, "data": t["data"], "window_rest": window_rest, "record": t["record"]}
        out[kind].update(per_step_other=other, per_step_other_share=other / steps if steps else None)
        out[kind].update(eval=t["eval"], checkpoint=t["checkpoint"])
        # Trainer.run outside the steps, evaluations and checkpoints: epoch starts and the loop itself.
        out[kind].update(run_rest=t["run"] - steps - t["eval"] - t["checkpoint"], run=t["run"])
    return out


def measure_phases(bench, overrides: list[str]) -> dict:
    from lorakit.engine.launch import launch_env, torchrun_command

    out = bench.tmp / "phases"
    out.mkdir()
    spec = {"recipe": bench.args.recipe, "overrides": [*overrides, f"output.dir={out / 'run'}"]}
    (out / "spec.json").write_text(json.dumps(spec))
    # Under torchrun also for one process (the smoke run): one code path, a worker per rank.
    worker = ["--worker", "phases", str(out / "spec.json"), str(out / "rank{rank}.json")]
    cmd = torchrun_command(bench.args.processes, "benchmarks.step_overhead", worker)
    start = time.perf_counter()
    subprocess.run(cmd, env=launch_env(), check=True, cwd=ROOT)
    wall = time.perf_counter() - start
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return {"wall_seconds": wall, "ranks": ranks, "shares": [shares(r) for r in ranks]}


def measure_imports() -> dict:
    out = {}
    for name, stmt in SPEC["imports"].items():
        code = (
            "import json, sys, time\n"
            f"w, c = time.perf_counter(), time.process_time()\n{stmt}\n"
            "print(json.dumps({'wall': time.perf_counter() - w, 'cpu': time.process_time() - c, "
            f"'heavy': sorted({{m.split('.')[0] for m in sys.modules}} & set({SPEC['heavy']!r}))}}))"
        )
        res = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
        )
        out[name] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def measure_first_step(bench, overrides: list[str]) -> dict:
    """`python -m lorakit.run RECIPE` for one step: seconds to its first metrics record and to its exit."""
    run_dir = bench.tmp / "first-step"
    metrics, first = run_dir / "metrics.jsonl", None
    cmd = [sys.executable, "-m", "lorakit.run", bench.args.recipe, *overrides, f"output.dir={run_dir}"]
    cmd += SPEC["first_step_overrides"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while first is None:  # until the first record, then until the run exits
        if metrics.is_file() and metrics.read_text().strip():
            first = time.perf_counter() - start
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.wait()
    total = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    return {"command": " ".join(cmd[1:]), "to_first_step_record_seconds": first, "to_exit_seconds": total}


def measure_compile(bench) -> int:
    """--compile-ab: a step's CPU time with model.compile true and false, interleaved, after the warm-up."""
    from benchmarks.harness.device import build_weights, write_model_dir
    from benchmarks.harness.runner import median, paired_ratios

    args, ab, sides = bench.args, SPEC["compile_ab"], ("compiled", "eager")
    result = bench.result(compile_ab=ab["about"], shapes={})
    for shape in args.compile_ab:
        s = ab["shapes"][shape]
        over = [*ab["overrides"], *s["overrides"], f"train.max_steps={args.steps}"]
        over += [f"data.cache_dir={args.cache_dir}"] if args.cache_dir else []
        if "config" in s:  # random weights at a real width, with lorakit's tiny tokenizer
            model = bench.tmp / shape
            write_model_dir(model, s["config"])
            s = {**s, "built": build_weights(str(model), "float32")}
            over.append(f"model.name_or_path={model}")

        def one(side, rnd, over=over, shape=shape, s=s):
            name = f"{shape}-{side}-{rnd}"
            run = [*over, f"model.compile={side == 'compiled'}", f"output.dir={bench.tmp / name}"]
            spec = {"recipe": s["recipe"], "overrides": run, "torch_threads": args.torch_threads}
            r = bench.runner.run("phases", spec, name)
            steady = r["window_times"][args.warmup_steps :]
            r.update(side=side, step_cpu=median(c for _, c in steady), step_wall=median(w for w, _ in steady))
            r["first_steps_cpu"] = [c for _, c in r["window_times"][: args.warmup_steps]]
            bench.log(f"  {shape} {side}: step {r['step_cpu']:.3f} CPU s, compile {r['compile']}")
            return {k: r[k] for k in ("side", "step_cpu", "step_wall", "first_steps_cpu", "compile", "steps")}

        runs = bench.rounds(list(sides), args.repeats, one, title=shape)
        paired = paired_ratios(runs, *sides, "step_cpu")
        meds = {side: median(r["step_cpu"] for r in runs if r["side"] == side) for side in sides}
        ratio = meds["compiled"] / meds["eager"]
        result["shapes"][shape] = {**s, "median_step_cpu": meds, "compiled_over_eager": ratio}
        result["shapes"][shape].update(paired_compiled_over_eager=paired, runs=runs)
        paired_shown = [round(p, 3) for p in paired]
        bench.log(f"{shape}: compiled / eager step CPU time x{ratio:.3f}, paired {paired_shown}")
    return bench.finish(result)


def measure(bench) -> int:
    args = bench.args
    if args.compile_ab:
        return measure_compile(bench)
    overrides = list(args.overrides) + ([f"data.cache_dir={args.cache_dir}"] if args.cache_dir else [])
    overrides += SPEC["smoke_overrides"] if args.smoke else []
    overrides += [f"distributed.num_processes={args.processes}"] if args.processes != 2 else []
    result = bench.result(recipe=args.recipe, overrides=overrides)
    if not args.smoke:  # tests/unit/test_startup_imports.py checks the imports
        result.update(imports=measure_imports(), first_step=measure_first_step(bench, overrides))
    result["phases"] = measure_phases(bench, overrides)
    for i, s in enumerate(result["phases"]["shares"]):
        w, c = s["wall"], s["cpu"]
        share = f"{w['per_step_other_share']:.1%} of the steps' wall time ({c['per_step_other_share']:.1%} of CPU time)"
        rest = f"eval {w['eval']:.1f} s, checkpoints {w['checkpoint']:.1f} s, rest of the loop {w['run_rest']:.2f} s"
        bench.log(f"rank {i}: per-step work outside forward/backward/step {share}; {rest}")
    return bench.finish(result)


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
