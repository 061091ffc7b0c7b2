"""What a saved LoRA (DoRA, rsLoRA, ...) or IA3 adapter holds, and the checks that refuse one that cannot be
merged.

Refused before anything is written, each with a message saying what is wrong:
- empty: no adapter_model.safetensors (or .bin), a zero-size or unreadable file, no LoRA tensors, or
  tensors with no elements (what a ZeRO-3 save that wrote each rank's empty partition leaves behind);
- without effect: every LoRA pair has an all-zero B (or A), or every IA3 vector is all ones, so merging
  would export the base unchanged (an adapter saved before training, or a broken ZeRO-3 save); non-finite
  values;
- for another base: the base's architecture differs from the one the adapter was trained on, a module the
  adapter adapts is missing from the base, or a LoRA matrix (IA3 vector) does not fit its module's shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lorakit.errors import AdapterError

CONFIG = "adapter_config.json"
SAFETENSORS = "adapter_model.safetensors"
PICKLE = "adapter_model.bin"
# peft's saved keys: base_model.model.<module path>.lora_A.weight (the adapter name is stripped on save).
PREFIX = "base_model.model."
_A, _B = (".lora_A.weight", ".lora_embedding_A"), (".lora_B.weight", ".lora_embedding_B")
# IA3: base_model.model.<module path>.ia3_l, shaped (out, 1), or (1, in) for a feedforward module.
_IA3 = ".ia3_l"
MERGEABLE = ("LORA", "IA3")

# Config entries that fix the shapes and wiring an adapter was trained for (names differ per family).
SIGNATURE_KEYS = (
    "model_type",
    "is_encoder_decoder",
    "hidden_size",
    "d_model",
    "intermediate_size",
    "d_ff",
    "num_hidden_layers",
    "num_layers",
    "num_decoder_layers",
    "num_attention_heads",
    "num_heads",
    "num_key_value_heads",
)


@dataclass(frozen=True)
class Adapter:
    """A saved LoRA or IA3 adapter: its directory, peft config and tensors (on CPU), by module path."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    # LoRA: module path -> (A, B); the module paths as named in the base model.
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    # IA3: module path -> its scaling vector.
    vectors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def modules(self) -> list[str]:
        """The module paths the adapter adapts."""
        return sorted(set(self.pairs) | set(self.vectors))

    @property
    def base_name(self) -> str | None:
        """The base model recorded by peft when the adapter was saved."""
        return self.config.get("base_model_name_or_path")

    def describe(self) -> str:
        """One line: rank, alpha (LoRA), how many modules it adapts."""
        if self.vectors:
            return f"IA3 adapter {self.path} ({len(self.vectors)} modules)"
        return (
            f"LoRA adapter {self.path} (r={self.config.get('r')}, alpha={self.config.get('lora_alpha')}, "
            f"{len(self.pairs)} modules)"
        )


def _split(key: str) -> tuple[str, str] | None:
    """(module path, 'A' | 'B') for a LoRA matrix key, else None."""
    for side, suffixes in (("A", _A), ("B", _B)):
        for suffix in suffixes:
            if key.endswith(suffix):
                return key.removeprefix(PREFIX).removesuffix(suffix), side
    return None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    weights = path / SAFETENSORS
    if not weights.is_file() and (path / PICKLE).is_file():
        weights = path / PICKLE
    if not weights.is_file():
        raise AdapterError(
            f"{path}: empty adapter, no {SAFETENSORS}: only the configuration was saved (a ZeRO-3 save that "
            "never gathered the weights does this); nothing to merge",
            doc="docs/merge.md#what-is-checked",
        )
    if weights.stat().st_size == 0:
        raise AdapterError(
            f"{weights}: empty adapter, the weights file is 0 bytes; nothing to merge",
            doc="docs/merge.md#what-is-checked",
        )
    try:
        if weights.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(weights), device="cpu")
        return torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any parse failure means the same thing to the user
        raise AdapterError(
            f"{weights}: cannot read the adapter weights ({e}); the file is damaged",
            doc="docs/merge.md#what-is-checked",
        ) from e


def read_adapter(path: str | Path) -> Adapter:
    """Load an adapter directory and refuse it when it is empty, has no effect, or holds non-finite values."""
    path = Path(path)
    cfg_file = path / CONFIG
    if not cfg_file.is_file():
        raise AdapterError(f"{path}: no {CONFIG}; not a PEFT adapter directory", doc="docs/merge.md#options")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{cfg_file}: not valid JSON ({e})") from e
    if config.get("peft_type") not in MERGEABLE:
        raise AdapterError(
            f"{cfg_file}: peft_type {config.get('peft_type')!r}; only LoRA and IA3 adapters merge",
            doc="docs/merge.md#options",
        )
    tensors = _read_tensors(path)
    empty = sorted(k for k, t in tensors.items() if t.numel() == 0)
    if empty:
        raise AdapterError(
            f"{path}: empty adapter, {len(empty)} of {len(tensors)} tensors have no elements (e.g. "
            f"{empty[0]}): a ZeRO-3 save that wrote each rank's empty partition; nothing to merge",
            doc="docs/merge.md#what-is-checked",
        )
    bad = sorted(k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all())
    if config["peft_type"] == "IA3":
        return _ia3_adapter(path, config, tensors, bad)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        split = _split(key)
        if split is not None:
            halves.setdefault(split[0], {})[split[1]] = tensor
    pairs = {m: (h["A"], h["B"]) for m, h in halves.items() if {"A", "B"} <= set(h)}
    if not pairs:
        raise AdapterError(
            f"{path}: empty adapter, no LoRA tensors (lora_A/lora_B) among its {len(tensors)} tensors; "
            "nothing to merge",
            doc="docs/merge.md#what-is-checked",
        )
    unpaired = sorted(set(halves) - set(pairs))
    if unpaired:
        raise AdapterError(
            f"{path}: LoRA module {unpaired[0]} has only one of lora_A / lora_B; damaged save",
            doc="docs/merge.md#what-is-checked",
        )
    _refuse_nonfinite(path, bad)
    if not any(a.any() and b.any() for a, b in pairs.values()):
        raise AdapterError(
            f"{path}: the adapter has no effect: lora_B (or lora_A) is all zeros in every one of its "
            f"{len(pairs)} modules, so the merged model would be the base unchanged. It was saved before any "
            "training step, or by a broken ZeRO-3 save",
            doc="docs/merge.md#what-is-checked",
        )
    return Adapter(path, config, tensors, pairs)


def _refuse_nonfinite(path: Path, bad: list[str]) -> None:
    if bad:
        raise AdapterError(
            f"{path}: {len(bad)} tensors hold NaN or inf (e.g. {bad[0]}); training diverged",
            doc="docs/merge.md#what-is-checked",
        )


def _ia3_adapter(path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], bad: list[str]):
    """An IA3 adapter: one scaling vector per module, initialised to ones (no effect)."""
    vectors = {k.removeprefix(PREFIX).removesuffix(_IA3): t for k, t in tensors.items() if k.endswith(_IA3)}
    if not vectors:
        raise AdapterError(
            f"{path}: empty adapter, no IA3 vectors (ia3_l) among its {len(tensors)} tensors; nothing to merge",
            doc="docs/merge.md#what-is-checked",
        )
    _refuse_nonfinite(path, bad)
    if all(bool((v == 1).all()) for v in vectors.values()):
        raise AdapterError(
            f"{path}: the adapter has no effect: every one of its {len(vectors)} IA3 vectors is all ones, so "
            "the merged model would be the base unchanged. It was saved before any training step",
            doc="docs/merge.md#what-is-checked",
        )
    return Adapter(path, config, tensors, {}, vectors)


def config_signature(config) -> dict[str, Any]:
    """The architecture facts an adapter depends on, from a transformers config."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return {k: d[k] for k in SIGNATURE_KEYS if d.get(k) is not None}


def check_same_architecture(trained_on: dict[str, Any], base: dict[str, Any], what: str) -> None:
    """Refuse a base whose architecture differs from the one the adapter was trained on."""
    diff = [
        f"{k} {trained_on[k]!r} -> {base[k]!r}"
        for k in SIGNATURE_KEYS
        if k in trained_on and k in base and trained_on[k] != base[k]
    ]
    if diff:
        raise AdapterError(
            f"the adapter does not match the base {what}: " + "; ".join(diff),
            doc="docs/merge.md#what-is-checked",
        )


def _module_shape(module: torch.nn.Module) -> tuple[str, int, int] | None:
    """(kind, in, out) of a module LoRA can adapt, or None when lorakit does not know its layout."""
    if isinstance(module, torch.nn.Embedding):
        return "embedding", module.num_embeddings, module.embedding_dim
    weight = getattr(module, "weight", None)
    if isinstance(module, torch.nn.Linear) or (
        weight is not None and hasattr(module, "in_features") and hasattr(module, "out_features")
    ):
        return "linear", module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and weight is not None and weight.dim() == 2:
        return "linear", weight.shape[0], weight.shape[1]  # GPT-2's Conv1D stores (in, out)
    return None


def check_fits(adapter: Adapter, model: torch.nn.Module, base: str) -> None:
    """Refuse an adapter whose modules are missing from `model` or whose matrices do not fit them."""
    # peft nests a ParamWrapper per targeted parameter of one module (an MoE's fused experts): the second
    # one's tensors are saved under MODULE.base_layer.
    modules = dict(model.named_modules())
    modules.update({f"{n}.base_layer": m for n, m in list(modules.items()) if n})
    missing = [m for m in adapter.modules if m not in modules]
    if missing:
        raise AdapterError(
            f"the adapter does not match the base {base}: {len(missing)} of its {len(adapter.modules)} modules "
            f"are not in the base (e.g. {missing[0]}); it was trained on another model",
            doc="docs/merge.md#what-is-checked",
        )
    wrong = []
    for name, (a, b) in sorted(adapter.pairs.items()):
        shape = _module_shape(modules[name])
        if shape is None:
            continue  # peft checks layouts lorakit does not know
        # Linear: A (r, in), B (out, r); embedding: A (r, num_embeddings), B (embedding_dim, r).
        _, fan_in, fan_out = shape
        expect_a, expect_b = (a.shape[0], fan_in), (fan_out, b.shape[-1])
        if tuple(a.shape) != expect_a or tuple(b.shape) != expect_b or a.shape[0] != b.shape[-1]:
            wrong.append(
                f"{name}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} for a {fan_in} -> {fan_out} layer"
            )
    for name, vector in sorted(adapter.vectors.items()):
        shape = _module_shape(modules[name])
        # IA3 scales a layer's output (out, 1), or a feedforward layer's input (1, in).
        if shape is not None and tuple(vector.shape) not in ((shape[2], 1), (1, shape[1])):
            wrong.append(f"{name}: IA3 vector {tuple(vector.shape)} for a {shape[1]} -> {shape[2]} layer")
    if wrong:
        raise AdapterError(
            f"the adapter does not match the base {base}: {len(wrong)} modules have other shapes "
            f"(e.g. {wrong[0]}); it was trained on another model size",
            doc="docs/merge.md#what-is-checked",
        )
