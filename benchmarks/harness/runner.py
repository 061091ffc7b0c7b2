"""Worker subprocesses under a time budget, interleaved rounds, rates, medians, paired ratios and claims."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
import weakref
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.harness.provenance import ROOT

# What every worker imports (seconds of CPU each): a smoke run's server imports them once (Runner's `forked`).
PRELOAD = (
    "torch",
    "transformers",
    "datasets",
    "peft",
    "deepspeed",
    "transformers.trainer",
    "transformers.trainer_seq2seq",
    "lorakit.engine.loop",
    "lorakit.backends.deepspeed",
    "torch.utils.tensorboard",  # a run's tracker
    "matplotlib.figure",  # a run's loss.png
    "matplotlib.backends.backend_agg",
)


def worker_env() -> dict[str, str]:
    """A worker's variables: this process's, quiet, the hub offline, this checkout on the path."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    env.update({k: env.get(k, "1") for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


class Runner:
    """Runs workers (`SCRIPT --worker KIND SPEC RESULT`) one at a time, each a new interpreter (`forked`, smoke
    runs: a child of a server that imported `preload` only), under one time budget, into one log."""

    def __init__(
        self,
        script: str | Path,
        tmp: Path,
        log_path: Path,
        budget: float = math.inf,
        forked: bool = False,
        preload: tuple[str, ...] = PRELOAD,
    ):
        self.script, self.tmp, self.log_path = Path(script).resolve(), tmp, log_path
        self.deadline = time.monotonic() + budget
        self.zygote = None
        import torch

        # Not on CUDA: DeepSpeed's import, in the server, initialises CUDA, which a forked process cannot use.
        if forked and not torch.cuda.is_available():
            from tests.docs.zygote import Zygote  # the doc tests' fork server: its `python` is a shim

            self.zygote = Zygote(worker_env(), tmp, log=tmp / "zygote.log", warm=tuple(preload))
            weakref.finalize(self, self.zygote.close)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, kind: str, spec: dict, name: str, reserve: float = 20.0) -> dict:
        """The worker's JSON result plus `process_seconds`; RuntimeError if it fails or runs out of time."""
        spec_path, result_path = self.tmp / f"{name}.spec.json", self.tmp / f"{name}.result.json"
        spec_path.write_text(json.dumps(spec))
        result_path.unlink(missing_ok=True)
        timeout = None if math.isinf(self.remaining()) else max(self.remaining() - reserve, 1.0)
        load = os.getloadavg()[0]
        argv = ["--worker", kind, str(spec_path), str(result_path)]
        with open(self.log_path, "a") as log:
            log.write(f"\n===== {name} ({kind}) {datetime.now(timezone.utc).isoformat(timespec='seconds')}\n")
            log.flush()
            offset, start = log.tell(), time.perf_counter()
            code = self._start(argv, log, timeout)
        seconds = time.perf_counter() - start
        if code != 0 or not result_path.is_file():
            tail = Path(self.log_path).read_bytes()[offset:][-4000:].decode(errors="replace")
            why = f"timed out after {timeout:.0f} s (budget)" if code is None else f"exit code {code}"
            raise RuntimeError(f"{name} run failed: {why}; last output:\n{tail}")
        return dict(json.loads(result_path.read_text()), process_seconds=seconds, load_avg_1min_before=load)

    def _start(self, argv: list[str], log, timeout: float | None) -> int | None:
        """`python SCRIPT ARGV`: its exit code, None when it outlived `timeout`."""
        python, env = sys.executable, worker_env()
        if self.zygote is not None:
            self.zygote.wait_ready(timeout=120)  # until then (or if it died) `python` is a new interpreter
            python, env = self.zygote.python, self.zygote.env
        own = {"stdout": log, "stderr": subprocess.STDOUT, "start_new_session": True}  # killed as a group
        proc = subprocess.Popen([python, str(self.script), *argv], cwd=ROOT, env=env, **own)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # its own session: the worker (or the shim, whose child the server kills)
            proc.wait()
            return None


def worker_main(workers: dict, argv: list[str]) -> int:
    """In the worker process: `--worker KIND SPEC RESULT` runs workers[KIND](spec) and writes its JSON."""
    kind, spec_path, result_path = argv[1:4]
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("torch_threads"):
        import torch

        torch.set_num_threads(spec["torch_threads"])
    # RESULT may hold {rank}: a worker under torchrun writes one result per rank.
    Path(result_path.format(rank=os.environ.get("RANK", "0"))).write_text(json.dumps(workers[kind](spec)))
    return 0


def interleave(items: list, rounds: int, run_one, log, title: str = "repeat") -> list[dict]:
    """Every item once per round, the order reversed every other round; runs get `repeat` and `position`."""
    runs = []
    for rnd in range(rounds):
        order = list(items) if rnd % 2 == 0 else list(reversed(items))
        log(f"{title} {rnd + 1}/{rounds}: {' -> '.join(map(str, order))}")
        runs += [dict(run_one(item, rnd), repeat=rnd, position=i) for i, item in enumerate(order)]
    return runs


def derive(run: dict, rates: dict) -> dict:
    """Adds each rate `name: [numerator, denominator]` of the spec to a run (in place) and returns it."""
    run.update({k: run[n] / run[d] for k, (n, d) in rates.items() if run.get(n) is not None and run.get(d)})
    return run


def median(values) -> float | None:
    """The median of the values that are not None (None when there are none)."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def medians_of(runs: list[dict], keys: list[str]) -> dict:
    return {k: median(r.get(k) for r in runs) for k in keys}


def first_of(runs: list[dict], sides: list[str], key: str) -> dict:
    """{side: `key` of the side's first run} (for what every run of a side has alike)."""
    return {s: next(r[key] for r in runs if r["side"] == s) for s in sides}


def pairs(runs: list[dict], side: str, base: str) -> list[tuple[dict, dict]]:
    """(base run, side run) of every round (`repeat`) that ran both sides."""
    by_round: dict[int, dict] = {}
    for r in runs:
        by_round.setdefault(r["repeat"], {})[r["side"]] = r
    return [(d[base], d[side]) for _, d in sorted(by_round.items()) if base in d and side in d]


def paired_ratios(runs: list[dict], side: str, base: str, key: str) -> list[float]:
    return [s[key] / b[key] for b, s in pairs(runs, side, base)]


def ratios(runs: list[dict], meds: dict, comparisons, key_format: str = "{side}/{versus}") -> dict:
    """Each comparison (side, versus): ratios of the medians and the same ratios round by round, per CPU
    second too when runs record CPU time, the eval-loss difference when they record an eval loss."""
    out = {}
    for side, base in comparisons:
        m, b = meds[side], meds[base]
        paired = paired_ratios(runs, side, base, "useful_tokens_per_second")
        r = {"side": side, "versus": base}
        r["useful_tokens_per_second"] = m["useful_tokens_per_second"] / b["useful_tokens_per_second"]
        r.update(paired_useful_tokens_per_second=paired, paired_median=statistics.median(paired))
        r["epoch_time_speedup"] = b["epoch_seconds"] / m["epoch_seconds"]
        for k in ("step_useful_tokens_per_second", "useful_tokens_per_cpu_second"):
            r.update({k: m[k] / b[k]} if k in m else {})
        if "useful_tokens_per_cpu_second" in m:
            cpu = paired_ratios(runs, side, base, "useful_tokens_per_cpu_second")
            r["paired_useful_tokens_per_cpu_second"] = cpu
        r["padding_efficiency_ratio"] = m["padding_efficiency"] / b["padding_efficiency"]
        if "eval_loss" in m:
            r["eval_loss_difference"] = m["eval_loss"] - b["eval_loss"]
            diffs = [s["eval_loss"] - v["eval_loss"] for v, s in pairs(runs, side, base)]
            r["paired_eval_loss_differences"] = diffs
        out[key_format.format(side=side, versus=base)] = r
    return out


def claims(specs: list[dict], ratio_of: dict, meds: dict, valid: bool, key_format="{side}/{versus}") -> list:
    """Each claim of the spec with the measured value it is judged on (benchmarks/README.md); `claim_met` is
    False whenever the runs failed their checks (`valid`)."""
    out = []
    for c in specs:
        r = ratio_of[key_format.format(**c)]
        if c["metric"] == "eval_loss":
            side, base = meds[c["side"]]["eval_loss"], meds[c["versus"]]["eval_loss"]
            diffs = r["paired_eval_loss_differences"]
            out.append(dict(c, side_eval_loss=side, versus_eval_loss=base, paired_differences=diffs))
            out[-1]["claim_met"] = bool(valid and side <= base)
            continue
        measured, need = r[c["metric"]], c["ratio_at_least"]
        out.append(dict(c, measured_ratio=measured, paired_median=r["paired_median"]))
        out[-1]["claim_met"] = bool(valid and measured >= need)
        if "useful_tokens_per_cpu_second" in r:
            cpu = r["useful_tokens_per_cpu_second"]
            out[-1].update(cpu_ratio=cpu, cpu_claim_met=bool(valid and cpu >= need))
    return out


def one_or_all(values) -> object:
    """The value when every run agrees on it, else the sorted distinct values (a check that failed)."""
    distinct = sorted(set(values))
    return distinct[0] if len(distinct) == 1 else distinct


def token_checks(every: list[dict], rows: int, label=lambda r: r["side"]) -> dict:
    """What every run of a lorakit-only benchmark must share: useful and loss tokens, each example once."""
    useful, examples = sorted({r["useful_tokens"] for r in every}), sorted({r["examples"] for r in every})
    counted = all(r["counted_useful_tokens"] == r["useful_tokens"] for r in every)
    # With one torch thread, a run well below 1 CPU second per wall second lost the core to other jobs.
    slow = [label(r) for r in every if r["cpu_seconds_per_wall_second"] < 0.9]
    return {
        "useful_tokens_equal_on_all_runs": len(useful) == 1 and counted,
        "useful_tokens": one_or_all(useful),
        "loss_tokens": one_or_all(r["loss_tokens"] for r in every),
        "examples_per_run": one_or_all(examples),
        "each_example_once": examples == [rows],
        "runs_checked": len(every),
        "runs_with_cpu_per_wall_below_0.9": slow,
    }
