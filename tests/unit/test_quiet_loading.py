"""merge, generate and evaluate load weights through lorakit.export.loading: without transformers' notice
about a tied head the checkpoint keeps separate (what lorakit trains and saves) and without the
FutureWarning peft's adapter load triggers. A warning of another kind still shows."""

from __future__ import annotations

import warnings

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from lorakit.export.loading import load_pretrained, peft_from_pretrained


def _untied_checkpoint(path):
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config)
    # The config ties the head; the checkpoint holds a head of its own (as model/untie.py leaves it).
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach() + 1)
    model.save_pretrained(path)
    return model


def test_loading_an_untied_head_and_an_adapter_prints_no_library_notices(tmp_path, capfd):
    from peft import LoraConfig, get_peft_model

    model = _untied_checkpoint(tmp_path / "base")
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        base = load_pretrained(AutoModelForCausalLM, str(tmp_path / "base"), torch.float32, None)
        peft_from_pretrained(base, str(tmp_path / "adapter"), is_trainable=False)
        warnings.warn("a real problem", UserWarning, stacklevel=1)
    out = capfd.readouterr()
    assert "tied weights mapping" not in out.out + out.err, out.err
    assert not [w for w in seen if "is_gradient_checkpointing" in str(w.message)], [
        str(w.message) for w in seen
    ]
    assert [str(w.message) for w in seen if issubclass(w.category, UserWarning)] == ["a real problem"]
    # Kept separate, as trained.
    assert not torch.equal(base.lm_head.weight, base.model.embed_tokens.weight)
