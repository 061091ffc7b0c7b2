"""Errors that mean "the user's input is wrong": the CLIs turn them into a message and exit code 2.

An error may name the documentation page that explains the fix:
`AdapterError("...", doc="docs/merge.md#what-is-checked")`. The CLI prints it after the message as
`see docs/merge.md#what-is-checked`; a test checks that every page and anchor the code names exists.

Exit codes of the commands (docs/resume.md#exit-codes): 0 done; 2 bad input, a run directory that cannot
take the run or is locked by another run (every LorakitError unless it says otherwise); 3 a merge whose
check failed (VerificationError); 4 a non-finite loss (TrainingDiverged); 74 no space left while writing
(DiskFullError); 69 a push to the Hugging Face Hub that did not happen (PublishError); 75 preempted, relaunch
to resume (Preempted); anything else is a crash.
"""

from __future__ import annotations

import re


class LorakitError(Exception):
    """Base class for errors caused by user input (recipe, data, paths).

    `doc`: the page (and anchor) of the documentation that explains the fix, relative to the repository,
    e.g. "docs/merge.md#what-is-checked"; None when there is none. A subclass whose every instance has the
    same page can set it as a class attribute."""

    exit_code = 2
    doc: str | None = None

    def __init__(self, *args: object, doc: str | None = None):
        super().__init__(*args)
        if doc is not None:
            self.doc = doc

    def __reduce__(self):
        # Keep `doc` when the error crosses a process boundary (pickling drops keyword arguments).
        return _rebuild, (type(self), self.args, self.doc)

    def doc_link(self) -> str | None:
        """Where the documentation explains this error, or None."""
        return self.doc


def _rebuild(cls: type[LorakitError], args: tuple, doc: str | None) -> LorakitError:
    return cls(*args, doc=doc)


RECIPE_REFERENCE = "docs/recipes.md"
# The recipe's declared top-level sections, in schema order: this module sits below lorakit.recipe, which
# imports it, so it names them here; tests/docs/test_error_docs.py checks they are the schema's.
RECIPE_SECTIONS = (
    "model", "method", "data", "train", "distributed", "eval", "checkpoint", "output", "preflight",
)  # fmt: skip
# The sections registered objectives add (lorakit.recipe.known_objectives keeps this list with its registry).
_OBJECTIVE_SECTIONS: list[str] = []


def add_recipe_section(name: str) -> None:
    """Make `name.key` in a RecipeError's message link the reference's section `name` (an objective's)."""
    if name not in _OBJECTIVE_SECTIONS:
        _OBJECTIVE_SECTIONS.append(name)


def remove_recipe_section(name: str) -> None:
    """Forget a section add_recipe_section added."""
    if name in _OBJECTIVE_SECTIONS:
        _OBJECTIVE_SECTIONS.remove(name)


def recipe_sections() -> tuple[str, ...]:
    """Every top-level section of the recipe: the declared ones, then those of registered objectives."""
    return (*RECIPE_SECTIONS, *_OBJECTIVE_SECTIONS)


def recipe_section_link(message: str) -> str | None:
    """The recipe reference's section (`docs/recipes.md#train`) of the first `section.key` field a message
    names (each section of the schema is a heading of the generated page), or None."""
    sections = "|".join(map(re.escape, recipe_sections()))
    m = re.search(rf"(?<![\w./-])({sections})\.[a-z_]+", message)
    return f"{RECIPE_REFERENCE}#{m[1]}" if m else None


class RecipeError(LorakitError):
    """The recipe is malformed: unknown key, wrong type, impossible combination.

    Without an explicit `doc`, an error that names a field (`train.lr: ...`) links the recipe reference's
    section of that field, so schema validation messages point to the documentation of their keys."""

    def doc_link(self) -> str | None:
        return self.doc if self.doc is not None else recipe_section_link(str(self))


class PlanError(LorakitError):
    """The plan cannot be made as asked: a malformed size, an unknown model, an impossible option."""

    # Where the CLI points for the fix (lorakit.errors: `see DOC` after the message).
    doc = "docs/planning.md"


class DataError(LorakitError):
    """The data does not fit the recipe: missing column, empty split, unreadable file."""


class MergeError(LorakitError):
    """A merge cannot start or finish as asked: no run or adapter at the path, an output that exists."""


class AdapterError(MergeError):
    """The adapter cannot be merged: empty, without effect (all zeros), or made for another base model."""


class InferenceError(LorakitError):
    """generate / evaluate cannot run as asked: no trained model at SOURCE, no recipe where one is needed,
    an output file that would overwrite an input."""


class VerificationError(MergeError):
    """The merged model does not reproduce the adapter model within the dtype's tolerance; nothing is saved.

    Not bad input but a failed check, so it has its own exit code."""

    exit_code = 3


class RunDirError(LorakitError):
    """output.dir or data.cache_dir cannot take the run: a file is in the way, the directory cannot be
    created or written, or its filesystem has too little free space. Found before any work is done."""

    doc = "docs/resume.md#checks-before-the-run"


class RunLockedError(LorakitError):
    """Another process holds the run directory's lock: a run into the same output.dir is in progress."""

    doc = "docs/resume.md#the-run-lock"


class DiskFullError(LorakitError):
    """No space left on the device (or the disk quota is used up) while writing a checkpoint, the adapter or
    model, summary.json or a merged export. Nothing was published under a final name and what was complete
    before is intact, so it is neither bad input (2) nor a crash: its own exit code, EX_IOERR of
    sysexits.h. Free some space and relaunch the same command to resume from the last checkpoint."""

    exit_code = 74
    doc = "docs/resume.md#a-full-disk"


class MissingExtraError(RecipeError):
    """The recipe asks for an optional backend (output.report_to: wandb, mlflow, ...) whose library is not
    installed; the message names the extra to install. Raised before any training work."""


class PublishError(LorakitError):
    """A push to the Hugging Face Hub did not happen: offline mode, no token, a refused token or repository,
    an unreachable or interrupted Hub. The local run or export is complete and untouched, so it is neither
    bad input (2) nor a crash: its own exit code, EX_UNAVAILABLE of sysexits.h. The message says what to do;
    the same push can be run again with `python -m lorakit.push`."""

    exit_code = 69
    doc = "docs/publish.md#when-a-push-fails"


class RankFailedError(LorakitError):
    """Another rank of the group failed (its own error is the root cause, printed once by it and by the
    launcher); this rank stopped at the collective where it learned so instead of waiting for it.

    Exit code 1, the same as the failing rank's crash, so every process of the run ends with one code."""

    exit_code = 1
    doc = "docs/faults.md#what-a-failed-rank-does"


class CollectiveTimeoutError(LorakitError):
    """A collective did not complete within distributed.timeout_minutes (or a peer vanished mid-way): the
    error names the phase and step it was stuck in."""

    exit_code = 1
    doc = "docs/faults.md#a-stuck-collective"


class WorkerFailedError(LorakitError):
    """A worker of a multi-process run failed: raised by the launching process with the worker's exit code
    and its one-line root cause (rank, phase, step, error) as the message."""

    doc = "docs/faults.md#what-a-failed-rank-does"

    def __init__(self, *args: object, doc: str | None = None, exit_code: int = 1):
        super().__init__(*args, doc=doc)
        self.exit_code = exit_code


class ExtensionLockError(LorakitError):
    """The torch extensions cache holds a lock that no process holds (a killed build's leftover): the
    run would wait on it forever as DeepSpeed builds its ops. The message names the file to remove."""

    doc = "docs/faults.md#a-stale-torch-extensions-lock"
