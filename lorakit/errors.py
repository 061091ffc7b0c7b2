"""Errors that mean "the user's input is wrong": the CLIs turn them into a message and exit code 2."""


class LorakitError(Exception):
    """Base class for errors caused by user input (recipe, data, paths)."""

    exit_code = 2


class RecipeError(LorakitError):
    """The recipe is malformed: unknown key, wrong type, impossible combination."""


class DataError(LorakitError):
    """The data does not fit the recipe: missing column, empty split, unreadable file."""
