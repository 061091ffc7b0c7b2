"""GRPO's vLLM rollout engine, the parts that run without vLLM (lorakit.objectives.grpo_vllm): the adapter it
sends is in vLLM's layout (lorakit.export.vllm's check passes) and is the policy (loaded by peft it gives the
live model's logits); what vLLM would not serve is refused; the server mode loads each window's adapter
before asking for completions, as token ids with per-row seeds from the rollout source's generator, and
hands RolloutSteps the Engine's layout. The server here is a small HTTP stand-in answering vLLM's three
endpoints greedily with the adapter it was told to load; the GPU test (tests/gpu/test_grpo_vllm.py) runs vLLM."""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from lorakit.errors import RecipeError
from lorakit.evaluation.generate import generate_ids
from lorakit.export.vllm import base_module_names, layout_problems
from lorakit.objectives.grpo_vllm import (
    CONFIG,
    adapter_payload,
    as_generate_output,
    completion_request,
    prompt_lists,
    write_adapter,
)
from lorakit.testing import resolve_model_source
from tests.unit.test_grpo_rollouts import _setup as causal_setup

TARGETS = ["q_proj", "v_proj", "o_proj"]


def _policy(cache_dir, **config):
    base = resolve_model_source("tiny:llama", cache_dir)
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, **config)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), lora)
    return base, model.eval(), lora


def _trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_the_adapter_sent_is_in_vllms_layout_and_is_the_policy(cache_dir, tmp_path):
    base, model, lora = _policy(cache_dir)
    payload = adapter_payload(_trainable(model))
    assert all(k.startswith("base_model.model.") and ".default." not in k for k in payload)
    out = write_adapter(tmp_path / "a", payload, lora.to_dict(), base)
    assert layout_problems(out, base_module_names(base)) == []
    config = json.loads((out / CONFIG).read_text())
    assert config["target_modules"] == sorted(TARGETS) and config["base_model_name_or_path"] == base
    ids = torch.tensor([[5, 17, 33, 90, 8]])
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), out)
    with torch.no_grad():
        assert torch.allclose(loaded.eval()(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


def test_what_vllm_would_not_serve_is_refused(cache_dir):
    _, model, _ = _policy(cache_dir, modules_to_save=["lm_head"])
    with pytest.raises(RecipeError, match="modules_to_save|other weights"):
        adapter_payload(_trainable(model))
    with pytest.raises(RecipeError, match="no LoRA weights"):
        adapter_payload({})


def test_requests_and_the_engines_layout():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert prompt_lists(ids, mask) == [[5, 6], [7, 8, 9, 10]]
    body = completion_request(
        "lorakit-policy-3", [5, 6], 11, {"max_new_tokens": 4, "temperature": 0.7, "top_k": 0}
    )
    assert body == {"model": "lorakit-policy-3", "prompt": [5, 6], "n": 1, "seed": 11, "temperature": 0.7,
                    "top_p": 1.0, "top_k": -1, "max_tokens": 4, "skip_special_tokens": False,
                    "return_token_ids": True}  # fmt: skip
    out = as_generate_output(ids, [[3, 2, 4], [3, 3]], pad_token_id=0, eos_token_id=2)
    assert out.tolist() == [[0, 0, 5, 6, 3, 2], [7, 8, 9, 10, 3, 3]]


class _Server(BaseHTTPRequestHandler):
    """vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter and /v1/completions, answered greedily by the
    base with the adapter last loaded under the requested name."""

    base: str
    eos: int
    log: list
    adapters: dict

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.log.append((self.path, body))
        if self.path == "/v1/load_lora_adapter":
            model = AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32)
            self.adapters[body["lora_name"]] = PeftModel.from_pretrained(model, body["lora_path"]).eval()
            answer = {"loaded": body["lora_name"]}
        elif self.path == "/v1/unload_lora_adapter":
            self.adapters.pop(body["lora_name"])
            answer = {"unloaded": body["lora_name"]}
        else:
            model, prompt = self.adapters[body["model"]], torch.tensor([body["prompt"]])
            out = generate_ids(model, prompt, torch.ones_like(prompt), do_sample=False,
                               max_new_tokens=body["max_tokens"], eos_token_id=self.eos, pad_token_id=0)  # fmt: skip
            answer = {"choices": [{"token_ids": out[0, prompt.shape[1] :].tolist()}]}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM installed: the GPU test runs it"
)
def test_colocated_vllm_without_vllm_names_the_extra(cache_dir, tmp_path):
    from lorakit.objectives.grpo_vllm import VllmRollouts

    _, model, lora = _policy(cache_dir)
    with pytest.raises(RecipeError, match=r"lorakit\[vllm\]"):
        VllmRollouts(type("E", (), {"module": model})(), "base", lora.to_dict(), tmp_path, server=None)


def test_server_mode_sends_each_windows_adapter_before_its_prompts(cache_dir, tmp_path):
    from lorakit.objectives.grpo_vllm import VllmRollouts

    model, engine, source, settings = causal_setup(
        tmp_path / "run", temperature=1.0, passes=2
    )  # 2: old log-probs
    base = str(tmp_path / "run" / "model")
    eos, pad = source.tokenizer.eos_token_id, source.tokenizer.pad_token_id
    handler = type("H", (_Server,), {"base": base, "eos": eos, "log": [], "adapters": {}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine.trainable_state = lambda: _trainable(model)
        config = model.peft_config["default"].to_dict()
        vllm = VllmRollouts(
            engine, base, config, tmp_path / "sync", server=f"http://127.0.0.1:{server.server_port}/"
        )
        source.generation = vllm
        assert source.generated_by == f"vllm (server http://127.0.0.1:{server.server_port})"
        windows = list(source.windows(0, {}))
    finally:
        server.shutdown()
    log = handler.log
    paths = [p for p, _ in log]
    # Window 1: its adapter, then 2 micro-batches x 2 prompts x 4 completions; window 2 swaps the adapter.
    assert paths[0] == "/v1/load_lora_adapter" and paths[1:17] == ["/v1/completions"] * 16
    assert paths[17:19] == ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"] and len(paths) == 35
    assert {b["model"] for p, b in log[1:17]} == {"lorakit-policy-1"} and log[18][1][
        "lora_name"
    ] == "lorakit-policy-1"
    seeds = [b["seed"] for p, b in log if p == "/v1/completions"]
    assert len(set(seeds)) == len(seeds) and all(
        b["return_token_ids"] for p, b in log if p == "/v1/completions"
    )
    # The completions are the served policy's (greedy here), in the Engine's layout, scored by the Engine.
    b = windows[0].batches[0]
    width = int(b["prompt_width"])
    prompts, mask = b["input_ids"][:, :width], b["attention_mask"][:, :width]
    want = generate_ids(model, prompts, mask, do_sample=False, max_new_tokens=settings.max_new_tokens,
                        eos_token_id=eos, pad_token_id=pad)  # fmt: skip
    assert torch.equal(b["input_ids"], want)
    with torch.no_grad():
        from lorakit.objectives.grpo_loss import rollout_log_probs

        assert torch.allclose(rollout_log_probs(engine, b), b["old_logp"], atol=1e-5)


def test_the_setting_chooses_the_engine_and_a_server_needs_vllm():
    from lorakit.objectives.grpo_settings import GrpoSection

    assert GrpoSection(rewards=[{"name": "length", "target": 4}]).rollout_engine == "engine"
    chosen = GrpoSection(
        rewards=[{"name": "length", "target": 4}], rollout_engine="vllm", vllm_server="http://h:8000"
    )
    assert chosen.vllm_server == "http://h:8000"
    with pytest.raises(ValueError, match="grpo.vllm_server is for grpo.rollout_engine vllm"):
        GrpoSection(rewards=[{"name": "length", "target": 4}], vllm_server="http://h:8000")
