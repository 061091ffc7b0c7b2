"""python -m lorakit.generate SOURCE --input FILE|-: run a trained model (a run directory, its adapter
directory, or a merged model directory) on new inputs, with the prompt template it was trained with, and
write one JSON line per input: its columns, the prompt, the output (and the label, for classifier runs).
See docs/inference.md."""

from __future__ import annotations

import argparse
import sys

from lorakit.callable_module import forward_calls
from lorakit.cli import add_dtype_option, add_trust_options, grants, options, quiet_libraries, run_cli


def parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    p = argparse.ArgumentParser(prog="python -m lorakit.generate", description=__doc__)
    p.add_argument("source", help="run directory, adapter directory, or merged (or full) model directory")
    p.add_argument(
        "--input",
        required=True,
        help="JSONL file of rows with the columns the prompt template names, or plain text lines for a "
        "one-column template; - reads stdin",
    )
    p.add_argument("--output", default=None, help="JSONL file to write (default: stdout)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="generation cap (default: the run's eval.max_new_tokens; auto: its target cap; else 128)",
    )
    p.add_argument("--num-beams", type=int, default=1, help="beam search width (default 1: greedy)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (default 8)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: the GPU if any, else cpu)")
    add_dtype_option(
        p, "dtype to run in (default: the run's model.dtype; without a recipe, as the weights were saved)"
    )
    add_trust_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m lorakit.generate`."""
    return run_cli(_generate, parser().parse_args(argv))


def _generate(args: argparse.Namespace) -> int:
    """Generate for the inputs; print JSON lines unless --output names a file."""
    from lorakit.inference import generate
    from lorakit.inference.generation import to_jsonl

    quiet_libraries()
    names = ("output", "max_new_tokens", "num_beams", "batch_size", "device", "dtype")
    result = generate(args.source, args.input, **options(args, *names), **grants(args))
    if args.output is None:
        sys.stdout.write(to_jsonl(result.records))
    return 0


# `lorakit.generate` is the function as well as this module.
forward_calls(__name__, "lorakit.inference:generate")

if __name__ == "__main__":
    sys.exit(main())
