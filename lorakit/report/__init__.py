"""Comparing finished runs (LoRA, QLoRA, full fine-tuning) on quality, memory, speed and cost: report.md and
PNG plots. See docs/compare.md."""

from lorakit.report.comparison import DEFAULT_GPU_HOUR_PRICE, DEFAULT_OUTPUT, Comparison, compare
from lorakit.report.runs import CompareError, RunRow, read_run

__all__ = [
    "DEFAULT_GPU_HOUR_PRICE",
    "DEFAULT_OUTPUT",
    "CompareError",
    "Comparison",
    "RunRow",
    "compare",
    "read_run",
]
