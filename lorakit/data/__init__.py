"""Data: sources, templates, tokenization, on-disk cache, batching and collation.

Names are imported on first use, so `lorakit.data.samples` loads without torch and datasets.
"""

from importlib import import_module

_EXPORTS = {
    "IGNORE_INDEX": "lorakit.data.collate",
    "CausalCollator": "lorakit.data.collate",
    "PackedCausalCollator": "lorakit.data.collate",
    "PackedSeq2SeqCollator": "lorakit.data.collate",
    "Seq2SeqCollator": "lorakit.data.collate",
    "PreparedData": "lorakit.data.prepared",
    "prepare_data": "lorakit.data.pipeline",
    "BalancedRandomBatchSampler": "lorakit.data.balanced",
    "LengthGroupedBatchSampler": "lorakit.data.sampler",
    "TokenBudgetBatchSampler": "lorakit.data.token_budget",
    "Batching": "lorakit.data.micro_batches",
    "make_batching": "lorakit.data.batching",
    "MultipackBatchSampler": "lorakit.data.multipack",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lorakit.data' has no attribute {name!r}")
