import math

import pytest

from lorakit.backends.deepspeed_config import build_ds_config
from lorakit.engine.schedule import lr_multiplier, warmup_steps
from lorakit.engine.steps import plan_steps
from tests.conftest import tiny_recipe


def test_linear_schedule_warms_up_then_decays():
    total, warm = 10, warmup_steps(10, 0.2)
    lrs = [lr_multiplier(s, total, warm, "linear") for s in range(total)]
    assert warm == 2
    assert 0 < lrs[0] < lrs[1] < lrs[2] == 1.0
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:], strict=False))
    assert lrs[-1] > 0


def test_cosine_and_constant():
    assert lr_multiplier(5, 10, 0, "constant") == 1.0
    assert math.isclose(lr_multiplier(5, 10, 0, "cosine"), 0.5, abs_tol=1e-9)


def test_step_plan_counts_short_last_window():
    p = plan_steps(micro_batches_per_epoch=7, accumulation=2, epochs=3, max_steps=None)
    assert (p.steps_per_epoch, p.total_steps, p.epochs) == (4, 12, 3)
    p = plan_steps(7, 2, epochs=3, max_steps=5)
    assert (p.total_steps, p.epochs) == (5, 2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ds_config_from_recipe(tmp_path, stage):
    r = tiny_recipe(
        tmp_path,
        tmp_path / "o",
        model={"dtype": "bfloat16"},
        train={"micro_batch_size": 4, "gradient_accumulation_steps": 3, "max_grad_norm": 0.5},
        distributed={"zero_stage": stage, "offload_optimizer": "cpu" if stage else "none"},
    )
    cfg = build_ds_config(r, world_size=8, accelerator="cuda", hidden_size=64)
    assert cfg["train_batch_size"] == 4 * 3 * 8
    assert cfg["gradient_accumulation_steps"] == 3 and cfg["gradient_clipping"] == 0.5
    assert cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]
    assert cfg["zero_optimization"]["stage"] == stage
    assert ("offload_optimizer" in cfg["zero_optimization"]) == bool(stage)
    assert cfg["optimizer"]["type"] == "AdamW" and cfg["optimizer"]["params"]["lr"] == r.train.lr
    # CPU offload: DeepSpeed's CPU Adam; else torch's fused AdamW (test_ds_config_on_cuda_needs_no_jit_op)
    assert ("torch_adam" in cfg["optimizer"]["params"]) == (not stage)
    if stage == 3:
        assert cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]


def test_ds_config_on_cuda_needs_no_jit_op(tmp_path):
    """On CUDA without offload the optimizer is torch's fused AdamW, not DeepSpeed's FusedAdam: that op is
    JIT-compiled at start (42 s on an H100, needs nvcc and ninja) and DeepSpeed 0.19.8's builder cannot parse
    TORCH_CUDA_ARCH_LIST=9.0a (ValueError: invalid literal for int() '0a'; the H100 lease of 2026-11-26).
    DeepSpeed must hand `fused` through to torch.optim.AdamW (checked here on its real code path)."""
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    from lorakit.doctor.ds_ops import ops_for

    r = tiny_recipe(tmp_path, tmp_path / "o", model={"dtype": "bfloat16"}, distributed={"zero_stage": 3})
    params = build_ds_config(r, world_size=8, accelerator="cuda", hidden_size=64)["optimizer"]["params"]
    assert params["torch_adam"] is True and params["fused"] is True
    assert "fused_adam" not in ops_for(r, "cuda")
    # DeepSpeed's own choice of optimizer class for these params (the torch_adam branch needs no engine state).
    rest = dict(params)
    cls, kwargs = DeepSpeedEngine.get_optimizer_configuration(object(), rest, True)
    opt = cls([torch.nn.Parameter(torch.zeros(4))], **rest, **kwargs)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True
    assert opt.defaults["lr"] == r.train.lr


def test_ds_config_on_cpu_uses_torch_adam(tmp_path):
    r = tiny_recipe(tmp_path, tmp_path / "o")
    cfg = build_ds_config(r, world_size=2, accelerator="cpu")
    assert cfg["optimizer"]["params"]["torch_adam"] is True
    assert cfg["optimizer"]["params"]["foreach"] is True  # one op for all LoRA tensors, not a loop
    assert cfg["zero_optimization"].get("overlap_comm") in (None, False)
