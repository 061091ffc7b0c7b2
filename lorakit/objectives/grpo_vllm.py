"""GRPO's optional vLLM rollout engine (grpo.rollout_engine vllm; extra lorakit[vllm], CUDA, causal LMs).

vLLM holds the base once and is sent only the LoRA adapter each window of rollouts (adapter-only sync, as
axolotl's vllm_lora_sync and TRL do): the trainable weights, gathered whole from the Engine on every rank
(Engine.trainable_state: ZeRO-3 and FSDP2 shards included), written as vLLM's LoRA loader reads them (peft's
file names, keys `base_model.model.<module>.lora_A|lora_B.weight`, an explicit target_modules list; the layout
lorakit.export.vllm checks) into a new directory, and loaded under a new adapter id:

- colocated (grpo.vllm_server unset): one vLLM engine per training process on its GPU, woken for each
  window's rollouts and put to sleep (its KV cache freed, its weights to CPU) while the Engine trains;
- server (grpo.vllm_server: URL): the main process loads each adapter into a running `vllm serve BASE
  --enable-lora` through /v1/load_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True on the server) and
  every process asks /v1/completions for its prompts' completions as token ids.

Completions come back in the layout Engine.generate returns (left-padded prompt, then the completion padded
after its EOS), so RolloutSteps scores them, and the Engine computes their old and reference log-probabilities,
exactly as with the Engine's own generation. Each request carries a seed drawn from the rollout source's own
generator, so sampling is reproducible for a given vLLM build. vLLM is imported here only, lazily.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lorakit import dist
from lorakit.errors import RecipeError

EXTRA = "pip install 'lorakit[vllm]' (CUDA only)"
CONFIG, WEIGHTS, PREFIX = "adapter_config.json", "adapter_model.safetensors", "base_model.model."


def _vllm():
    try:
        import vllm
    except ImportError:
        raise RecipeError(f"grpo.rollout_engine vllm: vLLM is not installed; {EXTRA}") from None
    return vllm


def adapter_payload(
    trainable: dict[str, torch.Tensor], adapter_name: str = "default"
) -> dict[str, torch.Tensor]:
    """The LoRA tensors of `trainable` (the peft model's parameter names, Engine.trainable_state) under the
    keys peft saves and vLLM loads: the adapter's name dropped (`lora_A.default.weight` -> `lora_A.weight`).
    Refuses what vLLM would not serve: trainable weights that are not LoRA's (modules_to_save, full
    fine-tuning)."""
    out, other = {}, []
    for name, tensor in trainable.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}.{adapter_name}."
            if marker in name:
                out[name.replace(marker, f".{part}.")] = tensor.detach().contiguous()
                break
        else:
            other.append(name)
    if other or not out:
        what = f"e.g. {other[0]!r}" if other else "no LoRA weights"
        raise RecipeError(
            f"grpo.rollout_engine vllm sends vLLM a LoRA adapter; this run trains other weights ({what}): "
            "use grpo.rollout_engine engine"
        )
    return out


def write_adapter(
    directory: Path, payload: dict[str, torch.Tensor], peft_config: dict[str, Any], base: str
) -> Path:
    """`payload` (adapter_payload's) and its config in vLLM's layout under `directory`: target_modules the
    adapted modules' names (vLLM matches names, not peft's regex or `all-linear`). Returns `directory`."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    modules = {k.removeprefix(PREFIX).rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in payload}
    config = {k: v for k, v in peft_config.items() if k != "target_modules"}
    config |= {"target_modules": sorted(modules), "base_model_name_or_path": base, "peft_type": "LORA"}
    save_file({k: v.cpu() for k, v in payload.items()}, str(directory / WEIGHTS), metadata={"format": "pt"})
    (directory / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    return directory


def prompt_lists(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Each row's prompt tokens without its padding."""
    return [row[m.bool()].tolist() for row, m in zip(input_ids.cpu(), attention_mask.cpu(), strict=True)]


def completion_request(model: str, prompt: list[int], seed: int, sampling: dict[str, Any]) -> dict[str, Any]:
    """The /v1/completions body asking a vLLM server for one sampled completion of `prompt` (token ids) under
    the adapter loaded as `model`, as token ids (vLLM's return_token_ids)."""
    return {
        "model": model,
        "prompt": prompt,
        "n": 1,
        "seed": seed,
        "temperature": sampling.get("temperature", 1.0),
        "top_p": sampling.get("top_p", 1.0),
        "top_k": sampling.get("top_k") or -1,
        "max_tokens": sampling["max_new_tokens"],
        "skip_special_tokens": False,
        "return_token_ids": True,
    }


def as_generate_output(
    input_ids: torch.Tensor, completions: list[list[int]], pad_token_id: int, eos_token_id: int
) -> torch.Tensor:
    """Engine.generate's layout: the (left-padded) prompts, then each completion up to and including its EOS,
    padded with `pad_token_id` to the longest."""
    cut = [c[: c.index(eos_token_id) + 1] if eos_token_id in c else c for c in completions]
    width = max((len(c) for c in cut), default=0)
    out = torch.full((len(cut), width), pad_token_id, dtype=torch.long)
    for i, c in enumerate(cut):
        out[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    return torch.cat([input_ids.cpu(), out], dim=1)


class VllmRollouts:
    """Generation for RolloutSteps from vLLM, sent the Engine's adapter before each window (see the module
    docstring). `base`: the base model's path; `workdir`: where each window's adapter is written;
    `llm_options`: more of vllm.LLM's arguments (colocated: dtype, enforce_eager, ...)."""

    def __init__(self, engine, base: str, peft_config: dict[str, Any], workdir: Path, *, server: str | None,
                 gpu_memory_utilization: float = 0.3, max_model_len: int | None = None, **llm_options: Any):  # fmt: skip
        config = getattr(getattr(engine, "module", None), "config", None)
        if getattr(config, "is_encoder_decoder", False):
            raise RecipeError(
                "grpo.rollout_engine vllm: vLLM generates for causal LMs only; FLAN-T5 and T5Gemma use "
                "grpo.rollout_engine engine"
            )
        self.engine, self.base, self.peft_config, self.workdir = engine, base, peft_config, Path(workdir)
        self.server = server.rstrip("/") if server else None
        self.version, self.name = 0, "lorakit-policy-0"
        self.llm = None
        if self.server is None:
            vllm = _vllm()
            rank = int(peft_config.get("r", 8))
            # Several training processes: each one's engine on its own GPU, inside the launcher's group (as
            # TRL's colocate mode runs it).
            launcher = {"distributed_executor_backend": "external_launcher"} if dist.world_size() > 1 else {}
            self.llm = vllm.LLM(self.base, enable_lora=True, max_lora_rank=max(rank, 8), max_loras=1,
                                enable_sleep_mode=True, gpu_memory_utilization=gpu_memory_utilization,
                                max_model_len=max_model_len, **launcher, **llm_options)  # fmt: skip
            self.llm.sleep(level=1)

    def describe(self) -> str:
        """Which engine generates, for the run's summary: `vllm (colocated)` or `vllm (server URL)`."""
        return f"vllm (server {self.server})" if self.server else "vllm (colocated)"

    def begin(self) -> None:
        """Before a window's rollouts: wake vLLM and send it the adapter as trained so far (collective)."""
        payload = adapter_payload(self.engine.trainable_state())
        self.version += 1
        self.name = f"lorakit-policy-{self.version}"
        here = self.workdir / f"adapter-{self.version}" / (f"rank{dist.rank()}" if self.llm else "")
        if self.llm is not None:
            self.llm.wake_up()
            self._adapter_dir = write_adapter(here, payload, self.peft_config, self.base)
            return
        if dist.is_main():
            write_adapter(here, payload, self.peft_config, self.base)
            self._post("/v1/load_lora_adapter", {"lora_name": self.name, "lora_path": str(here)})
            if self.version > 1:
                self._post("/v1/unload_lora_adapter", {"lora_name": f"lorakit-policy-{self.version - 1}"})
        dist.barrier()  # every process asks for completions once the server holds the new adapter

    def end(self) -> None:
        """After a window's rollouts: colocated vLLM sleeps (KV cache freed, weights to CPU) while training."""
        if self.llm is not None:
            self.llm.sleep(level=1)

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **sampling: Any
    ) -> torch.Tensor:
        """Engine.generate's answer from vLLM: the prompts then their sampled completions. The seed of row i
        is the current torch seed (RolloutSteps forks and seeds it from its own generator) plus i."""
        seed, prompts = torch.initial_seed() % 2**31, prompt_lists(input_ids, attention_mask)
        if self.llm is not None:
            completions = self._generate_here(prompts, seed, sampling)
        else:
            bodies = [completion_request(self.name, p, seed + i, sampling) for i, p in enumerate(prompts)]
            completions = [list(self._post("/v1/completions", b)["choices"][0]["token_ids"]) for b in bodies]
        return as_generate_output(input_ids, completions, sampling["pad_token_id"], sampling["eos_token_id"])

    def _generate_here(self, prompts, seed: int, sampling: dict[str, Any]) -> list[list[int]]:
        vllm = _vllm()
        from vllm.lora.request import LoRARequest

        params = [
            vllm.SamplingParams(
                n=1,
                seed=seed + i,
                temperature=sampling.get("temperature", 1.0),
                top_p=sampling.get("top_p", 1.0),
                top_k=sampling.get("top_k") or -1,
                max_tokens=sampling["max_new_tokens"],
            )  # fmt: skip
            for i in range(len(prompts))
        ]
        request = LoRARequest(self.name, self.version, str(self._adapter_dir))
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=request,
                                 use_tqdm=False)  # fmt: skip
        return [list(o.outputs[0].token_ids) for o in outs]

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import urllib.request

        request = urllib.request.Request(self.server + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                text = response.read().decode()
        except OSError as e:
            raise RecipeError(f"grpo.vllm_server {self.server}: {path} failed: {e}") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return {"text": text}
