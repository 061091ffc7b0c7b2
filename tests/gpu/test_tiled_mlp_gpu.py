"""The tiled MLP on a CUDA GPU in bf16 (the CPU tests check it in fp32): a long row with gradient
checkpointing gives the same logits and LoRA gradients as the untiled model within bf16 round-off, and the
peak of GPU memory over its forward and backward falls, because the MLP's wide intermediate activations
exist for one tile at a time."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROW = 16384
TILE = 1024
SHAPE = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": ROW,
}


def _models(device: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lorakit.model.tiled_mlp import apply_tiled_mlp
    from lorakit.testing import tiny_config

    torch.manual_seed(0)
    config = tiny_config("llama")
    for key, value in SHAPE.items():
        setattr(config, key, value)
    config.head_dim = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    config.use_cache = False
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)  # peft starts B at 0: every LoRA gradient must be non-trivial
    tiled = copy.deepcopy(model)
    assert apply_tiled_mlp(tiled, TILE) == SHAPE["num_hidden_layers"]
    return model.to(device).train(), tiled.to(device).train()


def _step(model, ids, weights, device: str):
    """Logits, LoRA gradients and the peak of memory allocated above the start (CUDA only) of one step."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    logits = model(input_ids=ids, use_cache=False).logits
    (logits.float() * weights).sum().backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
    peak = torch.cuda.max_memory_allocated() - start if device == "cuda" else 0
    return logits.detach().float(), grads, peak


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def check_tiled_mlp(device: str, row: int = ROW) -> dict:
    """Run the untiled and the tiled model on one row; assert equality within bf16 round-off and return
    what was measured."""
    plain, tiled = _models(device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, plain.config.vocab_size, (1, row), generator=g).to(device)
    weights = torch.randn(1, row, plain.config.vocab_size, generator=g).to(device) / row
    want_logits, want, plain_peak = _step(plain, ids, weights, device)
    got_logits, got, tiled_peak = _step(tiled, ids, weights, device)
    assert got.keys() == want.keys() and len(want) == 2 * 7 * SHAPE["num_hidden_layers"]
    logit_err = _relative(got_logits, want_logits)
    grad_err = max(_relative(got[n], w) for n, w in want.items())
    # bf16 keeps 8 bits of mantissa (relative round-off 4e-3); the tiles run the same matmuls on fewer rows.
    assert logit_err < 1e-2, logit_err
    assert grad_err < 5e-2, {n: _relative(got[n], w) for n, w in want.items()}
    return {"logit_err": logit_err, "grad_err": grad_err, "plain_peak": plain_peak, "tiled_peak": tiled_peak}


def test_tiled_mlp_matches_and_lowers_the_peak_on_cuda():
    measured = check_tiled_mlp("cuda")
    print("tiled MLP on", torch.cuda.get_device_name(), measured)
    # Untiled, one layer's recompute holds gate, up, activation and product of ROW x 4096 bf16 (128 MiB
    # each) and their gradients; tiled, 1/16 of that. The rest (hidden states, attention) is the same.
    wide = ROW * SHAPE["intermediate_size"] * 2
    assert measured["plain_peak"] - measured["tiled_peak"] > 2 * wide, measured
