"""Errors that mean "the user's input is wrong": the CLIs turn them into a message and exit code 2."""


class LorakitError(Exception):
    """Base class for errors caused by user input (recipe, data, paths)."""

    exit_code = 2


class RecipeError(LorakitError):
    """The recipe is malformed: unknown key, wrong type, impossible combination."""


class DataError(LorakitError):
    """The data does not fit the recipe: missing column, empty split, unreadable file."""


class MergeError(LorakitError):
    """A merge cannot start or finish as asked: no run or adapter at the path, an output that exists."""


class AdapterError(MergeError):
    """The adapter cannot be merged: empty, without effect (all zeros), or made for another base model."""


class VerificationError(MergeError):
    """The merged model does not reproduce the adapter model within the dtype's tolerance; nothing is saved.

    Not bad input but a failed check, so it has its own exit code."""

    exit_code = 3
