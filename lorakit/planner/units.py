"""The planner's units: its stated tolerance, and the byte sizes and PlanError it shares with the rest of
lorakit (defined below it, in lorakit.units and lorakit.errors, so that storage and the doctor need not
import the planner)."""

from __future__ import annotations

from lorakit.errors import PlanError
from lorakit.units import format_bytes, parse_bytes

# The planner's stated tolerance (docs/planning.md): setups it recommends leave this much of the GPU free.
HEADROOM = 0.9

__all__ = ["HEADROOM", "PlanError", "format_bytes", "parse_bytes"]
