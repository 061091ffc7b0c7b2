"""FSDP2's generation weights in one process (a one-process gloo group; the engine FsdpBackend.wrap makes,
with the recipe's distributed.gather_for_generation): gathered, every FSDP module stays unsharded across
the forwards of a generate call and generates what the unsharded model generates, LoRA and QLoRA (the 4-bit
base sharded, bitsandbytes' CPU branch without AVX512-BF16 forced, as test_fsdp_qlora.py does); on exit
each module reshards after forward as before (the blocks do, the root does not) and holds its shards again.
Two ranks generating different numbers of tokens without a collective, and the training step after a
gathered generation, are tests/integration/test_token_weighting.py's."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from lorakit.model import build_model
from lorakit.recipe import recipe_from_dict
from tests.conftest import tiny_recipe_dict
from tests.unit.test_quantize import qlora_dict


def _recipe(cache_dir, tmp_path, kind: str):
    """The tiny Llama on FSDP2 gathering for generation (true: the recipe's setting reaches the engine)."""
    if kind == "qlora":
        raw = qlora_dict(cache_dir, tmp_path / "run", kind="llama", r=4, alpha=8)
    else:
        raw = tiny_recipe_dict(cache_dir, tmp_path / "run", model={"name_or_path": "tiny:llama"})
    raw["distributed"].update({"strategy": "fsdp", "zero_stage": 3, "gather_for_generation": True})
    return recipe_from_dict(raw)


def _built(recipe):
    torch.manual_seed(0)
    built = build_model(recipe)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for n, p in sorted(built.model.named_parameters()):
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)  # B starts at zero
    built.model.eval()
    return built


def _groups(model):
    from torch.distributed.fsdp import FSDPModule

    return [
        g
        for m in model.modules()
        if isinstance(m, FSDPModule)
        for g in m._get_fsdp_state()._fsdp_param_groups
    ]


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_gathered_generation_keeps_the_model_unsharded_then_restores_fsdps_behaviour(
    cache_dir, tmp_path, monkeypatch, kind
):
    from torch.distributed.fsdp import FSDPModule

    from lorakit.backends.fsdp import FsdpBackend
    from lorakit.backends.fsdp_shard import DTYPES, _reshard_after_forward, gathered_bytes
    from lorakit.engine.launch import process_group

    if kind == "qlora":
        from bitsandbytes.cextension import lib

        monkeypatch.setattr(lib, "has_avx512bf16_cpu", lambda: False)
    recipe = _recipe(cache_dir, tmp_path, kind)
    ids = torch.randint(5, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    fixed = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        want = _built(recipe).model.generate(input_ids=ids, attention_mask=mask, **fixed)
    with process_group("gloo"):
        constant = partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda _: 1.0)
        engine = FsdpBackend(recipe, "cpu").wrap(_built(recipe), {}, constant)
        model, dtype = engine.module, DTYPES[recipe.model.dtype]
        assert engine.gather_for_generation is True
        # What gathering adds: the whole model in model.dtype (LoRA's fp32 masters gathered in bf16 for QLoRA).
        numel = sum(p.numel() for p in model.parameters())
        assert gathered_bytes(model, dtype) == numel * dtype.itemsize
        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        before = [_reshard_after_forward(m) for m in modules]
        # fully_shard's default: the blocks reshard after forward, the root (lazily initialised) does not.
        assert [infos[0] is None for _, infos in before] == [m is model for m in modules]
        assert len(modules) == 3  # the tiny Llama's 2 blocks and the root
        with engine.generation_weights() as whole:
            assert whole and all(g.is_unsharded for g in _groups(model))
            got = engine.generate(ids, mask, **fixed)
            # The forwards left every module unsharded: a later forward needs no all-gather.
            assert all(g.is_unsharded and g.post_forward_mesh_info is None for g in _groups(model))
        assert [_reshard_after_forward(m) for m in modules] == before
        assert all(g.is_sharded for g in _groups(model))
        assert all(type(p).__name__ == "DTensor" for p in model.parameters())
        engine.gather_for_generation = False
        with engine.generation_weights() as whole:
            assert not whole and all(g.is_sharded for g in _groups(model))
            layered = engine.generate(ids, mask, **fixed)
    assert torch.equal(got, want) and torch.equal(layered, want)
