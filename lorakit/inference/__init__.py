"""Running trained models: generate on new inputs with the run's prompts (generate), and score a run on
any split of its data as training does (evaluate). See docs/inference.md."""

from lorakit.inference.generation import GenerateResult, generate
from lorakit.inference.split_eval import EvaluateResult, evaluate

__all__ = ["EvaluateResult", "GenerateResult", "evaluate", "generate"]
