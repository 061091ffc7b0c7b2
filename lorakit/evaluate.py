"""python -m lorakit.evaluate SOURCE [--split SPLIT] [KEY=VALUE ...]: the metrics of a trained run on any
split of its data, computed with the run's recipe (and dotted overrides) by the code training evaluates
with; written to RUN/evaluate-SPLIT.json and printed. See docs/inference.md."""

from __future__ import annotations

import argparse
import sys

from lorakit.callable_module import forward_calls
from lorakit.cli import add_trust_options, grants, options, quiet_libraries, run_cli


def parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    p = argparse.ArgumentParser(prog="python -m lorakit.evaluate", description=__doc__)
    p.add_argument("source", help="run directory (or its adapter/, model/ or merged/ directory)")
    p.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. data.max_eval_samples=null")
    p.add_argument("--split", default=None, help="split of the run's data source (default: its eval split)")
    p.add_argument("--output", default=None, help="report file (default: RUN/evaluate-SPLIT.json)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: the GPU if any, else cpu)")
    add_trust_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m lorakit.evaluate`."""
    return run_cli(_evaluate, parser().parse_intermixed_args(argv))


def _evaluate(args: argparse.Namespace) -> int:
    """Evaluate the run on the split; print its metrics and where they were saved."""
    from lorakit.inference import evaluate

    quiet_libraries()
    result = evaluate(
        args.source, args.split, args.overrides, **options(args, "output", "device"), **grants(args)
    )
    where = f"{result.split} (held out of training)" if result.held_out else result.split
    print(f"split:    {where}, {result.rows} rows")
    print("eval:     " + ", ".join(f"{k}={v:.4f}" for k, v in result.metrics.items()))
    print(f"saved:    {result.output}")
    return 0


# `lorakit.evaluate` is the function as well as this module.
forward_calls(__name__, "lorakit.inference:evaluate")

if __name__ == "__main__":
    sys.exit(main())
