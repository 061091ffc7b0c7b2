"""Throughput and memory meters: tokens/s, packing efficiency, peak memory."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory() -> dict[str, int | None]:
    """Peak accelerator memory allocated by torch and peak resident CPU memory of this process, in bytes."""
    gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is KiB on Linux, bytes on macOS.
    return {"gpu": gpu, "cpu_rss": int(rss if sys.platform == "darwin" else rss * 1024)}


class TokenMeter:
    """Counts useful tokens (non-pad) and token slots (padding included) as batches go by."""

    def __init__(self) -> None:
        self.real = 0
        self.slots = 0
        self.samples = 0

    def add(self, batch: dict) -> None:
        self.real += int(batch["num_real_tokens"])
        self.slots += int(batch["num_token_slots"])
        # A packed row holds several examples: collators say how many.
        self.samples += int(batch["num_examples"])

    def efficiency(self) -> float:
        """Useful tokens / token slots: 1.0 means no compute was spent on padding."""
        return self.real / self.slots if self.slots else 0.0
