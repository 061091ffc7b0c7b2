"""lorakit.prepare vs the FLAN-T5 DeepSpeed guide's datasets.map on the same rows (`--shape news`: the bundled
news_summaries repeated to `--rows`; `code`: generated long-tailed Python -> docstring), each side a fresh
process, alternating; the ratio is lorakit's wall time over the guide's (benchmarks/README.md)."""

from __future__ import annotations

import json
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script: the harness and this lorakit

from benchmarks.harness import ROOT, load_spec, main  # noqa: E402
from benchmarks.harness.workers import guide_preprocess  # noqa: E402

SPEC = load_spec("prepare_speed")
SAMPLE = ROOT / "lorakit" / "data" / "samples" / "news_summaries" / "train.jsonl"
TEMPLATE = SPEC["recipe"]["data"]["prompt_template"]
GUIDE_SOURCE_CAP = 512


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
    base = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(rows):
            r = base[i % len(base)]
            row = _code_row(rng, i) if shape == "code" else {**r, "article": f"Report {i}. {r['article']}"}
            f.write(json.dumps(row) + "\n")


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def guide(spec: dict) -> dict:
    """The guide's preprocessing of the rows, timed (imports outside, as lorakit's are)."""
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    wall, cpu = time.perf_counter(), _cpu()
    out = Path(spec["out"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    ds = datasets.load_dataset("json", data_files=spec["rows"], split="train", cache_dir=f"{out}/hf-cache")
    columns, caps = ("article", "highlights"), (GUIDE_SOURCE_CAP, spec["target_cap"])
    preprocess_function = guide_preprocess(tokenizer, TEMPLATE, columns, caps)
    num_proc = spec["num_proc"] if spec["num_proc"] > 1 else None
    tokenized = ds.map(preprocess_function, batched=True, remove_columns=list(columns), num_proc=num_proc)
    tokenized.save_to_disk(str(out / "train"))
    return {"wall_seconds": time.perf_counter() - wall, "cpu_seconds": _cpu() - cpu, "rows": len(tokenized)}


def lorakit_side(spec: dict) -> dict:
    """`lorakit.prepare` of the rows with a fresh cache, timed."""
    import datasets

    import lorakit
    import lorakit.api  # lorakit.prepare's own imports, outside the timed region as the guide's are
    from lorakit.recipe import recipe_from_dict

    datasets.disable_progress_bars()
    out = Path(spec["out"])
    recipe = json.loads(json.dumps(SPEC["recipe"]))
    recipe["data"].update(source=spec["rows"], num_proc=spec["num_proc"], cache_dir=str(out / "cache"))
    recipe.update(model={"name_or_path": spec["model"]}, output={"dir": str(out / "run")})
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


WORKERS = {"guide": guide, "lorakit": lorakit_side}


def measure(bench) -> int:
    from lorakit.testing import resolve_model_source

    a = bench.args
    with tempfile.TemporaryDirectory(prefix="prepare-speed-", dir=a.work_dir) as work:
        work, rows = Path(work), Path(work) / "rows.jsonl"
        write_rows(rows, a.rows, a.shape)
        model = Path(resolve_model_source("tiny:t5", a.cache_dir or str(work / "models")))
        target_cap = longest_target(model, rows)
        spec = {"rows": str(rows), "model": str(model), "num_proc": a.num_proc, "target_cap": target_cap}

        def run_side(side: str, _round: int) -> dict:
            # A fresh process per run (bench.runner); its outputs removed before the next one.
            with tempfile.TemporaryDirectory(prefix=f"prepare-{side}-", dir=work) as tmp:
                # process_seconds: the whole process, its imports included (what a user waits for).
                out = bench.runner.run(side, {**spec, "out": tmp}, f"{side}-{time.monotonic_ns()}")
            return {**out, "side": side, "load_before": out.pop("load_avg_1min_before")}

        runs = bench.rounds(["guide", "lorakit"], a.repeats, run_side)
    rounds = [{r["side"]: r for r in runs if r["repeat"] == i} for i in range(a.repeats)]
    for i, r in enumerate(rounds):
        r["ratio_wall"] = r["lorakit"]["wall_seconds"] / r["guide"]["wall_seconds"]
        r["ratio_cpu"] = r["lorakit"]["cpu_seconds"] / r["guide"]["cpu_seconds"]
        bench.log(f"round {i + 1}: lorakit / guide = {r['ratio_wall']:.2f}x wall, {r['ratio_cpu']:.2f}x CPU")
    med = {side: statistics.median(r[side]["wall_seconds"] for r in rounds) for side in ("guide", "lorakit")}
    result = bench.result(shape=a.shape, rows=a.rows, num_proc=a.num_proc)
    result.update(guide_caps={"source": GUIDE_SOURCE_CAP, "target": target_cap})
    result.update(rounds=rounds, median_wall_seconds=med, ratio_of_medians=med["lorakit"] / med["guide"])
    claim = {"text": "lorakit.prepare takes at most the guide's time (ratio <= 1.0)"}
    result.update(ratio_per_round=[r["ratio_wall"] for r in rounds], claim=claim)
    claim["met"] = result["ratio_of_medians"] <= 1.0
    bench.log(f"lorakit / guide: {result['ratio_of_medians']:.2f}x (medians)")
    return bench.finish(result)


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
