"""QLoRA's 4-bit fused experts (lorakit.model.quant_experts): the forward equals the model with the dequantized
stacks in model.dtype, LoRA on them equals LoRA on those stacks (outputs and gradients) under peft's own names,
the run built by build_model trains its experts through an evaluation on both of bitsandbytes' CPU branches, and
its adapter loads onto the 16-bit base."""

from __future__ import annotations

import copy

import pytest
import torch

from lorakit.model.families import family_named
from lorakit.model.quant_experts import STACKS, QuantizedExperts, quantize_experts
from lorakit.testing import SPECIAL_TOKENS, TINY_VOCAB_SIZE
from tests.conftest import tiny_recipe

IDS = torch.randint(5, TINY_VOCAB_SIZE, (2, 12), generator=torch.Generator().manual_seed(0))


def _tiny(kind: str, dtype: torch.dtype):
    family = family_named(kind)
    config = family.tiny.config(TINY_VOCAB_SIZE, bos=SPECIAL_TOKENS.index("<s>"))
    torch.manual_seed(0)
    return family.tiny.model(config).to(dtype)


def _quantized_and_reference(kind: str, dtype: torch.dtype):
    """(model with 4-bit experts, the same model with each stack replaced by its dequantized 4-bit weights)."""
    ref = _tiny(kind, dtype)
    q = copy.deepcopy(ref)
    assert quantize_experts(q, "nf4") == ref.config.num_hidden_layers
    for (name, m), qm in zip(_experts(ref), [m for _, m in _experts(q)], strict=True):
        assert isinstance(qm, QuantizedExperts) and not isinstance(m, QuantizedExperts), name
        for stack in STACKS:
            w = getattr(m, stack)
            deq = torch.stack([qm.dequantized(stack, e) for e in range(qm.num_experts)])
            # 4 bits: close to the 16-bit weights, never equal to them.
            assert 0 < (deq.float() - w.float()).abs().max() < 0.25 * w.float().abs().max()
            w.data = deq
    return q, ref


def _experts(model):
    return [(n, m) for n, m in model.named_modules() if n.endswith("mlp.experts")]


# Mixtral's in the LoRA test below.
@pytest.mark.parametrize("kind", ["qwen3_moe", "olmoe"])
def test_4bit_experts_compute_what_their_dequantized_stacks_compute(kind):
    # fp32: transformers' experts may compute as batched matmuls, whose rounding in bf16 differs from a loop's.
    q, ref = _quantized_and_reference(kind, torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(q(input_ids=IDS).logits, ref(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)
    # Half a byte per weight, in the storage dtype.
    for _, m in _experts(q):
        packed = sum(getattr(m, f"{s}_4bit").numel() * getattr(m, f"{s}_4bit").element_size() for s in STACKS)
        assert packed * 2 == sum(torch.Size(m.shapes[s]).numel() for s in STACKS)  # two weights a byte
        assert not any(p.requires_grad for p in m.parameters())


def test_lora_on_4bit_experts_equals_lora_on_the_dequantized_stacks_under_the_same_names():
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from lorakit.model.expert_gradients import ExpertGradientProbe
    from lorakit.model.quant_experts import experts_as_buffers

    q, ref = _quantized_and_reference("mixtral", torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
    q = get_peft_model(q, copy.deepcopy(config))
    ref = get_peft_model(ref, config)
    assert experts_as_buffers(q) == 2
    state = {k: torch.randn_like(v) * 0.1 for k, v in get_peft_model_state_dict(ref).items()}
    assert state.keys() == get_peft_model_state_dict(q).keys()  # merge, export and resume read it unchanged
    assert any(".experts.base_layer.lora_A" in k for k in state)
    for model in (q, ref):
        model.load_state_dict(
            {k.replace(".weight", ".default.weight"): v for k, v in state.items()}, strict=False
        )
    probe = ExpertGradientProbe(q)
    out_q, out_ref = q(input_ids=IDS, labels=IDS), ref(input_ids=IDS, labels=IDS)
    torch.testing.assert_close(out_q.logits, out_ref.logits, rtol=1e-4, atol=1e-4)
    out_q.loss.backward()
    out_ref.loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    for n, p in q.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-3, atol=1e-5)
    got, total = probe.finish()
    assert total == 2 * ref.config.num_hidden_layers * ref.config.num_local_experts and got > 0
    # Nothing of the zero stacks is a parameter or a state-dict entry (no memory to partition or save).
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in q.state_dict())


@pytest.mark.parametrize("avx512bf16", [False, True])
def test_a_qlora_moe_run_quantizes_its_experts_trains_them_through_an_evaluation_and_its_adapter_loads_on_bf16(
    tmp_path, monkeypatch, avx512bf16
):
    """Built as a run builds it (dropout 0.05 on the linear layers); bitsandbytes' AVX512-BF16 answer forced
    both ways, since on such CPUs its 4-bit linear layers switch layouts at the first evaluation."""
    from bitsandbytes.cextension import lib
    from peft import PeftModel

    from lorakit.model import build_model, count_parameters
    from lorakit.model.expert_gradients import ExpertGradientProbe
    from lorakit.model.quantize import describe_quantization, quantization_summary
    from lorakit.planner import plan

    monkeypatch.setattr(lib, "has_avx512bf16_cpu", lambda: avx512bf16)
    recipe = tiny_recipe(tmp_path, tmp_path / "run", model={"name_or_path": "tiny:mixtral", "dtype": "bfloat16",
                         "attention": "sdpa"}, data={"format": "instruction", "max_length": 64},
                         method={"kind": "qlora", "r": 4, "alpha": 8, "dropout": 0.05})  # fmt: skip
    model = build_model(recipe).model
    layers = model.config.num_hidden_layers
    assert sum(isinstance(m, QuantizedExperts) for m in model.modules()) == layers
    q = quantization_summary(model, recipe)
    expert_weights = layers * model.config.num_local_experts * 3 * model.config.intermediate_size * model.config.hidden_size  # fmt: skip
    assert q["quantized_expert_params"] == expert_weights < q["quantized_params"]
    assert "fused experts in 4 bits too" in describe_quantization(q)
    planned = plan(recipe, gpus=1, gpu_memory="16GB", device="cpu")
    assert (planned.trainable_params, planned.total_params) == count_parameters(model)

    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    model.eval()
    with torch.no_grad():  # what an evaluation does
        expected = model(input_ids=IDS).logits
    model.train()
    probe = ExpertGradientProbe(model)
    model(input_ids=IDS, labels=IDS).loss.backward()
    got, total = probe.finish()
    assert total == 2 * layers * model.config.num_local_experts and got > 0
    assert all(p.grad is not None for n, p in model.named_parameters() if "experts" in n and p.requires_grad)

    # The adapter as a run saves it loads onto the 16-bit base that holds the 4-bit weights dequantized.
    model.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(_dequantized_base(model), str(tmp_path / "adapter"))
    with torch.no_grad():
        got_logits = loaded.eval()(input_ids=IDS).logits
    # Same weights, in bf16: the linear layers' matmuls round differently from bitsandbytes' 4-bit ones.
    assert (got_logits - expected).abs().max() < 0.02 * expected.abs().max()


def _dequantized_base(peft_model):
    """A bf16 model whose weights are `peft_model`'s base, its 4-bit weights dequantized."""
    import bitsandbytes.functional as bnbf
    from bitsandbytes.nn import Linear4bit

    state = {}
    for name, m in peft_model.get_base_model().named_modules():
        clean = name.replace(".base_layer", "")
        if isinstance(m, Linear4bit):
            state[f"{clean}.weight"] = bnbf.dequantize_4bit(m.weight.data, m.weight.quant_state)
        elif isinstance(m, QuantizedExperts):
            for stack in STACKS:
                state[f"{clean}.{stack}"] = torch.stack(
                    [m.dequantized(stack, e) for e in range(m.num_experts)]
                )
        elif "lora_" not in name:
            state.update({f"{clean}.{k}": p.detach() for k, p in m.named_parameters(recurse=False)})
    base = family_named("mixtral").tiny.model(copy.deepcopy(peft_model.config)).to(torch.bfloat16)
    missing, unexpected = base.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return base
