"""The benchmark harness: what every benchmark in benchmarks/ does the same way, written once.

A benchmark is a spec, `benchmarks/specs/NAME.yaml`, and a script, `benchmarks/NAME.py`, with only what is its
own: `SPEC = load_spec("NAME")`, `measure(bench)`, `plot(result, plt)`, optional `WORKERS` and `check_args`,
and `sys.exit(main(sys.modules[__name__]))`. benchmarks/README.md ("How a benchmark is built") says what each
part of the spec and each module here does.
"""

from benchmarks.harness.cli import Bench, load_spec, main
from benchmarks.harness.provenance import ROOT

__all__ = ["ROOT", "Bench", "load_spec", "main"]
