"""The "did you mean" of an unknown recipe key: the name other tools give a key (HF Trainer, PEFT, TRL,
axolotl), a close spelling in the same section (difflib), or the same key in another section."""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel

# Names users bring from the rest of the ecosystem, by the key lorakit calls them (in any section).
ECOSYSTEM = {
    "learning_rate": "lr",
    "num_train_epochs": "epochs",
    "num_epochs": "epochs",
    "per_device_train_batch_size": "micro_batch_size",
    "train_batch_size": "micro_batch_size",
    "batch_size": "micro_batch_size",
    "per_device_eval_batch_size": "micro_batch_size",
    "lr_scheduler_type": "lr_schedule",
    "lr_scheduler": "lr_schedule",
    "warmup_steps": "warmup_ratio",
    "logging_steps": "log_every",
    "eval_steps": "every",
    "save_steps": "every",
    "save_total_limit": "keep",
    "lora_r": "r",
    "rank": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "lora_target_modules": "target_modules",
    "torch_dtype": "dtype",
    "attn_implementation": "attention",
    "model_name_or_path": "name_or_path",
    "base_model": "name_or_path",
    "max_seq_length": "max_length",
    "sequence_len": "max_length",
    "max_seq_len": "max_length",
    "output_dir": "dir",
    "dataset": "source",
    "dataset_name": "source",
    "gradient_accumulation": "gradient_accumulation_steps",
}


def _fields(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_fields


def _sections(recipe: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """The recipe's sections by name (an optional section `X | None` as X)."""
    out = {}
    for name, f in _fields(recipe).items():
        for option in typing.get_args(f.annotation) or (f.annotation,):
            if isinstance(option, type) and issubclass(option, BaseModel):
                out[name] = option
    return out


def did_you_mean(path: str, recipe: type[BaseModel]) -> str | None:
    """The dotted key an unknown `path` ("train.learning_rate") most likely meant, or None."""
    *parent, key = path.split(".")
    sections = _sections(recipe)
    if not parent:  # a section name
        close = difflib.get_close_matches(key, list(_fields(recipe)), n=1, cutoff=0.6)
        return close[0] if close else None
    if len(parent) != 1 or parent[0] not in sections:
        return None
    here = list(_fields(sections[parent[0]]))
    wanted = ECOSYSTEM.get(key, key)
    if wanted in here and wanted != key:
        return f"{parent[0]}.{wanted}"
    close = difflib.get_close_matches(key, here, n=1, cutoff=0.75)
    if close:
        return f"{parent[0]}.{close[0]}"
    # The right key in the wrong section (train.gradient_checkpointing is model.gradient_checkpointing).
    for name, section in sections.items():
        if wanted in _fields(section):
            return f"{name}.{wanted}"
    return None


def unknown_key_message(path: str, recipe: type[BaseModel]) -> str:
    """The line for an unknown key: the likely key when there is one, and where every key is listed."""
    guess = did_you_mean(path, recipe)
    hint = f"did you mean {guess}?" if guess else "check the spelling;"
    return f"unknown key ({hint} see docs/recipes.md for every key)"
