"""python -m lorakit.run RECIPE [KEY=VALUE ...]: train a recipe end to end."""

from __future__ import annotations

import argparse
import os
import sys

from lorakit.cli import quiet_libraries, recipe_parser, run_cli


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m lorakit.run`."""
    parser = recipe_parser("python -m lorakit.run", __doc__)
    # Set by lorakit.train on the workers it launches: the launching process prints the report.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    # The deepspeed launcher passes --local_rank=N unless told --no_local_rank; LOCAL_RANK in the
    # environment says the same, and is what lorakit reads.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    def body() -> int:
        import lorakit

        quiet_libraries()
        recipe = lorakit.load_recipe(args.recipe, args.overrides)
        result = lorakit.train(recipe)
        if not args.worker and os.environ.get("RANK", "0") == "0":
            s = result.summary
            print(f"\nrun dir:  {result.run_dir}")
            print(f"loss:     {s['loss']['first']:.4f} -> {s['loss']['last']:.4f} over {s['steps']} steps")
            if s.get("stop_reason") == "early_stopping":
                print("stopped:  early (train.early_stopping_patience)")
            if s.get("eval"):
                print("eval:     " + ", ".join(f"{k}={v:.4f}" for k, v in s["eval"].items()))
            saved = s.get("adapter_dir") or s.get("model_dir")
            if saved:
                print(f"saved:    {saved}")
            if s.get("best"):
                b = s["best"]
                print(f"best:     {b['metric']}={b['value']:.4f} at step {b['step']} -> {b['dir']}")
            if s.get("merged_dir"):
                print(f"merged:   {s['merged_dir']}")
            print(f"metrics:  {result.run_dir / 'metrics.jsonl'}")
            for name, where in (s.get("trackers") or {}).items():
                place = where.get("log_dir") or where.get("dir") or where.get("tracking_uri")
                failed = f"failed ({where['failed']})" if where.get("failed") else ""
                print(f"{name + ':':<10}{' '.join(str(x) for x in (place, failed) if x)}")
        return 0

    code = run_cli(body)
    from lorakit.engine import dist

    if dist.group_broken() or (code != 0 and dist.initialized()):
        # A peer vanished mid-collective, or a failing run's peers may already be gone (a run-lock refusal
        # under a foreign launcher): gloo's teardown of such a group can abort (SIGABRT, "terminate called
        # without an active exception") and replace this exit code; the error is already printed and recorded.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
