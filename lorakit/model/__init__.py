"""Model: loading, attention backend choice, LoRA and gradient checkpointing.

Names are imported on first use: `lorakit.model.source` (config and tokenizer, what the launcher and
`lorakit.prepare` need) loads without peft and the modeling code that `lorakit.model.build` imports.
"""

from importlib import import_module

_EXPORTS = {
    "BuiltModel": "lorakit.model.build",
    "build_model": "lorakit.model.build",
    "count_parameters": "lorakit.model.build",
    "load_config": "lorakit.model.source",
    "load_tokenizer": "lorakit.model.source",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lorakit.model' has no attribute {name!r}")
