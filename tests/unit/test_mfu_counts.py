"""MFU counted two ways (issue 61): lorakit's count of what a LoRA step computes, and NeMo AutoModel's
(the full fine-tuning FLOPs scaled by (2 + lora/frozen)/3), from the linear layers of a real tiny model."""

from __future__ import annotations

import pytest
import torch

from lorakit.meter import flops_summary, lora_training_flops, matmul_params, peak_tflops


def tiny_lora_llama():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=4, target_modules=targets))


def test_matmul_params_of_a_tiny_lora_llama_by_hand():
    # Per layer: q 64x64, k 64x32, v 64x32, o 64x64, gate/up 64x128, down 128x64 = 36,864; lm_head 64x100.
    # LoRA r=4 per layer: q 4(64+64), k 4(64+32), v 4(64+32), o 4(64+64), gate/up 4(64+128), down 4(128+64).
    counts = matmul_params(tiny_lora_llama())
    assert counts == {"frozen": 2 * 36_864 + 6_400, "lora": 2 * 4 * (128 + 96 + 96 + 128 + 3 * 192)}


def test_both_counts_by_hand():
    frozen, lora = 71_936, 8_192
    # lorakit: 4 per frozen weight (forward, input gradient) + 6 per LoRA weight; attention forward x3.
    assert lora_training_flops(frozen, lora, attention=1000)["lorakit"] == 4 * 71_936 + 6 * 8_192 + 3000
    # NeMo: (6 x 71,936 + 3,000) x (2 + 8,192/71,936) / 3 = 434,616 x 2.113879... / 3 = 306,241.88
    nemo = lora_training_flops(frozen, lora, attention=1000)["nemo"]
    assert nemo == pytest.approx(306_241.88, abs=0.01)
    # Without adapters NeMo's count is two thirds of full fine-tuning: the weight gradients it leaves out.
    assert lora_training_flops(3, 0)["nemo"] == pytest.approx(12.0)
    with pytest.raises(ValueError, match="frozen"):
        lora_training_flops(0, 5)


def test_summary_mfu_against_a_known_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    params = {"frozen": 7_000_000_000, "lora": 40_000_000}
    out = flops_summary(params, full=False, seq2seq=False, tokens_per_second=2 * 10_000.0, world_size=2)
    assert out["peak_tflops"] == 989.0 and out["device"] == "NVIDIA H100 80GB HBM3"
    # Per GPU 10,000 tok/s: lorakit 10,000 x (28e9 + 0.24e9) / 989e12; NeMo 10,000 x 42e9 x (2 + 4/700)/3.
    assert out["mfu"] == pytest.approx(10_000 * 28.24e9 / 989e12)
    assert out["mfu_nemo"] == pytest.approx(10_000 * 42e9 * (2 + 4 / 700) / 3 / 989e12)
    assert out["mfu_nemo"] < out["mfu"]
    full = flops_summary(params, full=True, seq2seq=False, tokens_per_second=10_000.0, world_size=1)
    assert full["mfu"] == full["mfu_nemo"] == pytest.approx(10_000 * 6 * 7.04e9 / 989e12)


def test_summary_without_a_peak_or_for_encoder_decoders():
    cpu = flops_summary(
        {"frozen": 10, "lora": 1}, full=False, seq2seq=False, tokens_per_second=5.0, world_size=1
    )
    if not torch.cuda.is_available():
        assert cpu["mfu"] is None and cpu["mfu_nemo"] is None and cpu["flops_per_token"]["lorakit"] == 46
    t5 = flops_summary(
        {"frozen": 10, "lora": 1}, full=False, seq2seq=True, tokens_per_second=5.0, world_size=1
    )
    assert t5["flops_per_token"] is None and "encoder-decoder" in t5["why"]
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0 and peak_tflops(None) is None
