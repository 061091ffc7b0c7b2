"""Grouped experts with LoRA factored per group (lorakit.model.grouped_experts) equal transformers' own loop
over the experts ("eager"), forward and LoRA gradients, for each MoE family's tiny model."""

from __future__ import annotations

import pytest
import torch

MOE_KINDS = ("mixtral", "qwen3_moe", "olmoe")


def _lora_model(kind: str, r: int):
    from peft import LoraConfig, get_peft_model

    from lorakit.model.families import family_named
    from lorakit.testing import SPECIAL_TOKENS, TINY_VOCAB_SIZE

    tiny = family_named(kind).tiny
    config = tiny.config(TINY_VOCAB_SIZE, bos=SPECIAL_TOKENS.index("<s>"))
    torch.manual_seed(0)
    model = tiny.model(config)
    lora = LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    return model


def _forward_backward(model, ids):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    (logits.float().square().mean()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logits.detach(), grads


# r=4: every stride 16-byte aligned, the 3 matmuls of each projection are torch's grouped matmul; r=3: the
# LoRA factors' 12-byte rows cannot be, the factors go by segments (the base weight still grouped).
@pytest.mark.parametrize("kind,r,kernel_calls", [(k, 4, 3) for k in MOE_KINDS] + [("mixtral", 3, 1)])
def test_grouped_experts_with_factored_lora_equal_transformers_loop(kind, r, kernel_calls, monkeypatch):
    from lorakit.model import grouped_experts

    model = _lora_model(kind, r)
    ids = torch.randint(4, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    model.get_base_model().set_experts_implementation("eager")
    want, want_grads = _forward_backward(model, ids)

    line = grouped_experts.use_grouped_experts(model, factored=True)
    assert line and "computed as groups" in line
    assert model.config._experts_implementation == grouped_experts.NAME
    factored, calls = [], []
    real_factors, real_mm = grouped_experts._weight_and_factors, torch.nn.functional.grouped_mm
    monkeypatch.setattr(
        grouped_experts,
        "_weight_and_factors",
        lambda *a: factored.append(real_factors(*a)[1]) or real_factors(*a),
    )
    monkeypatch.setattr(
        torch.nn.functional, "grouped_mm", lambda *a, **k: calls.append(1) or real_mm(*a, **k)
    )
    got, got_grads = _forward_backward(model, ids)

    # Every projection of every layer read peft's factors (no materialised W + B A).
    assert len(factored) == 2 * model.config.num_hidden_layers and all(f is not None for f in factored)
    assert len(calls) == 2 * kernel_calls * model.config.num_hidden_layers
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want_grads.keys() == got_grads.keys()
    expert_grads = [n for n in want_grads if "experts" in n]
    assert len(expert_grads) == 4 * model.config.num_hidden_layers
    for name, grad in want_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_grouped_experts_leave_lora_to_peft_when_the_adapter_is_disabled():
    """No parametrization (peft's adapter disabled): the experts use W alone, as the loop does."""
    from lorakit.model import grouped_experts

    model = _lora_model("mixtral", 4)
    ids = torch.randint(4, 200, (1, 16), generator=torch.Generator().manual_seed(2))
    model.get_base_model().set_experts_implementation("eager")
    with torch.no_grad(), model.disable_adapter():
        want = model(input_ids=ids).logits
    grouped_experts.use_grouped_experts(model, factored=True)
    with torch.no_grad():
        with model.disable_adapter():
            got = model(input_ids=ids).logits
        adapted = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (adapted - got).abs().max() > 1e-3


def test_on_cpu_the_automatic_choice_keeps_transformers_path_and_says_so():
    from lorakit.model import grouped_experts

    model = _lora_model("olmoe", 4)
    line = grouped_experts.use_grouped_experts(model)
    assert model.config._experts_implementation == "grouped_mm"
    assert line.startswith("experts: transformers' 'grouped_mm' path") and "CUDA only" in line


def test_the_segment_path_equals_torch_grouped_matmul():
    from lorakit.model.grouped_experts import can_group, grouped_matmul

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(10, 8, generator=gen)
    w = torch.randn(3, 8, 4, generator=gen)
    offsets = torch.tensor([4, 4, 10], dtype=torch.int32)
    assert can_group(x, w)
    want = torch.cat([x[:4] @ w[0], x[4:] @ w[2]])
    torch.testing.assert_close(grouped_matmul(x, w, offsets, None), want)
    torch.testing.assert_close(grouped_matmul(x, w, offsets, [4, 0, 6]), want)
    odd = torch.randn(3, 8, 5, generator=gen)  # 20-byte rows: no grouped kernel
    assert not can_group(x, odd)
    torch.testing.assert_close(
        grouped_matmul(x, odd, offsets, None), torch.cat([x[:4] @ odd[0], x[4:] @ odd[2]])
    )
