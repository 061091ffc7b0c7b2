"""QLoRA under FSDP2 in one process (a one-process gloo group): the 4-bit base sharded by fully_shard
computes exactly what the unsharded 4-bit model computes (DoRA here), before and after an evaluation, on
bitsandbytes' CPU branch without AVX512-BF16 (forced); the 2-process runs of tests/integration/test_fsdp.py
(LoRA: sharded bytes per rank, ZeRO-3 equality, merge, resume, evaluations between steps) force the
AVX512-BF16 branch."""

from __future__ import annotations

import torch

from lorakit.model import build_model
from lorakit.recipe import recipe_from_dict
from tests.unit.test_quantize import qlora_dict


def _loss_and_grads(model, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    from lorakit.backends.fsdp_shard import full_tensor

    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {
        n.replace("_fsdp_wrapped_module.", ""): full_tensor(p.grad).float()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return loss.item(), grads


def test_sharded_4bit_dora_base_trains_as_the_unsharded_one(cache_dir, tmp_path, monkeypatch):
    from bitsandbytes.cextension import lib

    from lorakit.backends.fsdp_shard import device_mesh, shard_model
    from lorakit.engine.launch import process_group
    from lorakit.model.quantize import quantization_summary

    monkeypatch.setattr(lib, "has_avx512bf16_cpu", lambda: False)
    # DoRA: its magnitude reads the (gathered) 4-bit weight outside bitsandbytes' forward.
    recipe = recipe_from_dict(
        qlora_dict(cache_dir, tmp_path / "run", kind="llama", r=4, alpha=8, use_dora=True)
    )
    ids = torch.randint(5, 1000, (2, 12), generator=torch.Generator().manual_seed(0))

    def built():
        model = build_model(recipe).model
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for n, p in sorted(model.named_parameters()):
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)  # B starts at zero
        return model

    plain = built()
    want_loss, want = _loss_and_grads(plain, ids)
    want_summary = quantization_summary(plain, recipe)
    with process_group("gloo"):
        model = shard_model(built(), device_mesh("full", None, "cpu"), dtype="bfloat16", cpu_offload=False)
        weight = model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj.base_layer").weight
        # Sharded as packed bytes viewed in model.dtype: 64 x 64 weights -> 2048 bytes -> 1024 bf16.
        assert type(weight).__name__ == "DTensor" and weight.dtype == torch.bfloat16
        assert tuple(weight.shape) == (64 * 64 // 4, 1)
        assert quantization_summary(model, recipe) == want_summary
        loss, grads = _loss_and_grads(model, ids)
        model.eval()
        with torch.no_grad():  # an evaluation: where the AVX512-BF16 branch would switch layouts
            model(input_ids=ids)
        again, grads_again = _loss_and_grads(model, ids)
    assert loss == want_loss == again
    assert grads.keys() == want.keys() == grads_again.keys() and len(want) == 42  # A, B, magnitude x 14
    assert all(torch.equal(grads[n], want[n]) and torch.equal(grads_again[n], want[n]) for n in want)
