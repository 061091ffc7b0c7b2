"""A benchmark's command line, built from its spec, and the invocation it drives (`Bench`)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.harness import plots
from benchmarks.harness.provenance import ROOT, Provenance
from benchmarks.harness.runner import Runner, derive, first_of, interleave, medians_of, ratios, worker_main
from benchmarks.harness.workers import dig, lorakit_worker

SPECS = ROOT / "benchmarks" / "specs"


def load_spec(name: str) -> dict:
    """benchmarks/specs/NAME.yaml: what a benchmark compares, measures and claims (see benchmarks/README.md)."""
    import yaml

    return yaml.safe_load((SPECS / f"{name}.yaml").read_text())


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


TYPES = {"int": int, "float": float, "str": str, "path": str, "ints": _positive_ints}
TYPES["names"] = lambda text: [x.strip() for x in text.split(",") if x.strip()]
KINDS = {"flag": {"action": "store_true"}, "switch": {"choices": ("on", "off")}}


def script(spec: dict) -> str:
    """How the spec's script is called: NAME.py, or the spec's `script` (one script, several measurements)."""
    return spec.get("script", f"{spec['benchmark']}.py")


def options(spec: dict) -> dict:
    """The spec's options, each completed from specs/options.yaml (the options benchmarks share)."""
    shared = load_spec("options")
    return {name: {**shared.get(name, {}), **(o or {})} for name, o in spec.get("options", {}).items()}


def parse(spec: dict, module, argv: list[str]) -> argparse.Namespace:
    """The spec's options plus --output, --smoke, --note and --plot-only, parsed; bad values exit with 2."""
    p = argparse.ArgumentParser(prog=f"python benchmarks/{script(spec)}", description=spec["about"])
    default = spec.get("output_help", spec.get("output"))
    p.add_argument("--output", help=f"result JSON (default: {default}; --smoke: a temp file)")
    smoke = f"small runs that test the script: {' '.join(spec['smoke'])}"
    p.add_argument("--smoke", action="store_true", help=smoke)
    p.add_argument("--note", action="append", help="a note to store in the result (repeatable)")
    p.add_argument("--plot-only", metavar="RESULT_JSON", help="only redraw the chart of an existing result")
    for name, o in options(spec).items():
        kw = {k: o[k] for k in ("default", "metavar", "nargs", "choices") if k in o}
        kw.update(KINDS.get(o.get("type"), {"type": TYPES.get(o.get("type", "str"))}))
        shown = " (default: %(default)s)" if kw.get("default") is not None else ""
        flag = name if o.get("positional") else "--" + name.replace("_", "-")
        p.add_argument(flag, help=o.get("help", "") + shown, **kw)
    args = p.parse_args(argv)
    if args.smoke:
        args = p.parse_args([*spec["smoke"], *argv])
    args.argv = argv
    for name, o in options(spec).items():
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if "min" in o and value is not None and value < o["min"]:
            p.error(f"{flag} must be >= {o['min']}")
        if "multiple_of" in o and value % (n := dig(spec["recipe"], o["multiple_of"])):
            # lorakit's sampler fills a last short micro-batch with repeats: the sides' counts would differ.
            what = o["multiple_of"].rpartition(".")[2].replace("_", " ")
            p.error(f"{flag} must be a multiple of the {what} {n}")
        if "of" in o and value is not None:  # names of the spec's `of` entries, at least one
            unknown, what = sorted(set(value) - set(spec[o["of"]])), o["of"].removesuffix("s") + "(s)"
            if unknown or not value:
                p.error(f"{flag}: unknown {what} {', '.join(unknown)}; known: {', '.join(spec[o['of']])}")
        if o.get("type") == "switch":
            setattr(args, name, value == "on")
        elif o.get("type") == "path" and value is not None:
            setattr(args, name, str(Path(value).expanduser().resolve()))
    if hasattr(module, "check_args"):
        module.check_args(args, p.error)
    return args


def main(module, argv: list[str] | None = None) -> int:
    """The entry point of a benchmark script: a worker (`--worker ...`), a chart (`--plot-only`), or a run."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main({"lorakit": lorakit_worker, **getattr(module, "WORKERS", {})}, argv)
    if hasattr(module, "MEASUREMENTS"):  # one script, several measurements: the first argument names one
        if argv[:1] and argv[0] in module.MEASUREMENTS:
            return main(SimpleNamespace(**module.MEASUREMENTS[argv[0]], __file__=module.__file__), argv[1:])
        names = "{" + ",".join(module.MEASUREMENTS) + "}"
        usage = f"usage: python benchmarks/{Path(module.__file__).name} {names} [--help | OPTIONS]"
        print(usage, file=sys.stderr)
        return 2
    args = parse(module.SPEC, module, argv)
    if args.plot_only:
        path = Path(args.plot_only)
        if not plots.render(module, json.loads(path.read_text()), path.with_suffix(".png")):
            print("error: --plot-only needs matplotlib and something to draw", file=sys.stderr)
            return 2
        return 0
    bench = Bench(module, args)
    try:
        return module.measure(bench)
    finally:
        shutil.rmtree(bench.tmp, ignore_errors=True)


def set_dotted(raw: dict, key: str, value) -> None:
    """raw['a']['b'] = value for key 'a.b' (a dotted override, as on lorakit's command line)."""
    *path, last = key.split(".")
    for part in path:
        raw = raw.setdefault(part, {})
    raw[last] = value


class Bench:
    """One invocation of a benchmark: its spec, options, worker runner, provenance and output."""

    def __init__(self, module, args: argparse.Namespace):
        self.module, self.spec, self.args = module, module.SPEC, args
        self.provenance = Provenance()
        self.tmp = Path(tempfile.mkdtemp(prefix=f"lorakit-{self.spec['benchmark']}-"))
        by = self.spec.get("output_by")  # an option: `dataset` writes to `datasets[--dataset].output`
        default = self.spec[f"{by}s"][getattr(args, by)]["output"] if by else self.spec["output"]
        if args.smoke and not args.output:  # never over a committed result: a directory that outlives the run
            default = Path(tempfile.mkdtemp(prefix=f"lorakit-{self.spec['benchmark']}-smoke-")) / "smoke.json"
        self.output = Path(args.output or ROOT / default).expanduser().resolve()
        self.runner = Runner(module.__file__, self.tmp, self.tmp / "workers.log", forked=args.smoke)
        self.model_config = None  # the model's config, once `prepare` has run

    log = staticmethod(lambda msg: print(msg, flush=True))

    def recipe(self, side: str | None = None, overrides: dict | None = None) -> dict:
        """The spec's recipe, then the side's dotted overrides, the options bound to recipe keys, `overrides`."""
        raw = json.loads(json.dumps(self.spec["recipe"]))
        set_dotted(raw, "output.dir", str(self.tmp / "unused"))  # runs get their own (`run`)
        bound = {o["recipe"]: getattr(self.args, n) for n, o in options(self.spec).items() if "recipe" in o}
        side_overrides = self.spec["sides"][side].get("recipe", {}) if side else {}
        for key, value in {**side_overrides, **bound, **(overrides or {})}.items():
            set_dotted(raw, key, value)
        return raw

    def prepare(self, side: str, overrides: dict | None = None):
        """lorakit.prepare on the side's recipe, so that no timed run pays for it; keeps the model config."""
        import lorakit
        from lorakit.model import load_config
        from lorakit.recipe import recipe_from_dict

        recipe = recipe_from_dict(self.recipe(side, overrides))
        data = lorakit.prepare(recipe)
        self.model_config = load_config(recipe)[1]
        return data

    def packing(self, side: str) -> bool:
        return bool(self.spec["sides"][side].get("recipe", {}).get("data.packing"))

    def run(self, side: str, label=None, overrides=None, kind="lorakit", spec=None, **fields) -> dict:
        """One run of a side in a fresh worker (lorakit.train unless `kind`/`spec` say otherwise)."""
        label = label or side
        work = str(self.tmp / f"work-{label}-{time.monotonic_ns()}")
        if spec is None:
            recipe = self.recipe(side, {"output.dir": work, **(overrides or {})})
            spec = {"recipe": recipe, **self.spec["worker"]}
        spec = {"torch_threads": getattr(self.args, "torch_threads", None), "work_dir": work, **spec}
        r = derive(dict(self.runner.run(kind, spec, label), side=side, **fields), self.spec.get("rates", {}))
        try:
            self.log(f"  {label:20s} {self.spec['log_line'].format_map(r)}")
        except (KeyError, TypeError, ValueError):  # a value the line cannot show (e.g. no eval loss)
            self.log(f"  {label:20s} done")
        return r

    def rounds(self, items: list, rounds: int, run_one, title: str = "repeat") -> list[dict]:
        """Interleaved rounds of `run_one(item, round)` (see runner.interleave)."""
        return interleave(items, rounds, run_one, self.log, title)

    def sweep(self, items: list, run_one, extra=lambda item, runs: {}) -> dict:
        """The spec's `sweep`: interleaved rounds (--sweep-repeats) of `run_one(item)`, a summary per item
        (medians, `run_lists`, `firsts`, `extra(item, runs)`), the best item by each metric of `choose`."""
        sw = self.spec["sweep"]
        runs = self.rounds(items, self.args.sweep_repeats, lambda x, _: run_one(x), sw["title"])
        per = {}
        for x in items:
            mine = [r for r in runs if r[sw["key"]] == x]
            per[str(x)] = {**medians_of(mine, self.spec["medians"]), **extra(x, mine)}
            per[str(x)].update({f"{k}_runs": [r[k] for r in mine] for k in sw["run_lists"]})
            per[str(x)].update({k: mine[0][k] for k in sw["firsts"]})
        best = {name: max(items, key=lambda x, m=m: per[str(x)][m]) for name, m in sw["choose"].items()}
        head = {"how": sw["how"], sw["items"]: list(items), "repeats": self.args.sweep_repeats}
        return {**head, sw["per"]: per, **best, "runs": runs}

    def summarise(self, runs: list[dict], sides: list[str], comparisons) -> tuple[dict, dict]:
        """(medians per side of the spec's `medians` keys, ratios of each comparison)."""
        meds = {s: medians_of([r for r in runs if r["side"] == s], self.spec["medians"]) for s in sides}
        return meds, ratios(runs, meds, comparisons, self.spec.get("ratio_key", "{side}/{versus}"))

    def setup(self, runs: list[dict], sides: list[str], data: dict, **more) -> dict:
        """The result's `setup`: model, `data`, recipe, each side's attention, `more` (after `prepare`)."""
        recipe, first = self.spec["recipe"], runs[0]
        attrs = {k: getattr(self.model_config, k, None) for k in self.spec["model_config"]}
        model = {"name_or_path": recipe["model"]["name_or_path"]}
        model["built_by"] = "lorakit.testing.resolve_model_source"
        model.update(attrs, **{k: first[k] for k in ("total_params", "trainable_params")})
        out = {"model": model, "data": data, "lora": recipe["method"]}
        out["train"] = dict(recipe["train"], optimizer=self.spec["optimizer"])
        out["dtype"] = recipe["model"]["dtype"]
        out.update(gradient_checkpointing=self.args.gradient_checkpointing)
        out.update(attention=first_of(runs, sides, "attention"), **more, processes=1)
        return {**out, "torch_threads": sorted({r["torch_threads"] for r in runs})}

    def per_side(self, runs: list[dict], sides: list[str], equal: bool, meds: dict, firsts=()) -> dict:
        """Tables by side: useful tokens, padding efficiency, token slots, `firsts` (from its first run)."""
        tokens = {s: sorted({r["useful_tokens"] for r in runs if r["side"] == s}) for s in sides}
        out = {"useful_tokens": {"per_side": {s: v[0] if len(v) == 1 else v for s, v in tokens.items()}}}
        out["useful_tokens"]["equal_on_all_sides"] = equal
        out["padding_efficiency"] = {s: meds[s]["padding_efficiency"] for s in sides}
        return {**out, **{key: first_of(runs, sides, key) for key in ("token_slots", *firsts)}}

    def describe(self, sides, **context) -> dict:
        """{side: the spec's description of it}, with {placeholders} filled from `context`."""
        return {s: self.spec["sides"][s]["about"].format(**context) for s in sides}

    def result(self, **fields) -> dict:
        """A result with the common blocks first: what it measured, the command, date, machine, versions."""
        head = {"benchmark": self.spec["benchmark"], "measured": self.spec["measured"], **fields}
        head["command"] = f"python benchmarks/{script(self.spec)} " + " ".join(self.args.argv)
        if "timing" in self.spec:
            head["timing"] = self.spec["timing"]
        return {**head, **self.provenance.start(), "notes": list(self.args.note or [])}

    def finish(self, result: dict, valid: bool = True) -> int:
        """Writes the result and its chart, logs ratios and claims; 1 when the runs failed their checks."""
        from lorakit.rundir import write_json

        result.update(self.provenance.end())
        if not result["lorakit_source"]["unchanged_during_run"]:
            changed = ", ".join(result["lorakit_source"]["changed_during_run"])
            self.log(f"warning: lorakit's source changed while the benchmark ran: {changed}")
        write_json(self.output, result)
        checks = result.get("checks", {})
        if "examples_per_run" in checks:
            examples = checks["examples_per_run"]
            self.log(f"useful tokens: {checks['useful_tokens']} on every run, {examples} examples")
        for key, r in result.get("ratios", {}).items():
            paired = [round(x, 2) for x in r["paired_useful_tokens_per_second"]]
            ratio = r["useful_tokens_per_second"]
            self.log(f"{key}: x{ratio:.2f} useful tokens/s (of medians), paired {paired}")
        for c in result.get("claims") or ([dict(result, name="claim")] if "claim_met" in result else []):
            self.log(f"{c['name']}: {'met' if c['claim_met'] else 'NOT met'}")
        self.log(f"wrote {self.output} in {result['benchmark_wall_seconds']:.0f} s")
        png = self.output.with_suffix(".png")
        if hasattr(self.module, "plot"):
            drawn = plots.render(self.module, result, png)
            self.log(f"wrote {png}" if drawn else "no chart (it needs matplotlib: pip install matplotlib)")
        if not valid:
            print(f"error: {self.spec['invalid']}", file=sys.stderr)
            return 1
        return 0
