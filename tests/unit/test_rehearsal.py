"""benchmarks/rehearsal.py (and harness/memory.py) at tiny shape: the model it builds tensor by tensor loads with transformers at the
config's parameter count (T5's own head kept), at the family's init scales; phases and per-step memory are
read from samples as the run's records time them."""

import torch

from benchmarks.harness.memory import GIB, per_step, per_step_peak, phases
from benchmarks.rehearsal import SHAPES, build, init_std


def test_the_built_model_loads_with_its_own_head_at_init_scales(tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    info = build("tiny", tmp_path / "m")
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "m")
    assert model.dtype == torch.bfloat16 and info["params"] == sum(p.numel() for p in model.parameters())
    assert not torch.equal(model.lm_head.weight, model.shared.weight)  # FLAN-T5 stores its own head
    c = model.config
    wo = model.encoder.block[0].layer[1].DenseReluDense.wo.weight.float()
    assert abs(float(wo.std()) - c.d_ff**-0.5) < 0.2 * c.d_ff**-0.5
    assert init_std("t5", "encoder.final_layer_norm.weight", c) is None and SHAPES["flan-t5-xl"][0] == "t5"


def test_phases_and_steps_from_samples():
    samples = [{"t": t, "rank0": int(g * GIB), "rank1": int(g * GIB)} for t, g in
               [(0.5, 1), (1.0, 2), (2.0, 3), (3.0, 3), (4.0, 3), (5.0, 4)]]  # fmt: skip
    # Step 0: when the first step began (its record's time less its duration).
    steps = {0: 0.8, 1: 1.5, 2: 2.5, 3: 3.5}
    got = phases(samples, steps, end=5.0)
    assert [got[p]["rank0"] for p in ("load", "first_step", "steady", "save")] == [1, 2, 3, 4]
    assert got["save"]["rank1"] == 4
    assert per_step(samples, steps) == {1: {"rank0": 2, "rank1": 2}, 2: {"rank0": 3, "rank1": 3},
                                        3: {"rank0": 3, "rank1": 3}}  # fmt: skip
    # Peaks within each step, not the sample at its record: step 1's window starts when it began (0.8 s).
    samples.append({"t": 3.2, "rank0": int(5 * GIB), "rank1": int(3 * GIB)})
    samples.sort(key=lambda r: r["t"])
    assert per_step_peak(samples, steps) == {1: {"rank0": 2, "rank1": 2}, 2: {"rank0": 3, "rank1": 3},
                                             3: {"rank0": 5, "rank1": 3}}  # fmt: skip
