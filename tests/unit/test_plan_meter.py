"""The CPU memory meters the planner is checked with: live tensor bytes and the tracked peak."""

import gc
import threading

import torch

from lorakit.meter import TensorMemoryTracker, live_tensor_bytes


def test_tracker_counts_storages_once_and_forgets_freed_ones():
    # Garbage of earlier tests is in the baseline: collected inside the block, it would count as freed here.
    gc.collect()
    with TensorMemoryTracker("cpu") as t:
        a = torch.zeros(1000)  # 4000 bytes
        view = a[10:20]  # shares a's storage
        b = a + 1  # 4000 more
        assert t.current - t.baseline == 8000
        del b
        gc.collect()
        assert t.current - t.baseline == 4000 and t.peak - t.baseline == 8000
        t.reset_peak()
        c = torch.ones(10, dtype=torch.bfloat16)
        assert t.peak - t.baseline == 4020
    del a, view, c


def test_tracker_sees_autograd_saved_tensors_and_backward_temporaries():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    gc.collect()
    with TensorMemoryTracker("cpu") as t:
        y = torch.tanh(x @ w)  # tanh keeps its output for the backward
        kept = t.current - t.baseline
        y.sum().backward()
    assert kept >= 32 * 64 * 4  # the matmul output and the tanh output are alive after the forward
    assert t.peak - t.baseline > kept  # the backward made gradients on top
    assert w.grad is not None


def test_rescan_picks_up_tensors_the_mode_did_not_see():
    made = []
    with TensorMemoryTracker("cpu") as t:
        # Dispatch modes are per thread: a tensor made on another thread passes unseen, as weights read
        # by a loader can.
        worker = threading.Thread(target=lambda: made.append(torch.ones(500, dtype=torch.float64)))
        worker.start()
        worker.join()
        before = t.current
        t.rescan()
        assert t.current - before == 4000


def test_live_tensor_bytes_survives_a_dead_weak_proxy():
    # A weakref.proxy whose referent is gone raises ReferenceError on any attribute access, isinstance()
    # included; libraries leave such proxies in containers (CI saw one after the in-process tests).
    import weakref

    class Referent:
        pass

    referent = Referent()
    holder = [weakref.proxy(referent)]
    del referent
    tensor = torch.zeros(250_000)
    assert live_tensor_bytes("cpu") >= tensor.nbytes
    assert holder


def test_live_tensor_bytes_counts_a_new_parameter():
    gc.collect()
    before = live_tensor_bytes("cpu")
    p = torch.nn.Parameter(torch.zeros(250_000))  # 1 MB
    assert live_tensor_bytes("cpu") - before >= 1_000_000
    del p


def test_live_tensor_bytes_counts_a_sharded_tensor_once(tmp_path):
    """FSDP2's parameters are DTensors: a wrapper around the local shard, which gc also sees. The wrapper
    has no memory of its own; counting it too doubled the run summary's model states under FSDP2."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        whole = torch.ones(250_000)
        before = live_tensor_bytes("cpu")
        sharded = distribute_tensor(whole, mesh, [Shard(0)])
        del whole
        gc.collect()
        assert sharded.to_local().numel() == 250_000
        # The shard holds the same 1 MB the whole tensor did (one rank: a view of it); nothing was added.
        assert abs(live_tensor_bytes("cpu") - before) < 100_000
    finally:
        dist.destroy_process_group()


def test_tracker_counts_the_shard_an_operator_returns_inside_a_dtensor(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sharded = distribute_tensor(torch.ones(250_000), init_device_mesh("cpu", (1,)), [Shard(0)])
        with TensorMemoryTracker("cpu") as t:
            doubled = sharded * 2  # a DTensor whose local shard is 1 MB of new memory
            assert t.current - t.baseline == doubled.to_local().untyped_storage().nbytes() == 1_000_000
    finally:
        dist.destroy_process_group()
