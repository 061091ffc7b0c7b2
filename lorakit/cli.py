"""What every lorakit command shares: recipe arguments, quiet logs, and exit code 2 for bad input (with a
pointer to the documentation that explains the fix, where there is one)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable


def recipe_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser taking RECIPE and dotted KEY=VALUE overrides."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("recipe", help="path to a recipe YAML file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=2e-4 data.max_samples=100")
    return p


def size_option(value: str | None, flag: str) -> int | None:
    """A size given on the command line ("40GB", "80GiB") in bytes, or None. A number without a unit is
    refused: read as bytes, `--gpu-memory 24` would plan for a GPU of 24 bytes."""
    if value is None:
        return None
    from lorakit.errors import LorakitError
    from lorakit.units import parse_bytes

    number = value.strip()
    if number.replace(".", "", 1).isdigit():
        raise LorakitError(f"{flag}: {value!r} has no unit: give one, e.g. {number}GB (10^9 bytes) or "
                           f"{number}GiB (2^30 bytes)")  # fmt: skip
    return parse_bytes(value, flag)


# LORAKIT_VERBOSE=1 keeps every library's own console output (what quiet_libraries would hide).
VERBOSE_ENV = "LORAKIT_VERBOSE"

# Messages other libraries print on every run that say nothing the user can act on, with who prints them.
_NOISE = {
    # DeepSpeed guesses the accelerator at import and warns on machines without a GPU (CPU training is a
    # choice here: the recipe's backend and lorakit's own lines say where the run goes).
    "DeepSpeed": ("Setting accelerator to CPU",),
    # bitsandbytes (imported by `import peft` whenever it is installed, LoRA runs included) on AVX512-BF16
    # CPUs looks for an optional inference kernel; lorakit keeps the standard 4-bit layout, which never uses
    # it (lorakit.model.quantize.keep_standard_4bit_layout).
    "bitsandbytes.backends.cpu.ops": ("kernels-community",),
}


def verbose() -> bool:
    """Whether LORAKIT_VERBOSE asks for every library's own output."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def quiet_libraries() -> None:
    """Keep other libraries' chatter out of the user's terminal: DeepSpeed's and datasets' INFO lines,
    weight-loading progress bars, and the known messages in _NOISE. Their warnings about real problems and
    every error still show. Called by each CLI before it imports them; LORAKIT_VERBOSE=1 turns it off."""
    if verbose():
        return
    for name in ("DeepSpeed", "deepspeed", "datasets", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from lorakit.engine.agent import drop_messages

    drop_messages(_NOISE)
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass
    from transformers.utils import logging as hf_logging

    # "Loading weights" / "Writing model shards" bars, one per process: lorakit prints what it loaded.
    hf_logging.disable_progress_bar()


def run_cli(body: Callable[..., int | None], *args) -> int:
    """Run a command body (with `args`, e.g. the parsed command line), turning lorakit's input errors into
    a message (followed by `see` and the documentation page, when the error names one) and the error's exit
    code (2 for bad input). Any other error is a crash: its traceback is printed as Python would (exit code
    1), but redacted (disclosure.format_exception), since another library's message can carry a token or
    a URL's password."""
    from lorakit.disclosure import format_exception
    from lorakit.errors import LorakitError

    try:
        return body(*args) or 0
    except LorakitError as e:
        # One write, newline included: several ranks print the same error, and print's separate write of the
        # newline let another rank's line start after "see docs/...#method" on the same line.
        sys.stderr.write(error_message(e) + "\n")
        sys.stderr.flush()
        return e.exit_code
    except Exception as e:
        print(format_exception(e), file=sys.stderr, end="", flush=True)
        return 1


# The dtypes a command can load or export weights in (--dtype of merge and generate).
DTYPES = ("bfloat16", "float16", "float32")


def add_dtype_option(p: argparse.ArgumentParser, help: str) -> None:
    """--dtype: one of DTYPES, default None (the command's own default, which `help` says)."""
    p.add_argument("--dtype", choices=DTYPES, default=None, help=help)


def run_interruptible(body: Callable[..., int | None], args, interrupted: str) -> int:
    """run_cli for a command that undoes its partial work when interrupted (merge, push): a kill (SIGTERM)
    unwinds like Ctrl-C, and either prints `interrupted` (what was left as it was) and exits 130."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return run_cli(body, args)
    except KeyboardInterrupt:
        print(f"interrupted: {interrupted}", file=sys.stderr)
        return 130


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def add_trust_options(p: argparse.ArgumentParser) -> None:
    """--trust-remote-code, --allow-pickle and --allow-code MODULE: only the person running the command
    grants them (a run directory's recipe.yaml, a model card or a downloaded snapshot never does:
    docs/faults.md#recipes-read-back-are-data)."""
    p.add_argument(
        "--trust-remote-code", action="store_true", help="run the model repository's own Python code"
    )
    p.add_argument("--allow-pickle", action="store_true", help="load pickled weights (pytorch_model.bin)")
    p.add_argument(
        "--allow-code",
        action="append",
        default=[],
        metavar="MODULE",
        help="let the run's recipe import MODULE (or a module inside that package), named by its "
        "train.objective_module or data.transform; repeatable. A recipe read back imports nothing else",
    )


def grants(args) -> dict:
    """What add_trust_options' flags grant, as keyword arguments (trust_remote_code, allow_pickle,
    allow_code)."""
    return options(args, "trust_remote_code", "allow_pickle", "allow_code")


def options(args, *names: str, **renamed: str) -> dict:
    """Keyword arguments from parsed command-line `args`: each of `names` as itself, and each keyword of
    `renamed` from the attribute it names (verify="verify_logits")."""
    return {name: getattr(args, name) for name in names} | {k: getattr(args, a) for k, a in renamed.items()}


def error_message(error: Exception) -> str:
    """What the CLI prints for a lorakit error: `error: MESSAGE`, then `see DOC` when it has a doc link. A
    credential in the message (a URL's password, a token) is redacted."""
    from lorakit.disclosure import redact

    text = redact(f"error: {error}")
    link = error.doc_link() if hasattr(error, "doc_link") else None
    return f"{text}\nsee {link}" if link else text
