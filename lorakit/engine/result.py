"""What a training job hands back to the process that started it, kept apart from engine/job.py so that the
launcher (lorakit.api over torchrun) reads it without importing the model and DeepSpeed stack."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Written by rank 0 when training stops early with its own exit code (preempted, diverged).
EXIT = "exit.json"


@dataclass(frozen=True)
class TrainResult:
    """What lorakit.train returns: the run directory and its summary."""

    run_dir: Path
    summary: dict[str, Any]
    # True when the run directory already held this recipe's finished run: nothing was trained again.
    already_complete: bool = False
