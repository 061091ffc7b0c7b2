"""Packages whose public names are imported on first use, so that importing the package (or a light module
of it) does not load the heavy libraries its other modules need."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module


def lazy_names(
    package: str, modules: dict[str, tuple[str, ...]]
) -> tuple[list[str], Callable[[str], object]]:
    """(__all__, __getattr__) for `package`, whose names are those of `modules` ({module: names}), each
    imported from its module when first asked for."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str):
        if name in where:
            return getattr(import_module(where[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return sorted(where), __getattr__
