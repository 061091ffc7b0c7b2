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
    parser.add_argument(
        "--allow-server",
        action="append",
        default=[],
        metavar="URL",
        help="let a run directory's recipe.yaml (a resumed run) send the adapter and prompts to URL, named by "
        "its grpo.vllm_server; repeatable. A recipe you wrote needs no flag",
    )
    args = parser.parse_intermixed_args(argv)

    def body() -> int:
        import lorakit

        quiet_libraries()
        recipe = lorakit.load_recipe(args.recipe, args.overrides)
        if not args.worker:
            from lorakit.recipe import dump_recipe
            from lorakit.rundir import check_recipe_file

            check_recipe_file(args.recipe, recipe.output.dir, dump_recipe(recipe))
            _check_servers(args, recipe)
        else:
            freeze_imported_heap()
        result = lorakit.train(recipe)
        if result.already_complete:
            print(complete_line(result))
        elif not args.worker and os.environ.get("RANK", "0") == "0":
            print("\n" + "\n".join(report_lines(result)))
        return 0

    def reporting() -> int:
        try:
            return body()
        except Exception as e:
            # Under torchrun: this rank stopped on an error of its own, unlike one that died without one.
            from lorakit.engine.launch import report_to_agent
            from lorakit.engine.loop import Preempted

            report_to_agent(e)
            if args.worker and isinstance(e, Preempted):
                # A stop request: the launcher (lorakit.train) prints it once, from exit.json, for all ranks.
                return e.exit_code
            raise

    from lorakit import dist
    from lorakit.engine.launch import launched_distributed

    # A crash's traceback (the root cause's) is printed redacted, with exit code 1 (run_cli).
    code = run_cli(reporting)
    if dist.group_broken() or (code != 0 and (launched_distributed() or dist.initialized())):
        # A failed rank of a group ends now, its error printed and recorded. Its peers may be waiting in a
        # collective until its connections close, and Python's teardown of a training process (garbage
        # collection over every library's objects) takes seconds, on a loaded machine half a minute; where a
        # peer vanished mid-collective, gloo's teardown of the group can even abort (SIGABRT, "terminate
        # called without an active exception") and replace this exit code.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def freeze_imported_heap() -> None:
    """In a rank that lorakit.train launched (a process that exists for the job alone): import the training
    stack, then move every object alive now into the collector's permanent generation (gc.freeze).

    Those objects (the modules of torch, transformers, DeepSpeed: about 700k) live until the process ends, yet
    every full collection walks them: DeepSpeed's ZeRO-3 defragmentation and the teardown of the process
    group each call gc.collect(), the memory probe scans gc.get_objects(), and Python collects on its own as
    the model is built; each walk took 0.3-1 s per rank. What the job creates stays collectable. Not in
    lorakit.train called in a person's own process, whose objects would then never be collected."""
    import gc

    import lorakit.engine.job  # noqa: F401  (what the rank imports first anyway)

    # No collection first: it would cost one more walk, to free the few cycles that imports left.
    gc.freeze()


def _check_servers(args, recipe) -> None:
    """A run directory's recipe.yaml (a resumed run, or one someone sent) is the run's record, not the
    caller's word: a server it names is sent data only when the caller confirms it (recipe/read_back.py)."""
    from pathlib import Path

    from lorakit.recipe.read_back import check_servers
    from lorakit.rundir import is_run_directory

    if is_run_directory(Path(args.recipe).resolve().parent):
        given = {override.partition("=")[0].strip() for override in args.overrides}
        check_servers(recipe.model_dump(mode="json"), args.recipe, args.allow_server, given)


def complete_line(result) -> str:
    """The one line of a relaunch that found its run finished."""
    s = result.summary
    return (f"run already complete: {result.run_dir} ({s['steps']} steps, loss {s['loss']['last']:.4f}); "
            "nothing to do (train.resume=never trains it again)")  # fmt: skip


def report_lines(result) -> list[str]:
    """What the launching process prints at the end of a run (a TrainResult): where everything went, the
    loss and evaluation; credentials (an MLFLOW_TRACKING_URI's user:password@) redacted."""
    from lorakit.disclosure import redact

    s = result.summary
    lines = [f"run dir:  {result.run_dir}"]
    lines.append(f"loss:     {s['loss']['first']:.4f} -> {s['loss']['last']:.4f} over {s['steps']} steps")
    if s.get("stop_reason") == "early_stopping":
        lines.append("stopped:  early (train.early_stopping_patience)")
    if s.get("eval"):
        lines.append("eval:     " + ", ".join(f"{k}={v:.4f}" for k, v in s["eval"].items()))
    saved = s.get("adapter_dir") or s.get("model_dir")
    if saved:
        lines.append(f"saved:    {saved}")
    if s.get("best"):
        b = s["best"]
        lines.append(f"best:     {b['metric']}={b['value']:.4f} at step {b['step']} -> {b['dir']}")
    if s.get("merged_dir"):
        lines.append(f"merged:   {s['merged_dir']}")
    lines.append(f"metrics:  {result.run_dir / 'metrics.jsonl'}")
    if (result.run_dir / "loss.png").is_file():
        lines.append(f"plot:     {result.run_dir / 'loss.png'}")
    for name, where in (s.get("trackers") or {}).items():
        place = where.get("log_dir") or where.get("dir") or where.get("tracking_uri")
        failed = f"failed ({where['failed']})" if where.get("failed") else ""
        lines.append(f"{name + ':':<9} {' '.join(str(x) for x in (place, failed) if x)}")
    return [redact(line) for line in lines]


if __name__ == "__main__":
    sys.exit(main())
