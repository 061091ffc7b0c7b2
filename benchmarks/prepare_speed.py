"""Data preparation: `lorakit.prepare` against the FLAN-T5 DeepSpeed guide's `datasets.map` preprocessing, on
the same rows with the same number of processes, measured side by side.

    python benchmarks/prepare_speed.py --rows 302000          # -> benchmarks/results/prepare_speed.json
    python benchmarks/prepare_speed.py --shape code           # -> benchmarks/results/prepare_speed_code.json
    python benchmarks/prepare_speed.py --smoke --output /tmp/ps.json      # 500 rows: tests the script

The rows (`--shape news`): the bundled news_summaries train split repeated to `--rows` rows (each article
prefixed with its row number); (`--shape code`): generated Python functions with long-tailed lengths (a third
over the tiny T5's 512 tokens) as `article` and a short docstring as `highlights`, code -> docstring; one JSONL
file both sides read; lorakit's tiny T5 tokenizer. **guide**: the FLAN-T5 DeepSpeed
guide's `datasets.map(preprocess_function)` (padding to 512 and to the longest target) and `save_to_disk`;
**lorakit**: `lorakit.prepare` on the quickstart's template with `auto` caps and a fresh cache. Each run is a
fresh process; the sides alternate. The ratio that counts is lorakit's wall time over the guide's in the same
round (below 1.0: lorakit is faster). benchmarks/README.md says more.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # as a script: the harness and this lorakit

from benchmarks.harness.workers import guide_preprocess  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "prepare_speed.json"
SAMPLE = ROOT / "lorakit" / "data" / "samples" / "news_summaries" / "train.jsonl"
TEMPLATE = "Summarize the following news article:\n{input}\nSummary:\n"
GUIDE_SOURCE_CAP = 512


def _base_rows() -> list[dict]:
    return [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]


WORDS = "value index count total items result buffer name path text data size offset key node".split()
VERBS = "load parse merge split count sort read write build check find update compute render encode".split()


def _code_row(rng, i: int) -> dict:
    """A generated Python function (lognormal body length: long-tailed) and its one-line docstring."""
    args = rng.sample(WORDS, rng.randint(1, 4))
    lines = [f"def {rng.choice(VERBS)}_{rng.choice(WORDS)}_{i}({', '.join(args)}):"]
    for _ in range(max(2, int(rng.lognormvariate(2.6, 0.9)))):
        a, b, c, n = rng.choice(WORDS), rng.choice(WORDS), rng.choice(args), rng.randint(0, 999)
        lines.append(rng.choice([f"    {a} = {c}.{rng.choice(VERBS)}({b}, {n})", f"    # {b} of each {a}"]))
        lines += [f"    if {a} > {n}:\n        {b} += len({c})"][: rng.randint(0, 2) % 2]
    doc = f"{rng.choice(VERBS).capitalize()} the {rng.choice(WORDS)} of {args[0]} by {rng.choice(WORDS)}."
    return {"article": "\n".join([*lines, f"    return {args[0]}"]), "highlights": doc}


def write_rows(path: Path, rows: int, shape: str = "news") -> None:
    base, rng = _base_rows(), random.Random(0)
    with open(path, "w") as f:
        for i in range(rows):
            r = base[i % len(base)]
            row = _code_row(rng, i) if shape == "code" else {**r, "article": f"Report {i}. {r['article']}"}
            f.write(json.dumps(row) + "\n")


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def guide(rows: Path, model: Path, out: Path, num_proc: int, target_cap: int) -> dict:
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    wall, cpu = time.perf_counter(), _cpu()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ds = datasets.load_dataset("json", data_files=str(rows), split="train", cache_dir=str(out / "hf-cache"))
    columns, caps = ("article", "highlights"), (GUIDE_SOURCE_CAP, target_cap)
    preprocess_function = guide_preprocess(tokenizer, TEMPLATE, columns, caps)
    num_proc = num_proc if num_proc > 1 else None
    mapping = {"remove_columns": ["article", "highlights"], "num_proc": num_proc}
    tokenized = ds.map(preprocess_function, batched=True, **mapping)
    tokenized.save_to_disk(str(out / "train"))
    return {"wall_seconds": time.perf_counter() - wall, "cpu_seconds": _cpu() - cpu, "rows": len(tokenized)}


def lorakit_side(rows: Path, model: Path, out: Path, num_proc: int) -> dict:
    import datasets

    import lorakit
    import lorakit.api  # lorakit.prepare's own imports, outside the timed region as the guide's are
    from lorakit.recipe import recipe_from_dict

    datasets.disable_progress_bars()
    data = {"source": str(rows), "input_column": "article", "target_column": "highlights"}
    data.update(prompt_template=TEMPLATE, max_source_length="auto", max_target_length="auto")
    data.update(num_proc=num_proc, cache_dir=str(out / "cache"))
    recipe = {"model": {"name_or_path": str(model)}, "method": {"kind": "lora"}, "data": data}
    recipe.update(eval={"enabled": False}, distributed={"num_processes": 1}, output={"dir": str(out / "run")})
    recipe = recipe_from_dict(recipe)
    wall, cpu = time.perf_counter(), _cpu()
    data = lorakit.prepare(recipe)
    took = {"wall_seconds": time.perf_counter() - wall, "cpu_seconds": _cpu() - cpu, "rows": len(data.train)}
    assert not data.cache_hit
    return {**took, "lengths": vars(data.lengths)}


def longest_target(model: Path, rows: Path) -> int:
    """The guide's max_target_length: the longest tokenized target of the rows."""
    from transformers import AutoTokenizer

    targets = [json.loads(line)["highlights"] for line in rows.read_text().splitlines()]
    return max(len(ids) for ids in AutoTokenizer.from_pretrained(str(model))(targets)["input_ids"])


def run_side(side: str, rows: Path, model: Path, num_proc: int, target_cap: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"prepare-{side}-", dir=rows.parent) as tmp:
        cmd = [sys.executable, __file__, "--worker", side, str(rows), str(model), tmp, str(num_proc)]
        load, start = os.getloadavg()[0], time.perf_counter()
        res = subprocess.run(cmd + [str(target_cap)], capture_output=True, text=True, cwd=ROOT)
        process = time.perf_counter() - start
        if res.returncode != 0:
            raise SystemExit(f"{side} failed:\n{res.stderr[-3000:]}")
        # process_seconds: the whole process, its imports included (what a user waits for).
        out = json.loads(res.stdout.strip().splitlines()[-1])
        return {**out, "process_seconds": process, "load_before": load}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--worker":
        side, rows, model, out, num_proc, target_cap = args[1:7]
        fn = guide if side == "guide" else lorakit_side
        extra = (int(target_cap),) if side == "guide" else ()
        print(json.dumps(fn(Path(rows), Path(model), Path(out), int(num_proc), *extra)))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=302_000)
    p.add_argument("--shape", choices=("news", "code"), default="news", help="news, or code -> docstring")
    p.add_argument("--num-proc", type=int, default=1, help="processes of both sides' map (data.num_proc)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of (guide, lorakit)")
    p.add_argument("--work-dir", help="where the rows file and outputs go (default: a temp dir)")
    p.add_argument("--output", default=None, help=f"result JSON (default {RESULT.relative_to(ROOT)})")
    p.add_argument("--cache-dir", help="where lorakit's tiny T5 is built or found (default: work dir)")
    p.add_argument("--smoke", action="store_true", help="500 rows, 1 round: tests the script")
    p.add_argument("--note", default="")
    a = p.parse_args(args)
    if a.smoke:
        a.rows, a.repeats = 500, 1
    result_file = RESULT.with_name(f"prepare_speed{'' if a.shape == 'news' else '_' + a.shape}.json")
    output = Path(a.output) if a.output else Path(tempfile.mkdtemp()) / "ps.json" if a.smoke else result_file
    from lorakit.testing import resolve_model_source

    with tempfile.TemporaryDirectory(prefix="prepare-speed-", dir=a.work_dir) as work:
        work, rows = Path(work), Path(work) / "rows.jsonl"
        write_rows(rows, a.rows, a.shape)
        model = Path(resolve_model_source("tiny:t5", a.cache_dir or str(work / "models")))
        target_cap = longest_target(model, rows)
        rounds = []
        for i in range(a.repeats):
            order = ("guide", "lorakit") if i % 2 == 0 else ("lorakit", "guide")
            rounds.append({side: run_side(side, rows, model, a.num_proc, target_cap) for side in order})
            r = rounds[-1]
            r["ratio_wall"] = r["lorakit"]["wall_seconds"] / r["guide"]["wall_seconds"]
            r["ratio_cpu"] = r["lorakit"]["cpu_seconds"] / r["guide"]["cpu_seconds"]
            print(f"round {i + 1}: lorakit / guide = {r['ratio_wall']:.2f}x wall, {r['ratio_cpu']:.2f}x CPU")
    med = {side: statistics.median(r[side]["wall_seconds"] for r in rounds) for side in ("guide", "lorakit")}
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0]}
    result = {"benchmark": "prepare_speed", "shape": a.shape, "rows": a.rows, "num_proc": a.num_proc}
    result.update(guide_caps={"source": GUIDE_SOURCE_CAP, "target": target_cap}, note=a.note, machine=machine)
    result.update(rounds=rounds, median_wall_seconds=med, ratio_of_medians=med["lorakit"] / med["guide"])
    claim = {"text": "lorakit.prepare takes at most the guide's time (ratio <= 1.0)"}
    result.update(ratio_per_round=[r["ratio_wall"] for r in rounds], claim=claim)
    claim["met"] = result["ratio_of_medians"] <= 1.0
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"lorakit / guide: {result['ratio_of_medians']:.2f}x (medians); wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
