"""T5's attention off SDPA's math path (issue 61): the probe picks a fused backend that takes the position
bias, math only when none does; padded T5 through that path equals eager T5 (loss and LoRA gradients)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from lorakit.model import bias_attention
from lorakit.model.bias_attention import probe
from lorakit.model.varlen import register_varlen_sdpa


def test_probe_takes_math_only_when_nothing_else_accepts_the_bias():
    # On a CPU no fused backend takes a float mask that needs a gradient: math.
    assert probe("cpu", torch.float32, 16) == "math"
    assert probe("cpu", torch.bfloat16, 64) == "math"
    # CPU flash attention takes a float mask without a gradient (LoRA's frozen bias under no checkpointing):
    # the probe picks it, checked against math.
    assert probe("cpu", torch.float32, 16, bias_grad=False) == "flash"
    # Candidates that cannot run here (CUDA-only kernels) leave math.
    only_cuda = (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
    assert probe("cpu", torch.float32, 16, bias_grad=False, candidates=only_cuda) == "math"


def tiny_t5(attention: str, dtype: torch.dtype):
    from peft import LoraConfig, get_peft_model
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, attn_implementation=attention,
    )  # fmt: skip
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(cfg).to(dtype)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q", "k", "v", "o"], init_lora_weights=False)
    torch.manual_seed(1)
    return get_peft_model(model, lora)


def loss_and_grads(attention: str, dtype: torch.dtype):
    model = tiny_t5(attention, dtype)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 64, (3, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # padded rows, as length-grouped batches have
    mask[2, 4:] = 0
    labels = torch.randint(1, 64, (3, 6), generator=gen)
    labels[2, 3:] = -100
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
    return loss.float().item(), grads


def test_padded_t5_through_the_probed_path_equals_eager():
    name = register_varlen_sdpa()

    def calls() -> int:  # of this model's shape (other tests of the process may have used others)
        mine = [
            c
            for c in bias_attention.chosen()
            if (c["device"], c["dtype"], c["head_dim"]) == ("cpu", "float32", 8)
        ]
        return sum(mine[0]["calls"].values()) if mine else 0

    before = calls()
    loss, grads = loss_and_grads(name, torch.float32)
    # Every attention call with a bias took bias_sdpa: 2 encoder, 2 decoder self-attention, 2 cross.
    assert calls() - before >= 6
    ref_loss, ref_grads = loss_and_grads("eager", torch.float32)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 4 * (2 + 2 * 2)
    for n, g in grads.items():
        assert torch.allclose(g, ref_grads[n], atol=1e-5, rtol=1e-4), n


def test_padded_t5_in_bf16_is_as_close_to_fp32_as_eager_bf16():
    name = register_varlen_sdpa()
    _, exact = loss_and_grads("eager", torch.float32)
    loss, grads = loss_and_grads(name, torch.bfloat16)
    eager_loss, eager = loss_and_grads("eager", torch.bfloat16)
    assert loss == pytest.approx(eager_loss, abs=2e-2)

    def error(g):
        return sum((g[n] - exact[n]).norm().item() for n in exact) / sum(
            x.norm().item() for x in exact.values()
        )

    # bf16 rounding of a whole model moves LoRA gradients by a few percent: ours by no more than eager's.
    assert error(grads) <= 1.5 * error(eager) + 0.01, (error(grads), error(eager))


def test_calls_are_counted_by_backend_and_the_ab_switch_forces_math(monkeypatch):
    q, k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    bias = torch.randn(1, 2, 5, 9)  # frozen (LoRA): CPU flash takes it

    def calls():
        return next(c["calls"] for c in bias_attention.chosen() if c["head_dim"] == 16)

    out = bias_attention.bias_sdpa(q, k, v, bias, scale=1.0)
    ref = torch.softmax(q @ k.transpose(-1, -2) + bias, -1) @ v
    assert torch.allclose(out, ref, atol=1e-5)
    flash = calls().get("flash", 0)
    assert flash >= 1
    monkeypatch.setenv(bias_attention.FORCE_MATH, "math")
    math = calls().get("math", 0)
    assert torch.allclose(bias_attention.bias_sdpa(q, k, v, bias, scale=1.0), ref, atol=1e-5)
    assert calls()["math"] == math + 1 and calls()["flash"] == flash


def test_the_probe_runs_inside_no_grad_and_inference_mode():
    # An evaluation or DPO's reference pass may be the first biased call of a run.
    with torch.no_grad():
        assert probe("cpu", torch.float32, 24) == "math"
    with torch.inference_mode():
        assert probe("cpu", torch.float32, 40, bias_grad=False) == "flash"
