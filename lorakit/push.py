"""python -m lorakit.push RUN_OR_EXPORT_DIR REPO_ID: push a run's adapter (or model), its merged export when it
has one, or an export directory to the Hugging Face Hub in one commit, with a model card. The token comes
from HF_TOKEN or `hf auth login`. See docs/publish.md."""

from __future__ import annotations

import argparse
import sys

from lorakit.callable_module import forward_calls
from lorakit.cli import options, run_interruptible


def parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    p = argparse.ArgumentParser(prog="python -m lorakit.push", description=__doc__)
    p.add_argument("source", help="run directory, or an adapter, model or merged export directory")
    p.add_argument("repo_id", help="the Hub repository, OWNER/NAME; created when it does not exist")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument(
        "--revision", default=None, help="branch to commit to, created when missing (default: main)"
    )
    p.add_argument(
        "--create-pr", action="store_true", help="open a pull request with the commit instead of committing"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m lorakit.push`."""
    args = parser().parse_args(argv)
    # The commit is one request, so nothing half-made is left.
    interrupted = (
        f"no commit was made to {args.repo_id} and the local files are untouched; run the same push again "
        "(files already uploaded are not sent twice)"
    )
    return run_interruptible(_push, args, interrupted)


def _push(args: argparse.Namespace) -> int:
    from lorakit.export.publish import push

    push(args.source, args.repo_id, **options(args, "private", "revision", "create_pr"))
    return 0


forward_calls(__name__, "lorakit.export.publish:push")

if __name__ == "__main__":
    sys.exit(main())
