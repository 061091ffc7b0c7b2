"""Regional torch.compile of each block with its LoRA branches (issue 61): the same losses and LoRA
gradients as eager over a few steps, and few recompilations over 50 steps of varying (packed) length."""

from __future__ import annotations

import pytest
import torch

from lorakit.model.compile import compile_blocks


def tiny_lora_llama(seed: int = 0):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(model, lora)


def steps(model, lengths, lr=1e-2):
    """Plain SGD steps on rows of the given lengths; the losses and the last LoRA gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    gen, losses = torch.Generator().manual_seed(3), []
    for n in lengths:
        ids = torch.randint(0, 64, (1, n), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad()
    return losses, grads


@pytest.mark.slow
def test_compiled_blocks_equal_eager_and_do_not_recompile_per_length():
    import torch._dynamo

    torch._dynamo.reset()
    eager_losses, eager_grads = steps(tiny_lora_llama(), [17, 33, 9])
    model = tiny_lora_llama()
    info = compile_blocks(model)
    assert info["blocks"] == 2 and info["classes"] == ["LlamaDecoderLayer"]
    losses, grads = steps(model, [17, 33, 9])
    assert losses == pytest.approx(eager_losses, rel=1e-4)
    assert grads.keys() == eager_grads.keys() and len(grads) == 2 * 2 * 7
    for n, g in grads.items():
        assert torch.allclose(g, eager_grads[n], atol=1e-5, rtol=1e-3), n
    # 50 more steps at lengths a packed sampler hands out: the graphs do not grow with the lengths.
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    lengths = torch.randint(8, 120, (50,), generator=torch.Generator().manual_seed(4)).tolist()
    steps(model, lengths)
    assert len(set(lengths)) > 30
    assert counters["stats"]["unique_graphs"] - before <= 2, dict(counters["stats"])
