"""GRPO's vLLM rollout engine (lorakit.objectives.grpo_vllm), colocated: sent only the adapter, vLLM at
temperature 0 generates what the Engine's own generation generates with the same weights, and after the
adapter changes (a training step) it generates what the changed policy generates. Needs a CUDA GPU and vLLM
(`pip install 'lorakit[vllm]'`); skipped otherwise. The tiny Llama's head sizes are too small for vLLM's
kernels, so the base here is a wider tiny Llama (head_dim 64), as in test_vllm_export.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lorakit.evaluation.generate import generate_ids
from lorakit.objectives.grpo_rollouts import completion_mask
from lorakit.testing import build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]
PROMPTS = ["The city council met on Tuesday", "A storm closed schools", "Prices rose again"]
NEW = 12


class _Engine:
    """What VllmRollouts asks of an Engine: the module and its trainable weights, whole."""

    def __init__(self, module):
        self.module = module

    def trainable_state(self):
        return {n: p.detach().cpu() for n, p in self.module.named_parameters() if p.requires_grad}


def test_adapter_only_sync_generates_what_the_engine_generates(tmp_path):
    from peft import LoraConfig, get_peft_model

    from lorakit.objectives.grpo_vllm import VllmRollouts

    base = tmp_path / "base"
    build_tiny_model("llama", base, hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                     intermediate_size=512)  # fmt: skip
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(0)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config).cuda()
    encoded = [tok(p)["input_ids"] for p in PROMPTS]
    width = max(map(len, encoded))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(e)) + e for e in encoded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    sampling = dict(max_new_tokens=NEW, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    rollouts = VllmRollouts(_Engine(model), str(base), config.to_dict(), tmp_path / "sync", server=None,
                            dtype="float32", enforce_eager=True, max_model_len=256)  # fmt: skip
    assert rollouts.describe() == "vllm (colocated)"

    def both():
        want = generate_ids(model, ids.cuda(), mask.cuda(), do_sample=False, **sampling).cpu()[:, width:]
        rollouts.begin()
        try:
            got = rollouts.generate(ids, mask, temperature=0.0, **sampling)[:, width:]
        finally:
            rollouts.end()
        return got, want

    for step in range(2):
        got, want = both()
        keep_got, keep_want = completion_mask(got, tok.eos_token_id), completion_mask(want, tok.eos_token_id)
        assert torch.equal(keep_got.sum(1), keep_want.sum(1)), step
        assert torch.equal(got * keep_got, want[:, : got.shape[1]] * keep_want[:, : got.shape[1]]), step
        with torch.no_grad():  # a training step: the adapter changes, the base does not
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.add_(torch.randn_like(p) * 0.5)
