"""Regional torch.compile of each block's parts with their LoRA branches (issue 61), composed with gradient
checkpointing and lorakit's packed attention: the same losses and LoRA gradients as eager, few graphs over
50 packed steps whose layouts all differ, and the recipe switch (auto: CUDA only)."""

from __future__ import annotations

import pytest
import torch

from lorakit.model.compile import compile_blocks, compile_stats, compile_summary, compile_wanted, regions


def tiny_packed_llama():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from lorakit.model.build import enable_checkpointing
    from lorakit.model.varlen import register_varlen_sdpa

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attn_implementation=register_varlen_sdpa(),
        use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    enable_checkpointing(model)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(model, lora).train()


def packed_rows(n: int):
    """n packed rows of 2-4 examples of 3-20 tokens: (ids, position_ids, boundaries)."""
    gen, rows = torch.Generator().manual_seed(3), []
    for _ in range(n):
        lengths = torch.randint(
            3, 21, (int(torch.randint(2, 5, (1,), generator=gen)),), generator=gen
        ).tolist()
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + length)
        positions = torch.cat([torch.arange(length) for length in lengths])[None]
        rows.append((torch.randint(0, 64, (1, bounds[-1]), generator=gen), positions, bounds))
    return rows


def steps(model, rows):
    """Plain SGD steps on packed rows (lorakit's per-example attention); the losses, the last gradients."""
    from lorakit.model.varlen import Segments

    params = [p for p in model.parameters() if p.requires_grad]
    opt, losses = torch.optim.SGD(params, lr=1e-2), []
    for ids, positions, bounds in rows:
        loss = model(
            input_ids=ids, position_ids=positions, labels=ids, attention_mask=torch.ones_like(ids),
            lorakit_segments=Segments(bounds),
        ).loss  # fmt: skip
        loss.backward()
        losses.append(loss.item())
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad()
    return losses, grads


@pytest.mark.slow
def test_compiled_blocks_equal_eager_and_do_not_recompile_per_packing():
    import torch._dynamo

    torch._dynamo.reset()
    rows = packed_rows(50)
    eager_losses, eager_grads = steps(tiny_packed_llama(), rows[:3])
    model = tiny_packed_llama()
    # aot_eager: dynamo's capture and AOTAutograd's graphs, which decide graphs and recompilations as
    # inductor's would, without its C++ compile (minutes on a loaded CI core).
    info = compile_blocks(model, backend="aot_eager")
    assert info["blocks"] == 2 and info["classes"] == ["LlamaDecoderLayer"]
    assert info["regions"] == 2 * 4  # self_attn, mlp and the two norms of each layer
    losses, grads = steps(model, rows[:3])
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    assert grads.keys() == eager_grads.keys() and len(grads) == 2 * 2 * 7
    for n, g in grads.items():
        assert torch.allclose(g, eager_grads[n], atol=1e-6, rtol=1e-4), n
    first = compile_stats()["graphs"] - info["baseline"]["graphs"]
    assert first > 0  # the regions did compile (checkpointing did not send them back to eager)
    # 47 more packed steps, every row a new layout: the graphs do not grow with the lengths.
    steps(model, rows[3:])
    assert len({r[0].shape[1] for r in rows}) > 20
    summary = compile_summary(info)
    assert summary["graphs"] - first <= 2, summary
    assert summary["compile_seconds"] > 0 and "baseline" not in summary


def test_regions_are_a_blocks_parts_with_parameters():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    block = T5ForConditionalGeneration(cfg).decoder.block[0]
    # T5's layer list, item by item: self-attention, cross-attention, feed-forward (each with its norm).
    assert [type(m).__name__ for m in regions(block)] == [
        "T5LayerSelfAttention", "T5LayerCrossAttention", "T5LayerFF"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("setting", "cuda", "quantized", "zero3", "wanted"),
    [
        ("auto", True, False, False, True),
        ("auto", False, False, False, False),  # CPU: compile time outweighs the gain
        ("auto", True, True, False, False),  # 4-bit bases break the graph at every layer
        ("auto", True, False, True, False),  # ZeRO-3's gathering hooks
        (True, False, True, True, True),  # forced
        (False, True, False, False, False),
    ],
)
def test_model_compile_auto_is_on_where_it_pays(setting, cuda, quantized, zero3, wanted):
    assert compile_wanted(setting, cuda=cuda, quantized=quantized, zero3=zero3) is wanted
