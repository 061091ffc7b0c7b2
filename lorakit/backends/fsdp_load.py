"""FSDP2's sharded loading: host memory per node about one model, not one per process.

build_model loads the base on the meta device (`from_pretrained(device_map="meta")`: the structure, ties and
dtypes a real load gives, no weights); the adapter's weights are made real and initialised as peft does
(`materialize_adapter`, the same random stream on every rank); fully_shard then shards the meta model and
`read_shards` allocates each rank's shards and fills them with its own rows of every tensor, read from the
checkpoint's safetensors (memory-mapped: the file's pages are the page cache's, shared by every process of
the node, not the process's own), cast to model.dtype as from_pretrained casts. No rank ever holds a whole
weight it does not need; the ranks together hold one model.

Taken for LoRA and full fine-tuning from safetensors (`eligible`); 4-bit bases (quantized while loading),
inits that read the base weights (DoRA, PiSSA, OLoRA) and pickle checkpoints load whole in every process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lorakit.errors import RecipeError


def eligible(recipe) -> bool:
    """Whether the recipe's model loads sharded: LoRA (plain init) or full fine-tuning, from safetensors."""
    m = recipe.method
    plain_lora = m.kind == "lora" and not m.use_dora and not m.mutates_base()
    return (plain_lora or m.kind == "full") and not recipe.model.allow_pickle


def has_meta(model: torch.nn.Module) -> bool:
    """Whether any parameter of `model` is still on the meta device."""
    return any(p.is_meta for p in model.parameters())


def materialize_adapter(model: torch.nn.Module) -> None:
    """Make the LoRA weights of a meta-loaded model real and initialise them as peft does (A random, B zero),
    from the random stream build_model seeded: the same values on every rank."""
    from peft.tuners.lora import LoraLayer

    configs = getattr(model, "peft_config", {})
    for m in model.modules():
        if isinstance(m, LoraLayer):
            for name in m.lora_A:
                m.lora_A[name].to_empty(device="cpu")
                m.lora_B[name].to_empty(device="cpu")
                m.reset_lora_parameters(name, configs[name].init_lora_weights)


def _checkpoint_files(source: str, revision: str | None) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file holding it (sharded checkpoints through their index)."""
    directory = Path(source)
    if not directory.is_dir():
        from huggingface_hub import snapshot_download

        directory = Path(snapshot_download(source, revision=revision, allow_patterns=["*.safetensors*"]))
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: directory / f for k, f in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        raise RecipeError(
            f"distributed.strategy fsdp: no safetensors weights in {directory} to read shards from"
        )
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return dict.fromkeys(f.keys(), single)


def _checkpoint_name(name: str, keys: dict[str, Path]) -> str | None:
    """The checkpoint key of a model parameter or buffer name (peft's prefixes and base_layer removed)."""
    plain = name.replace("_fsdp_wrapped_module.", "").removeprefix("base_model.model.")
    plain = plain.replace(".base_layer.", ".")
    return plain if plain in keys else None


def _aliases(model: torch.nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter (tied weights have several), by parameter id."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return names


def _local_rows(p) -> tuple[int, int]:
    """The rows [start, end) of the whole tensor this rank's shard of DTensor `p` holds (FSDP2 shards dim 0
    as torch.chunk does, over the mesh's shard dimension)."""
    from torch.distributed.tensor import Shard

    start, rows = 0, p.shape[0] if p.dim() else 1
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            n = p.device_mesh.size(dim)
            chunk = -(-rows // n)
            start += chunk * p.device_mesh.get_coordinate()[dim]
            rows = max(0, min(chunk, rows - chunk * p.device_mesh.get_coordinate()[dim]))
    return start, start + rows


def keep_buffers(model: torch.nn.Module, config: Any) -> dict[str, torch.Tensor]:
    """The model's buffers by name, to restore after to_empty: the real ones as they are, those a meta load
    left on the meta device (rotary frequencies...) as the model's classes compute them, from a skeleton
    built with its parameters on the meta device and its buffers real."""
    from accelerate import init_empty_weights
    from transformers import AutoModel

    real = {
        f"{mn}.{n}": b.clone() for mn, m in model.named_modules() for n, b in m.named_buffers(recurse=False)
        if not b.is_meta
    }  # fmt: skip
    if len(real) == len(list(model.buffers())):
        return real
    with init_empty_weights(include_buffers=False):
        skeleton = AutoModel.from_config(config)
    computed = {n.rsplit(".", 1)[-1] + "@" + type(m).__name__: b for mn, m in skeleton.named_modules()
                for n, b in m.named_buffers(recurse=False)}  # fmt: skip
    out = real
    for module_name, m in model.named_modules():
        for n, b in m.named_buffers(recurse=False):
            if b.is_meta:
                key = n + "@" + type(m).__name__
                if key not in computed:
                    raise RecipeError(f"distributed.strategy fsdp: cannot rebuild buffer {module_name}.{n}")
                out[f"{module_name}.{n}"] = computed[key].clone()
    return out


def read_shards(model: torch.nn.Module, source: str, revision: str | None, dtype: torch.dtype,
                adapter: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], device) -> None:  # fmt: skip
    """Allocate this rank's shards of the fully_shard-ed meta model and fill them: base weights from the
    checkpoint (only this rank's rows, cast to `dtype`, then to the shard's dtype), the adapter's weights from
    `adapter` (whole, by parameter name), the buffers from `buffers`."""
    from safetensors import safe_open

    keys = _checkpoint_files(source, revision)
    aliases = _aliases(model)
    model.to_empty(device=device)
    handles: dict[Path, Any] = {}
    try:
        with torch.no_grad():
            for name, p in model.named_parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                start, end = _local_rows(p) if hasattr(p, "placements") else (0, p.shape[0])
                plain = name.replace("_fsdp_wrapped_module.", "")
                if plain in adapter:
                    whole = adapter[plain]
                else:
                    key = next((k for a in aliases[id(p)] if (k := _checkpoint_name(a, keys))), None)
                    if key is None:
                        raise RecipeError(
                            f"distributed.strategy fsdp: {name} is not in the checkpoint's safetensors; "
                            "this checkpoint cannot load sharded"
                        )
                    f = handles.get(keys[key]) or handles.setdefault(
                        keys[key], safe_open(str(keys[key]), "pt")
                    )
                    whole = f.get_slice(key)
                if end > start:
                    rows = whole[start:end] if p.dim() else whole[:]
                    local.copy_(rows.to(dtype).to(local.dtype).reshape(local.shape))
            for name, b in buffers.items():
                owner, _, attr = name.rpartition(".")
                model.get_submodule(owner)._buffers[attr] = b.to(device)
    finally:
        handles.clear()
