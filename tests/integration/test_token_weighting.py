"""Token-weighted loss: micro-batches, ranks with different token counts and the sharding backend (DeepSpeed
ZeRO-3, FSDP2 full and hybrid) must not change the step."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from lorakit.engine.launch import torchrun_command
from lorakit.model.loss import micro_batch_loss, token_loss_sum
from tests.integration import token_weighting_worker

ROOT = Path(__file__).resolve().parents[2]
MODES = ("fsdp", "fsdp-window4", "fsdp-each4")


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
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _check_same_step(out: Path, name: str, ref: str) -> None:
    stats = {n: json.loads((out / f"{n}.json").read_text()) for n in (name, ref)}
    weights = {n: torch.load(out / f"{n}.pt") for n in (name, ref)}
    assert stats[ref]["loss"] > 0
    assert stats[name]["target_tokens"] == stats[ref]["target_tokens"]
    assert stats[name]["loss"] == pytest.approx(stats[ref]["loss"], rel=1e-5), name
    assert stats[name]["grad_norm"] == pytest.approx(stats[ref]["grad_norm"], rel=1e-4), name
    assert weights[name].keys() == weights[ref].keys()
    for key, w in weights[ref].items():
        # Whole tensors from every rank (a rank's shard has half the rows), updated by -gradient.
        assert weights[name][key].shape == w.shape, f"{name}: {key}"
        torch.testing.assert_close(weights[name][key], w, rtol=1e-4, atol=1e-7, msg=f"{name}: {key}")


@pytest.mark.slow
def test_one_step_is_the_same_for_one_batch_accumulation_zero3_fsdp_and_hybrid(cache_dir, tmp_path):
    """For the tiny T5 and the tiny Llama with LoRA (fp32, SGD at lr 1: the update is the gradient): one
    batch on one process, two accumulated micro-batches, DeepSpeed ZeRO-3 and FSDP2 full sharding on two
    processes, and FSDP2 hybrid sharding on four (2 x 2 mesh) give the same loss, gradient norm and LoRA
    update, the ranks holding different numbers of target tokens; FSDP2 accumulating 4 micro-batches
    reduces its gradients once per step (counted) and steps as when it reduced after each."""
    # The one-process runs in this process (a private one-process group), saving an interpreter start.
    token_weighting_worker.main(str(cache_dir), str(tmp_path), "single")
    for mode, procs in (("two_ranks", 2), ("hybrid", 4)):
        cmd = torchrun_command(
            procs, "tests.integration.token_weighting_worker", [str(cache_dir), str(tmp_path), mode]
        )
        _run(cmd, ROOT)
    for kind in ("t5", "llama"):
        ref = f"{kind}-one_batch"
        for mode in ("accumulate", "two_ranks", "fsdp", "hybrid"):
            _check_same_step(tmp_path, f"{kind}-{mode}", ref)
        # FSDP2 against ZeRO-3 directly, not only through the one-process reference.
        _check_same_step(tmp_path, f"{kind}-fsdp", f"{kind}-two_ranks")
        # Gradient accumulation on FSDP2: 4 micro-batches reduced once at the boundary give the step that
        # reducing after each micro-batch gives, with a quarter of the reduce-scatters: one per sharded
        # group per step, as many as a step of one micro-batch.
        _check_same_step(tmp_path, f"{kind}-fsdp-window4", f"{kind}-fsdp-each4")
        counts = {
            m: json.loads((tmp_path / f"{kind}-{m}.json").read_text())["reduce_scatters"] for m in MODES
        }
        assert counts["fsdp-each4"] == 4 * counts["fsdp-window4"]
        assert counts["fsdp-window4"] == counts["fsdp"] > 0
