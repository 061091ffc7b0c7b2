"""python -m lorakit.export --format vllm: the adapter in vLLM's layout, and the refusals (one line each, the
merged model offered instead) for what vLLM would drop: MoE parameter adapters, embedding adapters and
prefix-drifted keys. vLLM itself loads the export in tests/gpu/test_vllm_export.py."""

import json

import pytest
from safetensors.torch import load_file, save_file

from lorakit.errors import MergeError
from lorakit.export.exporting import export
from tests.export_fixtures import random_adapter


@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory, cache_dir):
    return random_adapter("llama", cache_dir, tmp_path_factory.mktemp("vllm") / "llama")


def test_writes_the_layout_vllm_loads(llama_adapter, tmp_path):
    result = export(llama_adapter, tmp_path / "v", format="vllm")
    config = json.loads((tmp_path / "v" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["peft_type"] == "LORA"
    keys = load_file(str(tmp_path / "v" / "adapter_model.safetensors"))
    assert keys.keys() == load_file(str(llama_adapter / "adapter_model.safetensors")).keys()
    assert all(k.startswith("base_model.model.model.layers.") for k in keys)
    assert "vllm serve" in result.serve and "--enable-lora" in (tmp_path / "v" / "README.md").read_text()


def _refusal(adapter, tmp_path) -> str:
    with pytest.raises(MergeError) as e:
        export(adapter, tmp_path / "refused", format="vllm")
    assert not (tmp_path / "refused").exists()
    message = str(e.value)
    assert "serve the merged model instead: python -m lorakit.merge" in message
    return message


def test_refuses_prefix_drifted_keys(llama_adapter, tmp_path):
    drifted = tmp_path / "drifted"
    drifted.mkdir()
    (drifted / "adapter_config.json").write_text((llama_adapter / "adapter_config.json").read_text())
    tensors = load_file(str(llama_adapter / "adapter_model.safetensors"))
    # What a trainer that saves from a wrapped model writes: one `model.` too many.
    renamed = {k.replace("base_model.model.", "base_model.model.model.", 1): v for k, v in tensors.items()}
    save_file(renamed, str(drifted / "adapter_model.safetensors"))
    message = _refusal(drifted, tmp_path)
    assert f"{len(tensors)} key(s) name no module of the base (prefix drift)" in message
    assert message.count("\n  - ") == 1


def test_refuses_embedding_adapters(cache_dir, tmp_path):
    adapter = random_adapter("llama", cache_dir, tmp_path / "emb", target_modules=["embed_tokens", "q_proj"])
    assert "adapters on ['model.embed_tokens']: vLLM serves LoRA on linear layers only" in _refusal(
        adapter, tmp_path
    )


def test_refuses_moe_parameter_adapters(cache_dir, tmp_path):
    adapter = random_adapter(
        "qwen3_moe",
        cache_dir,
        tmp_path / "moe",
        target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj"],
    )
    message = _refusal(adapter, tmp_path)
    assert "MoE parameter adapters on fused experts" in message and "vLLM#34186" in message
    assert message.count("\n  - ") == 1
