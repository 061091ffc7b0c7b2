"""python -m lorakit.export RUN_DIR --format ct2|gguf|gguf-lora|vllm --output DIR: export a run for a serving
engine, converted by the engine's own code and checked by the engine. See docs/export.md."""

from __future__ import annotations

import argparse
import sys

from lorakit.cli import add_trust_options, options, quiet_libraries, run_interruptible
from lorakit.export.formats import FORMATS


def parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    p = argparse.ArgumentParser(prog="python -m lorakit.export", description=__doc__)
    p.add_argument("source", help="run directory, or an adapter (or full model) directory")
    p.add_argument("--format", required=True, choices=tuple(FORMATS), help="the export format")
    p.add_argument("--output", required=True, help="directory to write the export to")
    quantizations = "; ".join(f"{f.name}: {', '.join(f.quantizations)}" for f in FORMATS.values())
    p.add_argument(
        "--quantization", default=None, help=f"default: the first of each format's ({quantizations})"
    )
    p.add_argument("--base", default=None, help="base model (default: the run's, else adapter_config.json's)")
    p.add_argument("--force", action="store_true", help="replace --output if it exists and is not empty")
    p.add_argument(
        "--llama-cpp",
        default=None,
        help="GGUF formats: a llama.cpp checkout (convert_hf_to_gguf.py, convert_lora_to_gguf.py, gguf-py); "
        "default: $LORAKIT_LLAMA_CPP",
    )
    add_trust_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m lorakit.export`."""
    args = parser().parse_args(argv)
    return run_interruptible(_export, args, f"nothing was written to {args.output}")


def _export(args: argparse.Namespace) -> int:
    from lorakit.export.exporting import export

    quiet_libraries()
    names = ("format", "quantization", "base", "force", "llama_cpp", "trust_remote_code", "allow_pickle")
    export(args.source, args.output, **options(args, *names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
