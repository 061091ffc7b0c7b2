"""Token-weighted loss: micro-batches and ranks with different token counts must not change the step."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lorakit.engine.launch import torchrun_command
from lorakit.engine.loss import micro_batch_loss, token_loss_sum

WORKER = Path(__file__).with_name("token_weighting_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def test_micro_batch_scaling_matches_one_batch_gradient():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 11)
    x = torch.randn(7, 5, 6)
    labels = torch.randint(0, 11, (7, 5))
    labels[:2, 1:] = -100  # the first micro-batch has far fewer target tokens
    total = float((labels != -100).sum())

    lin.zero_grad()
    token_loss_sum(lin(x), labels).div(total).backward()
    want = lin.weight.grad.clone()

    lin.zero_grad()
    for sl in (slice(0, 2), slice(2, 7)):
        micro_batch_loss(token_loss_sum(lin(x[sl]), labels[sl]), total, world_size=1).backward()
    torch.testing.assert_close(lin.weight.grad, want)

    # The mean of per-micro-batch means (what a naive loop does) is a different gradient.
    lin.zero_grad()
    for sl in (slice(0, 2), slice(2, 7)):
        n = float((labels[sl] != -100).sum())
        (token_loss_sum(lin(x[sl]), labels[sl]) / n / 2).backward()
    assert not torch.allclose(lin.weight.grad, want, atol=1e-4)


def _run(cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.slow
def test_deepspeed_step_is_the_same_for_one_batch_accumulation_and_two_ranks(cache_dir, tmp_path):
    for mode in ("one_batch", "accumulate"):
        _run([sys.executable, str(WORKER), str(cache_dir), str(tmp_path), mode], ROOT)
    cmd = torchrun_command(
        2, "tests.integration.token_weighting_worker", [str(cache_dir), str(tmp_path), "two_ranks"]
    )
    _run(cmd, ROOT)

    stats = {
        m: json.loads((tmp_path / f"{m}.json").read_text()) for m in ("one_batch", "accumulate", "two_ranks")
    }
    weights = {m: torch.load(tmp_path / f"{m}.pt") for m in stats}
    ref = stats["one_batch"]
    assert ref["loss"] > 0
    for mode in ("accumulate", "two_ranks"):
        assert stats[mode]["target_tokens"] == ref["target_tokens"]
        assert stats[mode]["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert stats[mode]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        for name, w in weights["one_batch"].items():
            torch.testing.assert_close(weights[mode][name], w, rtol=1e-4, atol=1e-7, msg=f"{mode}: {name}")
