"""What both merges (in memory: export/job.py; shard by shard: export/stream_job.py) return, print and gate
on: the result, the streaming merge's tensor check, the terminal lines, and the check that refuses an
export."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorakit.disclosure import redact
from lorakit.errors import VerificationError
from lorakit.export.verify import Check


@dataclass(frozen=True)
class TensorCheck:
    """Every merged tensor against W + scale * B A; every written shard read back."""

    tensors: int  # tensors written
    merged: int  # of which had a LoRA delta added
    worst: float  # the largest residual, as a fraction of the rounding bound (at most 1 passes)

    def describe(self) -> str:
        """One line for the terminal and the model card."""
        return (
            f"tensors: {self.merged} merged tensors equal W + scale * B A within rounding (largest residual "
            f"{self.worst:.2g} of the bound); {self.tensors} tensors read back from the written shards as written"
        )


@dataclass(frozen=True)
class MergeOptions:
    """What lorakit.merge was asked, checked: handed to the streaming merge as one."""

    force: bool  # replace a non-empty output
    dtype: str  # of the exported weights
    tol: float  # relative logit tolerance
    shard_bytes: int  # largest safetensors shard
    verify: str  # the streaming merge's whole-model logits check: auto | always | never
    compare_quantized: bool  # QLoRA: also report the merge against the adapter on the 4-bit base


@dataclass(frozen=True)
class MergeResult:
    """What lorakit.merge returns: where the model went and what was checked."""

    output_dir: Path
    method: str  # lora, qlora or full
    base: str
    dtype: str
    shards: int
    # The checks that gate the export: merged vs adapter model (adapters), saved copy reloaded vs reference.
    checks: tuple[Check, ...]
    # QLoRA with compare_quantized: the merged model vs the adapter on the 4-bit base (reported, not gated).
    quantized: Check | None = None
    # stream (shard by shard) or memory (peft's merge_and_unload on the loaded model).
    strategy: str = "memory"
    # The streaming merge's check of every merged tensor against W + scale * B A.
    tensors: TensorCheck | None = None


def say(line: str) -> None:
    """One line of the merge's progress, printed at once (redacted: a note can quote another library's error)."""
    print(redact(line), flush=True)


def require(check: Check) -> Check:
    """Print `check`; refuse the export (VerificationError) when it failed."""
    say(check.describe())
    if not check.passed and not check.closer_than_base:
        raise VerificationError(
            f"merge refused, nothing written: {check.describe()}. The adapter's delta did not reach the "
            "merged weights (or barely moves the logits: then merge with --dtype float32, whose rounding "
            "noise is far below any adapter's effect)",
            doc="docs/merge.md#tolerances",
        )
    if not check.passed:
        raise VerificationError(
            f"merge refused, nothing written: {check.describe()}. The difference exceeds the tolerance: the "
            "export does not reproduce the model it came from. If it is rounding noise of a deep model in a "
            "16-bit dtype, merge with --dtype float32 or raise --tolerance",
            doc="docs/merge.md#tolerances",
        )
    return check
