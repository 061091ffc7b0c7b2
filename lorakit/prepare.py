"""python -m lorakit.prepare RECIPE [KEY=VALUE ...] [--show N]: tokenize and cache a recipe's data, no GPU
needed; --show N prints the first N training rows as the model sees them, the tokens in the loss marked."""

from __future__ import annotations

import argparse
import sys

from lorakit.callable_module import forward_calls
from lorakit.cli import quiet_libraries, recipe_parser, run_cli


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m lorakit.prepare`."""
    parser = recipe_parser("python -m lorakit.prepare", __doc__)
    parser.add_argument(
        "--show", type=int, default=0, metavar="N", help="print N training rows with the loss tokens marked"
    )
    return run_cli(_prepare, parser.parse_intermixed_args(argv))


def _prepare(args: argparse.Namespace) -> int:
    """Tokenize and cache the recipe's data; print what was prepared (and rows, with --show)."""
    from lorakit.preflight import prepare
    from lorakit.recipe import load_recipe

    quiet_libraries()
    recipe = load_recipe(args.recipe, args.overrides)
    data = prepare(recipe)
    print(data.describe())
    if args.show > 0:
        from lorakit.data.show import show_rows
        from lorakit.model.source import load_config, load_tokenizer

        source, config = load_config(recipe)
        encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        print(show_rows(data.train, load_tokenizer(recipe, source), args.show, encoder_decoder))
    return 0


# `import lorakit.prepare` makes the package attribute this module: calls still reach the function.
forward_calls(__name__, "lorakit.preflight:prepare")

if __name__ == "__main__":
    sys.exit(main())
