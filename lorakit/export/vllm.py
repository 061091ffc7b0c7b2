"""vLLM's adapter layout: the LoRA adapter as vLLM's LoRA loader reads it (peft's file names, every key
`base_model.model.<module of the base>.lora_A|lora_B.weight`, adapter_config.json with an explicit
target_modules list), after a check that names, one line each, what vLLM would drop or refuse:

- MoE parameter adapters (peft's target_parameters on fused experts): vLLM loads the adapter and silently
  leaves the experts unadapted (vLLM#34186);
- adapters on the embedding or the LM head, and modules_to_save (full copies of modules): vLLM serves LoRA on
  linear layers only;
- DoRA (use_dora): vLLM has no DoRA kernels;
- prefix-drifted keys: a key whose module path names no module of the base (an extra or missing `model.`),
  which vLLM's loader skips or rejects.

Each refusal offers the merged model instead (python -m lorakit.merge). vLLM is not installed here (it needs
CUDA): tests/gpu/test_vllm_export.py loads the export in vLLM on a GPU and compares with transformers.
"""

from __future__ import annotations

import json
import shutil

import torch

from lorakit.errors import MergeError
from lorakit.export.adapter import CONFIG, PREFIX, SAFETENSORS
from lorakit.export.formats import ExportJob

UNSERVED_MODULES = ("embed_tokens", "lm_head", "wte", "shared", "embed_out")
DOC = "docs/export.md#vllm"


def layout_problems(adapter_dir, base_modules: set[str]) -> list[str]:
    """One line per thing vLLM would drop or refuse in the adapter at `adapter_dir`, given the names of the
    base model's modules (empty: servable as it is)."""
    from safetensors import safe_open

    config = json.loads((adapter_dir / CONFIG).read_text())
    problems = []
    if config.get("target_parameters"):
        problems.append(
            f"target_parameters {config['target_parameters']}: MoE parameter adapters on fused experts, which "
            "vLLM loads and silently ignores (vLLM#34186)"
        )
    if config.get("use_dora"):
        problems.append("use_dora: vLLM has no DoRA support")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save {config['modules_to_save']}: vLLM loads LoRA weights only")
    drifted, unserved = [], []
    with safe_open(str(adapter_dir / SAFETENSORS), "pt") as f:
        keys = list(f.keys())
    for key in keys:
        module = key.removeprefix(PREFIX).rsplit(".lora_", 1)[0]
        if not key.startswith(PREFIX) or module not in base_modules:
            drifted.append(key)
        elif module.rsplit(".", 1)[-1] in UNSERVED_MODULES:
            unserved.append(module)
    if drifted:
        problems.append(
            f"{len(drifted)} key(s) name no module of the base (prefix drift), e.g. {drifted[0]!r}: "
            f"vLLM expects {PREFIX}<module path of the base>"
        )
    if unserved:
        problems.append(f"adapters on {sorted(set(unserved))[:3]}: vLLM serves LoRA on linear layers only")
    return problems


def base_module_names(base_source: str) -> set[str]:
    """The module paths of the base model, built on the meta device (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name for name, _ in model.named_modules()}


def write(job: ExportJob) -> None:
    """Check the adapter for vLLM and write it in vLLM's layout into `job.out`; refuses (MergeError) with
    one line per problem and the merge command to use instead."""
    problems = layout_problems(job.adapter, base_module_names(job.base_source))
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise MergeError(
            f"--format vllm: vLLM would not serve this adapter as trained:\n{lines}\n"
            f"  serve the merged model instead: python -m lorakit.merge {job.adapter} --output MERGED_DIR",
            doc=DOC,
        )
    config = json.loads((job.adapter / CONFIG).read_text())
    from safetensors import safe_open

    with safe_open(str(job.adapter / SAFETENSORS), "pt") as f:
        modules = {k.removeprefix(PREFIX).rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in f.keys()}
    # vLLM matches target_modules by module name; a regex or "all-linear" is peft's shorthand, not vLLM's.
    config["target_modules"] = sorted(modules)
    config["base_model_name_or_path"] = job.base_source
    (job.out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(job.adapter / SAFETENSORS, job.out / SAFETENSORS)
    (job.out / "lorakit_export.json").write_text(
        json.dumps({"format": "vllm", "rank": config.get("r"), "target_modules": config["target_modules"]})
        + "\n"
    )
