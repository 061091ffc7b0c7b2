"""Every recipe starts with a comment that says how to run it and on what: its first line is the command, and
the comment names the hardware (N x GPU for N processes, or a CPU for the tiny smoke recipes)."""

from __future__ import annotations

import re

import pytest

from lorakit.recipe import load_recipe
from tests.conftest import RECIPES

RECIPE_FILES = sorted(RECIPES.glob("*.yaml"))
# "8 x A100 40GB", "4 x 24GB GPUs", "8 x A100/H100 80GB": a count, then a GPU name or memory size.
GPUS = re.compile(r"\b(\d+) x (?:[A-Z][\w/-]*\d|\d+ ?GB)")
CPU = re.compile(r"\bCPU\b")


def header(path) -> str:
    lines = path.read_text(encoding="utf-8").splitlines()
    comment = []
    for line in lines:
        if not line.startswith("#"):
            break
        comment.append(line.lstrip("# "))
    return "\n".join(comment)


def test_there_are_recipes():
    assert len(RECIPE_FILES) >= 8


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.name)
def test_recipe_header_has_the_command_and_the_hardware(path):
    text = header(path)
    assert text.splitlines()[0] == f"python -m lorakit.run recipes/{path.name}", (
        f"{path.name}: the first line must be the command that runs it"
    )
    recipe = load_recipe(path)
    gpus = GPUS.search(text)
    if recipe.model.name_or_path.startswith("tiny:"):
        assert CPU.search(text), f"{path.name}: a tiny-model recipe says it runs on a CPU"
    else:
        assert gpus, f"{path.name}: the header names no hardware such as '8 x A100 40GB'"
    if gpus:
        # The GPUs the header promises are the processes the recipe starts (one per GPU).
        assert int(gpus[1]) == recipe.distributed.num_processes, (
            f"{path.name}: header says {gpus[0]}, recipe starts {recipe.distributed.num_processes} processes"
        )


def test_the_pattern_reads_hardware():
    assert GPUS.search("one node of 8 x A100 40GB: bf16")[1] == "8"
    assert GPUS.search("on one node of 4 x 24GB GPUs (A10G)")[1] == "4"
    assert GPUS.search("8 x A100/H100 80GB")[1] == "8"
    assert not GPUS.search("4 x 4 = 64 examples per step")
