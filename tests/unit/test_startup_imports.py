"""Start-up cost: `import lorakit`, a CLI's argument parsing and loading a recipe import none of the heavy
libraries, and the launcher of a multi-process run (`python -m lorakit.run`, which prepares the data and then
starts torchrun) imports neither DeepSpeed nor peft nor lorakit's model and engine stacks: its workers do,
and importing them twice only delays the first step. Each check runs in a fresh interpreter, since this
test process has imported everything already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Seconds each, or more, on a 2-core machine; none is needed to read a recipe or the command line.
HEAVY = ("torch", "deepspeed", "transformers", "datasets", "peft", "matplotlib", "evaluate", "pandas")


def _loaded(code: str) -> dict:
    """Run `code` in a fresh interpreter; it ends by printing a JSON object."""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # launches an interpreter
def test_import_and_argument_parsing_load_no_heavy_library():
    code = f"""
import json, sys
import lorakit, lorakit.run, lorakit.prepare, lorakit.merge, lorakit.plan
from lorakit.cli import recipe_parser
args = recipe_parser("python -m lorakit.run", "").parse_args(["recipes/quickstart.yaml", "train.lr=1e-3"])
lorakit.load_recipe(args.recipe, args.overrides)
print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r}))))
"""
    assert _loaded(code) == []


@pytest.mark.slow  # launches an interpreter
def test_launcher_reaches_torchrun_without_deepspeed_peft_or_the_model_stack(tmp_path):
    # The launcher's own steps up to torchrun (checks, run lock, data, resume lookup), with the data step
    # and torchrun replaced: what it imports then is what every multi-process run pays before its workers.
    code = f"""
import json, sys
import lorakit.api as api

class Data:
    def describe(self):
        return "data"

def stop(cmd, env, started=None):
    print(json.dumps(sorted(sys.modules)))
    raise SystemExit(0)

api.prepare = lambda recipe: Data()
api._run_forwarding_signals = stop
from lorakit.recipe import load_recipe
api.train(load_recipe("recipes/quickstart.yaml", ["output.dir={tmp_path / "run"}", "output.report_to=[]"]))
"""
    loaded = set(_loaded(code))
    assert {"lorakit.api", "lorakit.engine.launch"} <= loaded  # it did run the launcher
    for module in ("deepspeed", "peft", "lorakit.model.build", "lorakit.engine.job", "lorakit.engine.loop"):
        assert module not in loaded, module
