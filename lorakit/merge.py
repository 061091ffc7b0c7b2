"""python -m lorakit.merge RUN_DIR_OR_ADAPTER_DIR --output DIR: merge a LoRA adapter into its base model (or
re-export a full fine-tuning run) as sharded safetensors that transformers loads, verified before it is
kept. See docs/merge.md."""

from __future__ import annotations

import argparse
import sys

from lorakit.callable_module import forward_calls
from lorakit.cli import (
    add_dtype_option,
    add_trust_options,
    grants,
    options,
    quiet_libraries,
    run_interruptible,
)


def parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    p = argparse.ArgumentParser(prog="python -m lorakit.merge", description=__doc__)
    p.add_argument("source", help="run directory, or an adapter (or full model) directory")
    p.add_argument("--output", required=True, help="directory to write the merged model to")
    add_dtype_option(p, "dtype of the exported weights (default: the run's model.dtype, else bfloat16)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB, 500MB")
    p.add_argument(
        "--base",
        default=None,
        help="base model to merge into (default: the run's model.name_or_path, else adapter_config.json's); "
        "tiny:* names resolve under the run's data.cache_dir",
    )
    p.add_argument("--force", action="store_true", help="replace --output if it exists and is not empty")
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="largest allowed logit difference, relative to the largest logit (default per dtype: float32 "
        "1e-4, float16 2e-2, bfloat16 1e-1)",
    )
    p.add_argument(
        "--compare-quantized",
        action="store_true",
        help="QLoRA runs: also report the merged model against the adapter on the 4-bit base (loads it)",
    )
    strategy = (
        "stream: shard by shard, one tensor in memory at a time; memory: load the model and merge with peft; "
        "auto (default): stream unless the merge is not per tensor (DoRA, IA3, ...), saying why"
    )
    p.add_argument("--strategy", choices=("auto", "stream", "memory"), default="auto", help=strategy)
    verify = (
        "streaming: also load the export and check its logits against the adapter model; auto (default): "
        "when there is free memory for one copy of the model"
    )
    p.add_argument("--verify-logits", choices=("auto", "always", "never"), default="auto", help=verify)
    add_trust_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m lorakit.merge`."""
    args = parser().parse_args(argv)
    return run_interruptible(_merge, args, f"nothing was written to {args.output}")


def _merge(args: argparse.Namespace) -> int:
    """Merge (or export) as the command line asks."""
    from lorakit.export import merge

    quiet_libraries()
    names = ("dtype", "max_shard_size", "base", "force", "tolerance", "compare_quantized", "strategy")
    merge(args.source, args.output, **options(args, *names, verify="verify_logits"), **grants(args))
    return 0


forward_calls(__name__, "lorakit.export:merge")

if __name__ == "__main__":
    sys.exit(main())
