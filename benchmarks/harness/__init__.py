"""The benchmark harness: what every benchmark in benchmarks/ does the same way, written once.

A benchmark is a spec, `benchmarks/specs/NAME.yaml` (its sides as dotted overrides of one base recipe, its
options, the rates and medians it reports, its comparisons and claims, the texts its result carries), and a
script, `benchmarks/NAME.py`, with only what is its own:

    SPEC = load_spec("NAME")
    def measure(bench) -> int: ...            # the runs: bench.run, bench.rounds, bench.summarise, bench.finish
    def plot(result, plt) -> figure | None    # the chart (plots.side_bars and friends)
    WORKERS = {"hf": hf_worker}               # optional: worker kinds besides "lorakit"
    def check_args(args, error): ...          # optional: checks across options (error exits with code 2)
    if __name__ == "__main__": sys.exit(main(sys.modules[__name__]))

The harness gives it the command line (`--smoke`, `--output`, `--note`, `--plot-only` and the spec's options),
fresh worker processes with a time budget (`lorakit` instruments `lorakit.train`), interleaved rounds, per-run
rates, medians, paired ratios and claims, the provenance every result records (machine, versions, load,
lorakit's source before and after), and writing the JSON and its chart. `checks.check_result` is what the
smoke tests and the tests of committed results assert about any result.
"""

from benchmarks.harness.cli import Bench, load_spec, main
from benchmarks.harness.provenance import ROOT

__all__ = ["ROOT", "Bench", "load_spec", "main"]
