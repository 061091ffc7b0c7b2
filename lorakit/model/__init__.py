"""Model: loading, attention backend choice, LoRA and gradient checkpointing."""

from lorakit.model.build import BuiltModel, build_model, count_parameters, load_config, load_tokenizer

__all__ = ["BuiltModel", "build_model", "count_parameters", "load_config", "load_tokenizer"]
