"""Running trained models: generate on new inputs with the run's prompts (generate). See
docs/inference.md."""

from lorakit.inference.generation import GenerateResult, generate

__all__ = ["GenerateResult", "generate"]
