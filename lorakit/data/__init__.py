"""Data: sources, templates, tokenization, on-disk cache, batching and collation.

Names are imported on first use, so `lorakit.data.samples` loads without torch and datasets.
"""

from lorakit.lazy import lazy_names

__all__, __getattr__ = lazy_names(
    __name__,
    {
        "lorakit.data.collate": (
            "IGNORE_INDEX",
            "CausalCollator",
            "PackedCausalCollator",
            "PackedSeq2SeqCollator",
            "Seq2SeqCollator",
        ),
        "lorakit.data.prepare": ("PreparedData", "prepare_data"),
        "lorakit.data.balanced": ("BalancedRandomBatchSampler",),
        "lorakit.data.sampler": ("LengthGroupedBatchSampler",),
        "lorakit.data.token_budget": ("TokenBudgetBatchSampler",),
        "lorakit.data.batching": ("Batching", "make_batching"),
        "lorakit.data.multipack": ("MultipackBatchSampler",),
    },
)
