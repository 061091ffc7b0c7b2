"""The serving engines' Python packages (optional: `pip install lorakit[export]`), imported here only, lazily,
with one clear error when one is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

from lorakit.errors import MissingExtraError

_INSTALL = {
    "ctranslate2": "pip install 'lorakit[export]' (or: pip install ctranslate2)",
    "gguf": "pip install 'lorakit[export]' (or: pip install gguf)",
    "llama_cpp": "pip install llama-cpp-python (an sdist: it compiles llama.cpp, which takes a while)",
}


def engine(name: str, why: str) -> ModuleType:
    """The module `name` (ctranslate2, gguf, llama_cpp); a MissingExtraError saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise MissingExtraError(
            f"{why} needs the {name} package, which is not installed: {_INSTALL[name]}",
            doc="docs/export.md#install",
        ) from e


def available(name: str) -> bool:
    """Whether the engine package `name` imports."""
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True
