"""`lorakit.merge`, `lorakit.plan`, `lorakit.prepare` (and the other CLIs named in tests/unit/test_callable_modules.py) are
functions and CLI modules of the same name.

`import lorakit.merge` (which `python -m lorakit.merge` and some tools do) rebinds the package attribute
`lorakit.merge` from the function to the module; `forward_calls` makes such a module callable, forwarding
to the function, so `lorakit.merge(...)` works either way.
"""

from __future__ import annotations

import sys
import types
from importlib import import_module


class _CallableModule(types.ModuleType):
    """A module whose calls go to the function its `__lorakit_call__` names ("package.module:function")."""

    def __call__(self, *args, **kwargs):
        module, name = self.__lorakit_call__.split(":")
        return getattr(import_module(module), name)(*args, **kwargs)


def forward_calls(module_name: str, target: str) -> None:
    """Make the module `module_name` callable: calling it calls `target` ("package.module:function"),
    imported on first call."""
    module = sys.modules[module_name]
    module.__lorakit_call__ = target
    module.__class__ = _CallableModule
