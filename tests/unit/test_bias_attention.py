"""T5's attention off SDPA's math path (issue 61): the probe picks a fused backend that takes the position
bias, math only when none does; packed T5 through that backend equals the math path (loss, LoRA gradients)."""

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


def tiny_t5(attention: str):
    from peft import LoraConfig, get_peft_model
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, attn_implementation=attention,
    )  # fmt: skip
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(cfg)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q", "k", "v", "o"], init_lora_weights=False)
    torch.manual_seed(1)
    return get_peft_model(model, lora)


def packed_loss_and_grads():
    """One packed T5 row pair (3 examples of different lengths) through lorakit's per-example loop."""
    from lorakit.model.varlen import Seq2SeqSegments, attach_t5_position_bias

    model = tiny_t5(register_varlen_sdpa())
    attach_t5_position_bias(model)
    gen = torch.Generator().manual_seed(2)
    ids, labels = torch.randint(1, 64, (1, 23), generator=gen), torch.randint(1, 64, (1, 12), generator=gen)
    segments = Seq2SeqSegments((0, 11, 18, 23), (0, 6, 9, 12))
    decoder_ids = torch.cat([torch.zeros(1, 1, dtype=torch.long), labels[:, :-1]], 1)
    out = model(input_ids=ids, decoder_input_ids=decoder_ids, lorakit_seq2seq_segments=segments)
    loss = torch.nn.functional.cross_entropy(out.logits[0], labels[0])
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads, segments.kernels


@pytest.mark.slow
def test_packed_t5_on_the_probed_backend_equals_the_math_path(monkeypatch):
    # LoRA leaves T5's bias frozen: on a CPU the probe picks flash, which takes a float mask without a
    # gradient; the A/B switch forces math, the path packed T5 took before the probe.
    def calls():
        mine = [c for c in bias_attention.chosen() if (c["dtype"], c["head_dim"]) == ("float32", 8)]
        return dict(mine[0]["calls"]) if mine else {}

    before = calls()
    loss, grads, _ = packed_loss_and_grads()
    probed = calls()
    # Encoder and decoder self-attention carry the bias (2 layers each); cross-attention has none.
    assert probed.get("flash", 0) - before.get("flash", 0) >= 4
    assert probed.get("math", 0) == before.get("math", 0)
    monkeypatch.setenv(bias_attention.FORCE_MATH, "math")
    ref_loss, ref_grads, _ = packed_loss_and_grads()
    assert calls()["math"] - probed.get("math", 0) >= 4
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 4 * (2 + 2 * 2)
    for n, g in grads.items():
        assert torch.allclose(g, ref_grads[n], atol=1e-5, rtol=1e-4), n


def test_calls_are_counted_by_backend_and_the_ab_switch_forces_math(monkeypatch):
    q, k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    bias = torch.randn(1, 2, 5, 9)  # frozen (LoRA): CPU flash takes it

    def calls():
        # Only this test's key: another test of the same worker may have attended in bf16 with head size 16,
        # which sorts first (CI, 2026-11-28).
        mine = [
            c["calls"] for c in bias_attention.chosen() if (c["device"], c["dtype"], c["head_dim"]) == key
        ]
        return dict(mine[0]) if mine else {}

    key = ("cpu", "float32", 16)
    before = calls()
    out = bias_attention.bias_sdpa(q, k, v, bias, scale=1.0)
    ref = torch.softmax(q @ k.transpose(-1, -2) + bias, -1) @ v
    assert torch.allclose(out, ref, atol=1e-5)
    flash = calls().get("flash", 0)
    assert flash == before.get("flash", 0) + 1
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


def test_the_probe_leaves_no_tensor_alive():
    # The planner's measured model states (tests/integration/test_plan_measured.py, FSDP2) count every tensor
    # Python can see: the probe's must die with it.
    import gc

    def tensor_bytes():
        gc.collect()
        seen = {}
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                try:
                    ptr = obj.untyped_storage().data_ptr()
                except RuntimeError:  # a fake tensor torch.compile's caches keep (another test's): no memory
                    continue
                seen[ptr] = obj.untyped_storage().nbytes()
        return sum(seen.values())

    before = tensor_bytes()
    probe("cpu", torch.float32, 12, bias_grad=True)
    probe("cpu", torch.float32, 12, bias_grad=False)
    assert tensor_bytes() == before
