"""QLoRA: the frozen base quantized to 4 bits with bitsandbytes, and what that saves.

bitsandbytes is an optional dependency (`pip install "lorakit[qlora]"`) and this is the only module that
imports it, lazily. Everything else recognises a 4-bit weight by its `quant_state`, without the import.

Choices (docs/qlora.md explains them):
- compute dtype and quant-storage dtype are both model.dtype: the packed 4-bit weights are stored in
  tensors of the same dtype as every other parameter, so ZeRO-3 partitions and gathers one dtype only
  (as peers do for ZeRO-3 and FSDP; DeepSpeed 0.19.8 also coped with uint8 storage in our CPU check), and
  DeepSpeed's bf16 engine has nothing to cast;
- no peft `prepare_model_for_kbit_training`: in peft 0.21 it upcasts every non-4-bit parameter
  (embeddings, norms, output head, T5's `wo`) to fp32, which DeepSpeed's bf16 engine casts straight back
  (a wasted peak of twice their size), and its input-grad hook is only needed for reentrant checkpointing.
  What it does that matters (freezing the base, non-reentrant checkpointing) build.py does anyway;
- modules that transformers keeps out of quantization (the output head; `_keep_in_fp32_modules`, which
  for T5 is every `wo`) stay unquantized in model.dtype and are listed in summary.json;
- every 4-bit layer lorakit loads keeps bitsandbytes' standard layout, never its CPU inference layout
  (`keep_standard_4bit_layout` says why).
"""

from __future__ import annotations

from typing import Any

import torch

from lorakit.errors import RecipeError

INSTALL_HINT = 'pip install "lorakit[qlora]"'


def require_bitsandbytes():
    """Import bitsandbytes, or stop with an error that names the extra to install."""
    try:
        import bitsandbytes
    except ImportError as e:
        raise RecipeError(
            f"method.kind qlora needs bitsandbytes, which cannot be imported ({e}); install it with "
            f"{INSTALL_HINT}, or use method.kind: lora",
            doc="docs/qlora.md#install",
        ) from e
    return bitsandbytes


def bnb_config(quant_type: str, dtype: torch.dtype):
    """transformers' BitsAndBytesConfig for a 4-bit base: `quant_type` (nf4/fp4), double quantization,
    compute and storage in `dtype`."""
    require_bitsandbytes()
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        # Quantizes the per-block scales too: ~0.37 bits per parameter less, no measurable quality loss
        # (QLoRA paper).
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,
    )


def check_keep_in_fp32(model_cls, dtype: torch.dtype) -> None:
    """Refuse fp16 for models that transformers keeps partly in fp32 (T5's `wo`): DeepSpeed's fp16 engine
    casts every parameter to fp16, so the layers that overflow in fp16 would run in fp16 after all."""
    keep = sorted(getattr(model_cls, "_keep_in_fp32_modules", None) or [])
    if dtype == torch.float16 and keep:
        raise RecipeError(
            f"model.dtype float16: {model_cls.__name__} keeps {keep} in float32 under fp16 because they "
            "overflow in fp16, but DeepSpeed's fp16 engine casts every parameter to fp16; use model.dtype: "
            "bfloat16 (fp32's range, so those layers are safe in it) or float32",
            doc="docs/qlora.md#flan-t5-and-its-fp32-wo-layers",
        )


def keep_standard_4bit_layout(model: torch.nn.Module) -> int:
    """Pin every bitsandbytes 4-bit linear layer of `model` to the standard 4-bit layout; returns how many.

    Why: bitsandbytes (0.49+) on CPUs with AVX512-BF16 (`bitsandbytes.functional.has_avx512bf16()`, read
    once per layer into `Linear4bit.support_avx512bf16_for_cpu`) rewrites a layer's weight in place into a
    CPU inference layout ([N, K/2] uint8 tiles, bf16 scales) the first time the layer runs in eval mode
    without grad, i.e. at lorakit's first evaluation. That layout is for inference only and breaks training:
    - its kernel has no autograd formula: after the first eval no gradient flows back through any frozen
      4-bit layer, so every layer below the last one trains on a wrong gradient, silently (ZeRO-2 and one
      process too: tests/unit/test_quantize.py);
    - under ZeRO-3 the weight's storage is DeepSpeed's: the rewrite lands in the gathered buffer, which is
      then released, while the quantization state still says "CPU layout", so the next gather computes with
      mislabelled weights, and `state_dict()` (every checkpoint) asserts on the flat partition
      ("packed_weight should be [N, K/2]").
    The flag is the switch bitsandbytes itself reads in `forward`; with it off a layer computes exactly as it
    does on CPUs without AVX512-BF16 (dequantize, then matmul). GPUs never take the CPU layout. Layers of a
    bitsandbytes without the flag (< 0.49) have no CPU layout, and setting it is harmless there.
    """
    linear4bit = require_bitsandbytes().nn.Linear4bit
    pinned = 0
    for m in model.modules():
        if isinstance(m, linear4bit):
            m.support_avx512bf16_for_cpu = False
            pinned += 1
    return pinned


def pin_quant_states(model: torch.nn.Module) -> int:
    """Keep each bitsandbytes 4-bit layer's quantization state (absmax, code, blocksize, shape, nested state)
    on the layer itself as well as on its weight; returns how many layers. FSDP2 replaces every parameter by a
    DTensor shard and, for each forward, by the plain gathered tensor: both drop the Params4bit subclass and
    its `quant_state`. bitsandbytes' Linear4bit.forward re-attaches the layer's `quant_state` to whatever
    weight it finds (`fix_4bit_weight_quant_state_from_module`), so the state rides through sharding,
    all-gathers and checkpoints whole on every rank (it is small: one byte per 64 weights), as under ZeRO-3."""
    linear4bit = require_bitsandbytes().nn.Linear4bit
    pinned = 0
    for m in model.modules():
        if isinstance(m, linear4bit) and is_4bit(m.weight):
            m.quant_state = m.weight.quant_state
            m.quant_storage = m.weight.dtype
            pinned += 1
    return pinned


def _module_quant_states(model: torch.nn.Module) -> dict[int, Any]:
    """Quantization state by parameter id: the weight's own, or its layer's where FSDP2 sharding replaced the
    weight by a DTensor (pin_quant_states)."""
    states = {}
    for m in model.modules():
        for name, w in getattr(m, "_parameters", {}).items():
            # A 4-bit expert stack (model/quant_experts.py) carries its state on the parameter, as bnb's weights do.
            # FSDP2's DTensors drop the attribute: the module keeps the states too (pin_quant_states, quant_states).
            qs = (
                getattr(w, "quant_state", None)
                or getattr(m, "quant_states", {}).get(name)
                or (getattr(m, "quant_state", None) if name == "weight" else None)
            )
            if w is not None and qs is not None and hasattr(qs, "shape"):
                states[id(w)] = qs
    return states


def _local_numel(p: torch.Tensor) -> int:
    """Elements of `p` this rank holds: its ZeRO-3 partition, its FSDP2 shard, or all of it."""
    if hasattr(p, "ds_tensor"):
        return int(p.ds_tensor.numel())
    if hasattr(p, "to_local"):
        return int(p.to_local().numel())
    return int(p.numel())


def is_4bit(p: torch.Tensor) -> bool:
    """Whether `p` is a bitsandbytes 4-bit weight (packed data plus a quantization state)."""
    return getattr(p, "quant_state", None) is not None


def logical_numel(p: torch.Tensor) -> int:
    """Number of weights `p` stands for: the unquantized shape of a 4-bit weight, and the full (not
    partitioned) size under ZeRO-3."""
    if is_4bit(p):
        return int(p.quant_state.shape.numel())
    return int(getattr(p, "ds_numel", p.numel()))


def _storage_bytes(p: torch.Tensor) -> int:
    # ds_numel: the whole tensor, even when ZeRO-3 has left this rank only its partition.
    return int(getattr(p, "ds_numel", p.numel())) * p.element_size()


def _quant_state_tensors(qs) -> list[torch.Tensor]:
    out = [qs.absmax, qs.code]
    if getattr(qs, "nested", False):
        out += [qs.state2.absmax, qs.state2.code, qs.offset]
    return [t for t in out if isinstance(t, torch.Tensor)]


def quantization_summary(model: torch.nn.Module, recipe) -> dict[str, Any]:
    """What summary.json records about a 4-bit base: the quantization settings, which linear layers were
    left unquantized, and the bytes of the frozen base in 4 bits against the same weights in `dtype`.

    Computed from the parameters (ds_numel under ZeRO-3, so the whole model, never one rank's partition):
    before = every base weight in model.dtype; after = 4-bit packed weights + their quantization constants
    (block scales, double-quantization scales and code tables, shared tables counted once) + the weights
    left unquantized. Quantization constants are not ZeRO-3 parameters: every rank holds a copy.
    `base_bytes_per_rank`: what this rank holds of the frozen base (its ZeRO-3 partition or FSDP2 shard of
    each weight, 4-bit ones still packed, plus the constants).
    """
    quant_type, dtype = recipe.method.quantization(), getattr(torch, recipe.model.dtype)
    before = after = constants = on_rank = 0
    quantized_params = experts = 0
    seen: set[int] = set()
    states = _module_quant_states(model)
    for p in model.parameters():
        if p.requires_grad:
            continue  # the adapter, not the base
        on_rank += _local_numel(p) * p.element_size()
        qs = states.get(id(p))
        if qs is not None:
            n = int(qs.shape.numel())
            quantized_params += n
            experts += n if len(qs.shape) == 3 else 0
            before += n * dtype.itemsize
            after += _storage_bytes(p)
            for t in _quant_state_tensors(qs):
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    constants += t.numel() * t.element_size()
        else:
            before += _storage_bytes(p)
            after += _storage_bytes(p)
    after += constants
    # Frozen plain linear layers by their last name (peft wraps each in a LoRA layer as `.base_layer`).
    unquantized = sorted(
        {
            name.removesuffix(".base_layer").rsplit(".", 1)[-1]
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and id(m.weight) not in states and not m.weight.requires_grad
        }
    )
    return {
        "type": f"bitsandbytes-{quant_type}",
        "bits": 4,
        "double_quant": True,
        "compute_dtype": str(dtype).removeprefix("torch."),
        "storage_dtype": str(dtype).removeprefix("torch."),
        "quantized_params": quantized_params,
        # Of those, the fused MoE expert stacks (lorakit.model.quant_experts); the rest are linear layers.
        "quantized_expert_params": experts,
        "unquantized_linear": unquantized,
        "base_bytes": {
            "before": before,
            "after": after,
            "saved": before - after,
            "quant_constants": constants,
        },
        "base_bytes_per_rank": on_rank + constants,
    }


def describe_quantization(q: dict[str, Any]) -> str:
    """One line for the terminal at start: the 4-bit type and the memory it saves."""
    b = q["base_bytes"]
    line = (
        f"quantization: {q['type']} (double quant, compute/storage {q['compute_dtype']}): frozen base "
        f"{_size(b['before'])} -> {_size(b['after'])} ({b['saved'] / max(b['before'], 1):.0%} saved), "
        f"{_size(q['base_bytes_per_rank'])} on this rank"
    )
    if q.get("quantized_expert_params"):
        line += f"; fused experts in 4 bits too ({q['quantized_expert_params']:,} weights)"
    if q["unquantized_linear"]:
        line += "; left unquantized: " + ", ".join(q["unquantized_linear"])
    return line


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
