"""python -m lorakit.compare RUN_DIR [RUN_DIR ...]: put finished runs (LoRA, QLoRA, full fine-tuning) side by
side: a table in the terminal, and report.md with PNG plots (loss vs tokens, eval metrics, throughput and
memory) in --output. See docs/compare.md."""

from __future__ import annotations

import argparse
import sys

from lorakit.callable_module import forward_calls
from lorakit.cli import run_cli
from lorakit.report.comparison import DEFAULT_GPU_HOUR_PRICE, DEFAULT_OUTPUT


def parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    p = argparse.ArgumentParser(prog="python -m lorakit.compare", description=__doc__)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (each holds summary.json)")
    p.add_argument(
        "--output",
        default=DEFAULT_OUTPUT,
        help="directory for report.md and the PNG plots; created if missing, and earlier report files in it "
        "are replaced (default: ./%(default)s)",
    )
    p.add_argument(
        "--gpu-hour-price",
        type=float,
        default=DEFAULT_GPU_HOUR_PRICE,
        help="price of one GPU-hour in dollars; cost = train hours x processes x price (default: %(default)s)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m lorakit.compare`."""
    return run_cli(_compare, parser().parse_args(argv))


def _compare(args: argparse.Namespace) -> int:
    """Compare the runs; print the table and where the report and plots are."""
    from lorakit.report import compare

    result = compare(args.run_dirs, output=args.output, gpu_hour_price=args.gpu_hour_price)
    print(result.table())
    for note in result.notes:
        print(f"note: {note}")
    print(f"\nreport: {result.report}")
    for path in result.plots.values():
        print(f"plot:   {path}")
    return 0


forward_calls(__name__, "lorakit.report:compare")

if __name__ == "__main__":
    sys.exit(main())
