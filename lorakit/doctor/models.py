"""The models the doctor runs: small models of the recipe's architecture, built locally (no hub), loaded
through lorakit.model.build_model so they get the attention backend, packing, dtype, adapter and
checkpointing the recipe would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lorakit.model.families import family_of
from lorakit.testing import TINY_VOCAB_SIZE

# The tiny tokenizer's ids (lorakit.testing.SPECIAL_TOKENS: <pad> 0, </s> 1, <unk> 2, <s> 3).
SPECIAL_IDS = {"bos_token_id": 3, "eos_token_id": 1, "pad_token_id": 0, "decoder_start_token_id": 0}


def small_kind(config) -> str | None:
    """The tiny kind standing in for `config`'s architecture: its family's, when the family has a tiny
    builder (mT5 is T5's); None when there is none (the generic family)."""
    family = family_of(config)
    return family.name if family.tiny is not None else None


def recipe_config(recipe):
    """The recipe's model config without weights: the planner's offline lookup (tiny models, a local
    config.json, its table of known hub models), else the hub (or its local cache) as training loads it."""
    from lorakit.planner.arch import resolve_config
    from lorakit.planner.units import PlanError

    try:
        return resolve_config(recipe)
    except PlanError:
        from lorakit.model import load_config

        return load_config(recipe)[1]


def with_model(recipe, name_or_path: str, **model: Any):
    """`recipe` with another model.name_or_path (and model keys), LoRA dropout off: what the contracts and
    the speed check build, with everything else (dtype, attention, packing, method) as the recipe says."""
    updates = {"name_or_path": name_or_path, **model}
    update: dict[str, Any] = {"model": recipe.model.model_copy(update=updates)}
    if recipe.method.adapter() and hasattr(recipe.method, "dropout"):
        update["method"] = recipe.method.model_copy(update={"dropout": 0.0})
    return recipe.model_copy(update=update)


# Another architecture's small build: two blocks, hidden size 64, and a sliding window short enough for the
# contracts' examples to cross it.
SMALL_WIDTH, SMALL_DEPTH, SMALL_WINDOW = 64, 2, 64


def contract_model(recipe, device: str = "cpu"):
    """A small model of the recipe's architecture as training builds it (BuiltModel), ready for the
    contracts (non-zero adapter, dropout off, train mode), on `device`: lorakit.testing's tiny model of its
    kind, else its own config at SMALL_WIDTH and SMALL_DEPTH with random weights, saved to a temporary
    directory."""
    import tempfile

    from lorakit.doctor.contracts import prepare_for_contract
    from lorakit.model import build_model

    config = recipe_config(recipe)
    kind = small_kind(config)
    if kind is not None:
        built = build_model(with_model(recipe, f"tiny:{kind}"))
    else:
        with tempfile.TemporaryDirectory(prefix="lorakit-doctor-small-") as tmp:
            window = {"sliding_window": SMALL_WINDOW} if getattr(config, "sliding_window", None) else {}
            save_block_model(config, Path(tmp), recipe.model.dtype, SMALL_WIDTH, SMALL_DEPTH, **window)
            built = build_model(with_model(recipe, tmp))
    built.model.to(device)
    return prepare_for_contract(built)


# Config keys that set a model's depth; one block of each stack is what the speed check times.
_DEPTH_KEYS = ("num_hidden_layers", "num_layers", "num_decoder_layers")
# Width keys scaled down together on CPU (heads keep their size; their number shrinks).
_WIDTH_KEYS = ("hidden_size", "intermediate_size", "d_model", "d_ff")
_HEAD_KEYS = ("num_attention_heads", "num_key_value_heads", "num_heads")


def block_config(config, max_width: int | None = None, depth: int = 1) -> tuple[dict[str, Any], float]:
    """`config` as a dict with `depth` blocks per stack and a small vocabulary (the head is not the block's
    work); with `max_width`, widths scaled down so the hidden size is at most that. Returns the dict and the
    scale applied to the widths (1.0 when none). A multimodal config's blocks are its language model's
    (Gemma 3's text_config): the vision tower is not what a training step spends its time in."""
    from lorakit.model.families.base import text_config

    config = text_config(config)
    raw = config.to_dict()
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    for key in _DEPTH_KEYS:
        if key in raw and raw[key]:
            raw[key] = depth
    if raw.get("layer_types"):
        # One layer of each kind the model mixes (full and sliding attention), as far as depth allows.
        kinds = list(dict.fromkeys(raw["layer_types"]))[:depth]
        raw["layer_types"] = kinds + kinds[-1:] * (depth - len(kinds))
    hidden = raw.get("hidden_size") or raw.get("d_model")
    scale = 1.0
    if max_width is not None and hidden and hidden > max_width:
        scale = max_width / hidden
        for key in _WIDTH_KEYS:
            if raw.get(key):
                raw[key] = max(8, int(raw[key] * scale))
        for key in _HEAD_KEYS:
            if raw.get(key):
                raw[key] = max(1, int(round(raw[key] * scale)))
        if raw.get("head_dim") is None and raw.get("num_attention_heads") and raw.get("hidden_size"):
            # Keep the head size of the real model: fewer heads, not narrower ones.
            raw["head_dim"] = config.hidden_size // config.num_attention_heads
    raw["vocab_size"] = TINY_VOCAB_SIZE  # lorakit.testing's tokenizer, which build_model loads with it
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        # The real model's special ids may lie outside the small vocabulary; the tiny tokenizer's are 0-3.
        if isinstance(raw.get(key), int) and raw[key] >= TINY_VOCAB_SIZE or isinstance(raw.get(key), list):
            raw[key] = SPECIAL_IDS.get(key, 1)
    return raw, scale


def save_block_model(
    config, directory: Path, dtype: str, max_width: int | None = None, depth: int = 1, **fields: Any
) -> float:
    """Save a random model of `config` with `depth` blocks per stack (block_config; `fields` replace config
    fields) and the tiny tokenizer into `directory`, so build_model loads it as it would the real one;
    returns the width scale."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from lorakit.testing import build_tiny_tokenizer

    raw, scale = block_config(config, max_width, depth)
    raw.update({k: v for k, v in fields.items() if k in raw})
    model_type = raw.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **raw)
    enc_dec = bool(getattr(cfg, "is_encoder_decoder", False))
    build_tiny_tokenizer(directory, kind="t5" if enc_dec else "llama")
    auto_cls = AutoModelForSeq2SeqLM if enc_dec else AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = auto_cls.from_config(cfg, dtype=getattr(torch, dtype))
    model.save_pretrained(str(directory))
    return scale
