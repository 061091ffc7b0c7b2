"""Merge-and-export: a LoRA adapter merged into its base (or a full fine-tuning run re-exported) as one
ordinary transformers model, verified against the model it came from. See docs/merge.md."""

from lorakit.export.job import MergeResult, merge
from lorakit.export.verify import RELATIVE_TOLERANCE

__all__ = ["RELATIVE_TOLERANCE", "MergeResult", "merge"]
