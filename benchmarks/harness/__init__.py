"""What every benchmark does the same way, written once (benchmarks/README.md: "How a benchmark is built")."""

from benchmarks.harness.cli import Bench, load_spec, main
from benchmarks.harness.provenance import ROOT

__all__ = ["ROOT", "Bench", "load_spec", "main"]
