"""ZeRO-0 in bf16 on two processes (lorakit/backends/deepspeed_bf16.py): each rank trains on its own
micro-batches, DeepSpeed all-reduces the gradients in bf16 and MixedPrecisionAdamW steps on them with the
same few host syncs as on one process; the losses are ZeRO-2's on the same ranks and batches, and both
ranks end with the same weights. One torchrun launch of this module (its `main`)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from lorakit.engine.launch import torchrun_command
from tests.conftest import ROOT

STEPS = 3


def test_two_processes_train_zero2s_losses_with_a_constant_number_of_syncs(cache_dir, tmp_path):
    from lorakit.testing import resolve_model_source

    resolve_model_source("tiny:t5", str(cache_dir))  # built here once, read by both ranks
    out = tmp_path / "result.json"
    proc = subprocess.run(
        torchrun_command(2, "tests.integration.test_zero0_bf16_two_processes", [str(cache_dir), str(out)]),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads(out.read_text())
    for rank in ("0", "1"):
        got, want = result[rank]["0"], result[rank]["2"]
        assert got["optimizer"] == "MixedPrecisionAdamW" and got["syncs_per_step"] <= 3, got
        assert got["losses"][0] == want["losses"][0] and got["losses"][-1] < got["losses"][0]
        # ZeRO-2 reduce-scatters its flat buffer where stage 0 all-reduces each bucket: the same up to rounding.
        assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(got["losses"], want["losses"], strict=True))
    assert result["0"]["0"]["weights"] == result["1"]["0"]["weights"]
    assert result["0"]["0"]["losses"] != result["1"]["0"]["losses"]  # the ranks saw different batches


def main(cache_dir: str, out: str) -> None:
    import torch.distributed as dist

    from lorakit.engine.launch import process_group
    from tests.unit import test_zero0_bf16 as z

    with process_group():
        rank = dist.get_rank()
        mine = {}
        for stage in (0, 2):
            engine = z._engine(z._recipe(Path(cache_dir), Path(out).parent / f"rank{rank}", stage=stage))
            counter = z.Syncs()
            losses = z._train(engine, range(STEPS), counter, rank=rank)
            state = engine.trainable_state()
            digest = hashlib.sha256(b"".join(state[n].float().numpy().tobytes() for n in sorted(state)))
            mine[stage] = {
                "optimizer": type(engine.engine.optimizer).__name__,
                "losses": losses,
                "syncs_per_step": len(counter.ops) / STEPS,
                "weights": digest.hexdigest(),
            }
            engine.close()
        gathered = [None, None]
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            Path(out).write_text(json.dumps({str(r): g for r, g in enumerate(gathered)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
