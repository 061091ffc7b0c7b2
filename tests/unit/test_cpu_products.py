"""lorakit.model.cpu_products: bf16 linear layers forming their products in fp32 on a CPU without a fast bf16
kernel. Both branches run on any CPU (LORAKIT_CPU_BF16_MATMUL forces them); the two-process runs that train
with the machine's own choice are the bf16 ones (test_quickstart.py asserts summary.json's `matmul`), and
test_quickstart_causal.py's QLoRA run on ZeRO-3 forces the other branch.

torch 2.13 on an AVX2 CPU multiplies bf16 in a scalar loop (pytorch#146508). A layer that does not take the
path, a second rounding (the product rounded to bf16 before the bias is added) or a recompute taking another
path under gradient checkpointing (a torch function mode did: "A different number of tensors was saved")
fails these tests."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaForCausalLM

from lorakit.errors import LorakitError
from lorakit.model import cpu_products
from lorakit.model.checkpointing import enable_checkpointing
from lorakit.model.cpu_products import FORCE, Fp32ProductLinear, fp32_products_wanted, use_fp32_products
from lorakit.testing import tiny_config

BF16 = torch.bfloat16


@pytest.mark.parametrize("fast_kernel", [True, False], ids=["avx512-bf16", "avx2"])
def test_auto_follows_torchs_test_for_the_fast_kernel_and_the_flag_forces_either_way(
    monkeypatch, fast_kernel
):
    monkeypatch.setattr(cpu_products, "fast_bf16_kernel", lambda: fast_kernel)
    for forced, want in (("auto", not fast_kernel), ("", not fast_kernel), ("native", False), ("fp32", True)):
        monkeypatch.setenv(FORCE, forced)
        assert fp32_products_wanted(BF16, "cpu") is want, forced
        # Only bf16 on a CPU: other dtypes have fast kernels, and a GPU has its own.
        assert not fp32_products_wanted(torch.float32, "cpu")
        assert not fp32_products_wanted(torch.float16, "cpu")
        assert not fp32_products_wanted(BF16, "cuda")
    monkeypatch.setenv(FORCE, "fast")
    with pytest.raises(LorakitError, match=f"{FORCE}='fast': expected one of auto, native, fp32") as e:
        fp32_products_wanted(BF16, "cpu")
    assert e.value.exit_code == 2


def test_lorakit_train_refuses_a_bad_setting_before_any_work(monkeypatch, tmp_path):
    """Before this check every rank loaded its model, then crashed with a traceback (exit 1)."""
    import lorakit
    from tests.conftest import tiny_recipe

    monkeypatch.setenv(FORCE, "bf16")
    with pytest.raises(LorakitError, match=f"{FORCE}='bf16'"):
        lorakit.train(tiny_recipe(tmp_path / "cache", tmp_path / "run"))
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_auto_asks_torch_itself():
    assert cpu_products.fast_bf16_kernel() is torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_the_output_and_every_gradient_are_the_fp32_product_rounded_once(monkeypatch):
    calls = []
    for step in ("forward", "backward"):
        original = getattr(cpu_products._Fp32Linear, step)
        counted = (lambda f, name: lambda *a: calls.append(name) or f(*a))(original, step)
        monkeypatch.setattr(cpu_products._Fp32Linear, step, staticmethod(counted))
    torch.manual_seed(0)
    layer = nn.Linear(96, 40).to(BF16)
    layer.__class__ = Fp32ProductLinear
    x = torch.randn(3, 7, 96, dtype=BF16, requires_grad=True)
    g = torch.randn(3, 7, 40, dtype=BF16)
    out = layer(x)
    out.backward(g)
    w, b = layer.weight.detach().float(), layer.bias.detach().float()
    assert out.dtype == BF16
    assert torch.equal(out, F.linear(x.detach().float(), w, b).to(BF16))
    assert torch.equal(x.grad, (g.float() @ w).to(BF16))
    rows_g, rows_x = g.float().reshape(-1, 40), x.detach().float().reshape(-1, 96)
    assert torch.equal(layer.weight.grad, (rows_g.t() @ rows_x).to(BF16))
    assert torch.equal(layer.bias.grad, rows_g.sum(0).to(BF16))
    assert calls == ["forward", "backward"]  # the layer's own path, not torch's bf16 kernel
    # torch's own bf16 kernel does the same arithmetic in another order: equal to bf16's resolution.
    native = nn.Linear(96, 40).to(BF16)
    native.load_state_dict(layer.state_dict())
    torch.testing.assert_close(native(x.detach()), out.detach(), rtol=1.6e-2, atol=1e-2)


def test_a_wide_layer_is_formed_in_pieces_with_the_same_result(monkeypatch):
    """An output head's fp32 weight and logits are formed a piece of output features at a time: each output
    column and weight-gradient row is the same sum; the input's gradient is summed over the pieces in fp32."""
    torch.manual_seed(0)
    layer = nn.Linear(32, 50).to(BF16)
    layer.__class__ = Fp32ProductLinear
    x = torch.randn(6, 32, dtype=BF16)
    g = torch.randn(6, 50, dtype=BF16)
    results = []
    for chunk in (cpu_products.CHUNK_ELEMENTS, 32 * 7):
        monkeypatch.setattr(cpu_products, "CHUNK_ELEMENTS", chunk)
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.backward(g)
        results.append((out, xi.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
    assert len(cpu_products._spans(50, 32)) == 8  # 7 output features a piece
    (out, gx, gw, gb), (out_p, gx_p, gw_p, gb_p) = results
    assert torch.equal(out_p, out) and torch.equal(gw_p, gw) and torch.equal(gb_p, gb)
    torch.testing.assert_close(gx_p, gx, rtol=8e-3, atol=1e-6)  # fp32 sums in another order, rounded once


def test_a_frozen_weight_gets_no_gradient_and_other_calls_run_torchs_linear():
    torch.manual_seed(0)
    layer = nn.Linear(16, 8, bias=False).to(BF16).requires_grad_(False)
    layer.__class__ = Fp32ProductLinear
    x = torch.randn(4, 16, dtype=BF16, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is None and x.grad is not None
    # A float32 input to a bf16 layer fails as nn.Linear fails; a float32 layer is nn.Linear exactly.
    with pytest.raises(RuntimeError):
        layer(torch.randn(4, 16))
    plain = nn.Linear(16, 8)
    same = copy.deepcopy(plain)
    same.__class__ = Fp32ProductLinear
    x32 = torch.randn(4, 16)
    assert torch.equal(same(x32), plain(x32))


class _OwnLinear(nn.Linear):
    """A subclass with its own kernel, as bitsandbytes' 4-bit layers are."""


def test_only_nn_linear_itself_changes_and_the_model_reads_as_before(monkeypatch):
    monkeypatch.setenv(FORCE, "fp32")
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), _OwnLinear(8, 8), nn.LayerNorm(8)).to(BF16)
    before, keys = repr(model), list(model.state_dict())
    assert use_fp32_products(model, BF16, "cpu")
    assert [type(m) for m in model] == [nn.Embedding, Fp32ProductLinear, _OwnLinear, nn.LayerNorm]
    assert isinstance(model[1], nn.Linear)  # peft and transformers still see a linear layer
    assert repr(model) == before and list(model.state_dict()) == keys
    monkeypatch.setenv(FORCE, "native")
    assert not use_fp32_products(nn.Sequential(nn.Linear(2, 2)), BF16, "cpu")


# peft reads transformers' deprecated is_gradient_checkpointing (build.py filters it the same way).
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
@pytest.mark.parametrize("checkpointing", [False, True], ids=["whole", "checkpointed"])
def test_a_lora_step_matches_torchs_bf16_kernel(checkpointing):
    """A tiny Llama with LoRA on every projection and its output head, one forward and backward: the same
    loss and gradients as torch's bf16 kernels, to bf16's resolution; under non-reentrant checkpointing the
    recompute takes the same path as the forward."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    ids = torch.randint(
        0, tiny_config("llama").vocab_size, (2, 24), generator=torch.Generator().manual_seed(1)
    )
    results = []
    for fp32 in (False, True):
        torch.manual_seed(0)
        base = LlamaForCausalLM(tiny_config("llama")).to(BF16)
        if checkpointing:
            enable_checkpointing(base)  # before peft, as build_model does
            assert base.model.layers[0].gradient_checkpointing
        config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        model = get_peft_model(base, config).train()
        if fp32:
            for m in model.modules():
                if type(m) is nn.Linear:
                    m.__class__ = Fp32ProductLinear
            assert sum(type(m) is Fp32ProductLinear for m in model.modules()) > 3 * len(targets)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
        results.append((float(loss), grads))
    (loss_n, grads_n), (loss_f, grads_f) = results
    assert loss_f == pytest.approx(loss_n, rel=2e-3)
    assert grads_f.keys() == grads_n.keys() and len(grads_n) == 2 * 2 * (len(targets) - 1) + 2
    for name, g in grads_n.items():
        cosine = F.cosine_similarity(g.flatten(), grads_f[name].flatten(), dim=0)
        assert cosine > 0.999, name


def test_build_model_changes_a_bf16_model_on_a_cpu_only(monkeypatch, tmp_path):
    from lorakit.model import build_model
    from tests.conftest import tiny_recipe

    monkeypatch.setenv(FORCE, "fp32")
    for dtype, device, want in (
        ("bfloat16", "cpu", True),
        ("float32", "cpu", False),
        ("bfloat16", "cuda", False),
    ):
        recipe = tiny_recipe(tmp_path / "cache", tmp_path / "run", model={"dtype": dtype})
        built = build_model(recipe, device_type=device)
        assert built.fp32_products is want, (dtype, device)
        changed = [type(m) is Fp32ProductLinear for m in built.model.modules() if isinstance(m, nn.Linear)]
        assert changed and all(changed) is want and any(changed) is want, (dtype, device)
