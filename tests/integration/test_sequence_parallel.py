"""Sequence parallelism (distributed.sequence_parallel: 2) on 2 CPU processes against 1.

One torchrun launch of sequence_parallel_worker checks the model side on a fixed packed row for a tiny
Llama and a tiny Qwen2 (fp32, LoRA, gradient checkpointing on the split model): the same loss and the same
LoRA gradients as the whole row on one rank, and packed examples kept apart across the split.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from lorakit.engine.launch import torchrun_command
from tests.conftest import ROOT

KINDS = ("llama", "qwen2")


@pytest.fixture(scope="module")
def measured(cache_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sp") / "measured.json"
    proc = subprocess.run(
        torchrun_command(2, "tests.integration.sequence_parallel_worker", [str(cache_dir), str(out), *KINDS]),
        cwd=ROOT,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", KINDS)
def test_split_row_gives_the_whole_rows_loss_and_lora_gradients(measured, kind):
    m = measured[kind]
    assert m["target_tokens_split"] == m["target_tokens_whole"] > 0
    assert m["loss_split"] == pytest.approx(m["loss_whole"], rel=1e-6)
    assert m["grad_count"] == 28 and m["grad_norm"] > 0
    # Relative to each gradient's largest entry: fp32 sums in another order, nothing more.
    assert m["grad_rel_diff"] < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_split_row_keeps_packed_examples_apart(measured, kind):
    for changed, diff in measured[kind]["isolation"].items():
        assert diff["itself"] > 1e-2, changed  # the change is visible where it was made...
        assert diff["others"] < 1e-5, changed  # ...and nowhere else, on either rank
