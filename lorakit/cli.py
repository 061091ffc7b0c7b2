"""What every lorakit command shares: recipe arguments, quiet logs, and exit code 2 for bad input (with a
pointer to the documentation that explains the fix, where there is one)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable


def recipe_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser taking RECIPE and dotted KEY=VALUE overrides."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("recipe", help="path to a recipe YAML file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=2e-4 data.max_samples=100")
    return p


def quiet_libraries() -> None:
    """Keep DeepSpeed's and datasets' INFO chatter out of the user's terminal."""
    for name in ("DeepSpeed", "deepspeed", "datasets", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass


def run_cli(body: Callable[[], int | None]) -> int:
    """Run a command body, turning lorakit's input errors into a message (followed by `see` and the
    documentation page, when the error names one) and the error's exit code (2 for bad input)."""
    from lorakit.errors import LorakitError

    try:
        return body() or 0
    except LorakitError as e:
        print(error_message(e), file=sys.stderr)
        return e.exit_code


def error_message(error: Exception) -> str:
    """What the CLI prints for a lorakit error: `error: MESSAGE`, then `see DOC` when it has a doc link."""
    text = f"error: {error}"
    link = error.doc_link() if hasattr(error, "doc_link") else None
    return f"{text}\nsee {link}" if link else text
