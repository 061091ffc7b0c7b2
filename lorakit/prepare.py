"""python -m lorakit.prepare RECIPE [KEY=VALUE ...]: tokenize and cache a recipe's data, no GPU needed."""

from __future__ import annotations

import argparse
import sys

from lorakit.cli import quiet_libraries, recipe_parser, run_cli


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m lorakit.prepare`."""
    return run_cli(_prepare, recipe_parser("python -m lorakit.prepare", __doc__).parse_args(argv))


def _prepare(args: argparse.Namespace) -> int:
    """Tokenize and cache the recipe's data; print what was prepared."""
    import lorakit

    quiet_libraries()
    data = lorakit.prepare(lorakit.load_recipe(args.recipe, args.overrides))
    print(data.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
