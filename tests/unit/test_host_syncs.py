"""No host syncs where the GPU should run ahead: operations that make the host wait for the device (reading a
tensor's value: `.item()`, `float(t)`; data-dependent shapes: nonzero, boolean indexing) are counted on the
CPU through a TorchDispatchMode, which sees every aten operation whatever the device."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lorakit.backends import StepResult
from lorakit.data.collate import IGNORE_INDEX
from lorakit.engine.loop import train_window
from lorakit.meter import TokenMeter
from lorakit.model.loss import token_loss_sum

# aten operations that wait for the device on CUDA.
SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "index_put_", "index_put"}


class Syncs(TorchDispatchMode):
    """Records the syncing aten operations run inside the block (index_put only with a boolean index)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in SYNCING:
            bool_index = name.startswith("index_put") and any(
                i is not None and i.dtype == torch.bool for i in args[1]
            )
            if not name.startswith("index_put") or bool_index:
                self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_chunked_cross_entropy_backward_does_not_sync():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen, requires_grad=True)
    labels = torch.randint(0, 50, (64,), generator=gen)
    labels[::3] = IGNORE_INDEX
    loss = token_loss_sum(logits, labels, chunk_elements=50 * 16)  # 4 chunks
    with Syncs() as syncs:
        loss.backward()
    assert syncs.ops == []
    # Still the gradient of the summed cross-entropy.
    ref = logits.detach().clone().requires_grad_()
    torch.nn.functional.cross_entropy(ref, labels, ignore_index=IGNORE_INDEX, reduction="sum").backward()
    assert torch.allclose(logits.grad, ref.grad, atol=1e-6)


class _Engine:
    """The Engine verbs train_window uses (lorakit.backends), on a linear model."""

    device = torch.device("cpu")

    def __init__(self):
        self.model = torch.nn.Linear(4, 7)

    def backward(self, loss, *, boundary):
        loss.backward()

    def step(self):
        return StepResult(grad_norm=1.0, applied=True, lr=1e-3)


class _Inputs:
    def logits(self, engine, batch, device):
        return engine.model(batch["x"])


def _batch(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 7, (1, 5), generator=gen)
    return {
        "x": torch.randn(1, 5, 4, generator=gen),
        "labels": labels,
        "num_target_tokens": 5,
        "num_real_tokens": 5,
        "num_token_slots": 5,
        "num_examples": 1,
        "input_ids": labels,
    }


def test_a_window_syncs_once_not_once_per_micro_batch():
    """The loss of each micro-batch stays on the device; the window reads it once, with its token counts."""
    window = [_batch(i) for i in range(4)]
    engine = _Engine()
    with Syncs() as syncs:
        stats = train_window(engine, _Inputs(), window, TokenMeter())
    assert syncs.ops.count("_local_scalar_dense") == 1, syncs.ops
    expected = sum(float(token_loss_sum(engine.model(b["x"]), b["labels"])) for b in window) / sum(
        b["num_target_tokens"] for b in window
    )
    assert abs(stats["loss"] - expected) < 1e-5


def test_a_stop_request_rides_on_the_windows_all_reduce():
    """Asking whether any rank was told to stop costs no collective of its own: the flag read as the window
    ends is summed with the window's counts (one all_reduce, one host read)."""
    window = [_batch(i) for i in range(2)]
    asked = []

    def stop_here():
        asked.append(True)
        return len(asked) > 1  # the second window's rank was signalled

    with Syncs() as syncs:
        first = train_window(_Engine(), _Inputs(), window, TokenMeter(), stop_here=stop_here)
        second = train_window(_Engine(), _Inputs(), window, TokenMeter(), stop_here=stop_here)
    assert (first["stop_requested"], second["stop_requested"]) == (False, True)
    assert syncs.ops.count("_local_scalar_dense") == 2, syncs.ops
    assert train_window(_Engine(), _Inputs(), window, TokenMeter())["stop_requested"] is False
