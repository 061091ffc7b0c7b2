"""vLLM loads an adapter exported with --format vllm and, at temperature 0, generates what transformers
generates with the same adapter (PeftModel on the base, float32 reference). Needs a CUDA GPU and vLLM
(`pip install vllm`); skipped otherwise. The tiny Llama's head sizes are too small for vLLM's kernels, so the
base here is a wider tiny Llama (head_dim 64)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lorakit.testing import build_tiny_model
from tests.export_fixtures import random_adapter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]
PROMPTS = ["The city council met on Tuesday", "A storm closed schools", "Prices rose again"]
NEW = 12


def test_vllm_serves_the_exported_adapter_as_transformers_does(tmp_path, cache_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from lorakit.export.exporting import export

    base = tmp_path / "base"
    build_tiny_model("llama", base, hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                     intermediate_size=512)  # fmt: skip
    adapter = random_adapter(
        "llama",
        cache_dir,
        tmp_path / "adapter",
        base=str(base),
        target_modules=["q_proj", "v_proj", "o_proj"],
    )
    export(adapter, tmp_path / "vllm", format="vllm")

    tok = AutoTokenizer.from_pretrained(base)
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter
    )
    expected = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, num_beams=1)[0, ids.shape[1] :]
        expected.append(out.tolist())

    llm = LLM(str(base), enable_lora=True, max_lora_rank=8, dtype="float32", enforce_eager=True, max_model_len=256,
              gpu_memory_utilization=0.3)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    prompts = [{"prompt_token_ids": tok(p)["input_ids"]} for p in PROMPTS]
    outs = llm.generate(prompts, params, lora_request=LoRARequest("adapter", 1, str(tmp_path / "vllm")))
    got = [list(o.outputs[0].token_ids) for o in outs]
    eos = tok.eos_token_id
    trim = [g[: g.index(eos)] if eos in g else g for g in got]
    assert trim == [e[: e.index(eos)] if eos in e else e for e in expected]
    # The adapter matters: without it vLLM generates something else on at least one prompt.
    base_outs = llm.generate(prompts, params)
    assert [list(o.outputs[0].token_ids) for o in base_outs] != got
