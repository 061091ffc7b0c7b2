"""Every public function that shares its name with a CLI module stays callable after the module is imported
(`import lorakit.prepare` rebinds the package attribute from the function to the module)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

SHARED = ("compare", "evaluate", "generate", "merge", "plan", "prepare", "push")


@pytest.mark.slow
@pytest.mark.parametrize("name", SHARED)
def test_the_function_is_callable_after_its_cli_module_is_imported(name):
    # A fresh interpreter: in this one another test may already have imported the module.
    code = (
        "import lorakit, importlib\n"
        f"importlib.import_module('lorakit.{name}')\n"
        f"f = getattr(lorakit, {name!r})\n"
        "assert callable(f), type(f)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_calling_the_prepare_module_prepares(tmp_path):
    import lorakit
    from tests.conftest import tiny_recipe

    importlib.import_module("lorakit.prepare")
    data = lorakit.prepare(tiny_recipe(tmp_path / "cache", tmp_path / "run"))
    assert len(data.train) > 0
