"""Time to the first step and time around the steps, on the quickstart (`recipes/quickstart.yaml`: tiny T5,
packed rows, 2 processes, ZeRO-3, ROUGE evaluation, epoch checkpoints).

    python benchmarks/step_overhead.py                    # -> benchmarks/results/step_overhead.json
    python benchmarks/step_overhead.py --smoke --output /tmp/so.json     # 1 process, 2 steps: tests the script

Three measurements, each in fresh processes: `import lorakit` and the launcher's imports (wall, CPU, the heavy
libraries each loads); `python -m lorakit.run RECIPE` for one step, to its first metrics record and to its
exit; and the recipe trained under torchrun by this script's `--worker`, with the loop's parts timed on every
rank (batch loading, forward and loss, DeepSpeed's backward and step, the rest of `train_window`, the step's
record, evaluation, checkpoints, `Trainer.run`). The share the issue asks about: per-step work outside
forward, backward and optimizer step over the steps' time. The timers wrap lorakit's internals (it has no
hooks): if one is renamed, the worker fails loudly and the smoke test catches it. benchmarks/README.md says
more.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "step_overhead.json"
PHASES = ("data", "window", "forward", "backward", "optimizer", "record", "eval", "checkpoint", "run")
HEAVY = ("torch", "deepspeed", "transformers", "datasets", "peft", "matplotlib", "evaluate", "pandas")


# ----------------------------------------------------------------------------------------------- worker
class Clock:
    """Wall and CPU seconds per phase, and how many times each ran."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def add(self, phase: str, wall: float, cpu: float) -> None:
        self.wall[phase] = self.wall.get(phase, 0.0) + wall
        self.cpu[phase] = self.cpu.get(phase, 0.0) + cpu
        self.calls[phase] = self.calls.get(phase, 0) + 1

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - w, time.process_time() - c)

        return timed


def worker(out_dir: Path, recipe_path: str, overrides: list[str]) -> None:
    """Train the recipe in this process (under torchrun: this rank) with the loop's parts timed; writes
    OUT_DIR/rank{RANK}.json."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    import lorakit
    from lorakit.engine import loop
    from lorakit.objectives.sft import SftObjective

    clock = Clock()
    windows = loop.accumulation_windows

    def timed_windows(loader, accumulation):
        it = windows(loader, accumulation)
        while True:
            w, c = time.perf_counter(), time.process_time()
            try:
                window = next(it)
            except StopIteration:
                return
            finally:
                clock.add("data", time.perf_counter() - w, time.process_time() - c)
            yield window

    loop.accumulation_windows = timed_windows
    loop.train_window = clock.wrap("window", loop.train_window)
    loop.Trainer.run = clock.wrap("run", loop.Trainer.run)
    loop.Trainer._account = clock.wrap("record", loop.Trainer._account)
    loop.Trainer._evaluate = clock.wrap("eval", loop.Trainer._evaluate)
    loop.Trainer._save = clock.wrap("checkpoint", loop.Trainer._save)
    SftObjective.loss = clock.wrap("forward", SftObjective.loss)
    DeepSpeedEngine.backward = clock.wrap("backward", DeepSpeedEngine.backward)
    DeepSpeedEngine.step = clock.wrap("optimizer", DeepSpeedEngine.step)
    summary = lorakit.train(lorakit.load_recipe(recipe_path, overrides)).summary
    rank = os.environ.get("RANK", "0")
    record = {"wall": clock.wall, "cpu": clock.cpu, "calls": clock.calls, "steps": summary["steps"]}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


# ------------------------------------------------------------------------------------------ measurements
def shares(rank: dict) -> dict:
    """Per-step work outside forward/backward/optimizer step, from one rank's phase sums."""
    out = {}
    for kind in ("wall", "cpu"):
        t = {p: rank[kind].get(p, 0.0) for p in PHASES}
        compute = t["forward"] + t["backward"] + t["optimizer"]
        window_rest = t["window"] - compute
        other = t["data"] + window_rest + t["record"]
        steps = t["data"] + t["window"] + t["record"]
        out[kind] = {"compute": compute, "data": t["data"], "window_rest": window_rest, "record": t["record"]}
        out[kind].update(per_step_other=other, per_step_other_share=other / steps if steps else None)
        out[kind].update(eval=t["eval"], checkpoint=t["checkpoint"])
        # Trainer.run outside the steps, evaluations and checkpoints: epoch starts and the loop itself.
        out[kind].update(run_rest=t["run"] - steps - t["eval"] - t["checkpoint"], run=t["run"])
    return out


def measure_phases(recipe: str, overrides: list[str], processes: int) -> dict:
    from lorakit.engine.launch import free_port, launch_env

    with tempfile.TemporaryDirectory(prefix="step-overhead-") as tmp:
        out = Path(tmp)
        args = [str(Path(__file__).resolve()), "--worker", str(out), recipe, *overrides]
        args.append(f"output.dir={out / 'run'}")
        if processes > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}"]
            cmd += [f"--master-port={free_port()}", *args]
        else:
            cmd = [sys.executable, *args]
        start = time.perf_counter()
        subprocess.run(cmd, env=launch_env(), check=True, cwd=ROOT)
        wall = time.perf_counter() - start
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return {"wall_seconds": wall, "ranks": ranks, "shares": [shares(r) for r in ranks]}


def measure_imports() -> dict:
    out = {}
    for name, stmt in (
        ("import lorakit", "import lorakit"),
        ("launcher (lorakit.api)", "import lorakit.api"),
    ):
        code = (
            "import json, sys, time, resource\n"
            f"w, c = time.perf_counter(), time.process_time()\n{stmt}\n"
            "print(json.dumps({'wall': time.perf_counter() - w, 'cpu': time.process_time() - c, "
            f"'heavy': sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))}}))"
        )
        command = [sys.executable, "-c", code]
        res = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
        out[name] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def measure_first_step(recipe: str, overrides: list[str]) -> dict:
    """`python -m lorakit.run RECIPE` for one step: seconds to its first metrics record and to its exit."""
    with tempfile.TemporaryDirectory(prefix="first-step-") as tmp:
        run_dir = Path(tmp) / "run"
        metrics = run_dir / "metrics.jsonl"
        cmd = [sys.executable, "-m", "lorakit.run", recipe, *overrides, f"output.dir={run_dir}"]
        cmd += ["train.max_steps=1", "eval.enabled=false", "checkpoint.at_epoch_end=false"]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        first = None
        while proc.poll() is None:
            if first is None and metrics.is_file() and metrics.read_text().strip():
                first = time.perf_counter() - start
            time.sleep(0.05)
        total = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
        if first is None and metrics.is_file() and metrics.read_text().strip():
            first = total
    return {"command": " ".join(cmd[1:]), "to_first_step_record_seconds": first, "to_exit_seconds": total}


def load_now() -> list[float]:
    return list(os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/quickstart.yaml")
    p.add_argument("--processes", type=int, default=2, help="processes of the phase run (the recipe's: 2)")
    p.add_argument("--skip-first-step", action="store_true", help="leave out the first-step measurement")
    smoke = "1 process, no ZeRO, 2 steps, no evaluation: tests the script"
    p.add_argument("--smoke", action="store_true", help=smoke)
    p.add_argument("--output", default=None, help=f"result JSON (default {RESULT.relative_to(ROOT)})")
    p.add_argument("--cache-dir", help="data.cache_dir of every run (tiny model, tokenized data)")
    p.add_argument("--note", default="")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the recipe, e.g. train.epochs=1")
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[3], sys.argv[4:])
        return 0
    a = p.parse_args(argv)
    overrides = list(a.overrides) + ([f"data.cache_dir={a.cache_dir}"] if a.cache_dir else [])
    processes = a.processes
    if a.smoke:
        processes = 1
        overrides += ["distributed.num_processes=1", "distributed.zero_stage=0", "data.max_samples=16"]
        overrides += ["train.max_steps=2", "eval.enabled=false"]
    elif processes != 2:
        overrides.append(f"distributed.num_processes={processes}")
    output = Path(a.output) if a.output else (Path(tempfile.mkdtemp()) / "so.json" if a.smoke else RESULT)
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "load_before": load_now()}
    result = {"benchmark": "step_overhead", "recipe": a.recipe, "overrides": overrides, "note": a.note}
    result["machine"] = machine
    if not a.smoke:  # tests/unit/test_startup_imports.py checks the imports
        result["imports"] = measure_imports()
    if not (a.skip_first_step or a.smoke):
        result["first_step"] = measure_first_step(a.recipe, overrides)
    result["phases"] = measure_phases(a.recipe, overrides, processes)
    result["machine"]["load_after"] = load_now()
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    for i, s in enumerate(result["phases"]["shares"]):
        w, c = s["wall"], s["cpu"]
        wall, cpu = w["per_step_other_share"], c["per_step_other_share"]
        share = f"{wall:.1%} of the steps' wall time ({cpu:.1%} of CPU time)"
        rest = f"eval {w['eval']:.1f} s, checkpoints {w['checkpoint']:.1f} s"
        rest += f", rest of the loop {w['run_rest']:.2f} s"
        print(f"rank {i}: per-step work outside forward/backward/step {share}; {rest}")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
