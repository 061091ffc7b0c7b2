"""Byte sizes in and out: "40GB", "80GiB", 42949672960 -> bytes; bytes -> "37.3 GiB".

A foundation: the planner, the storage checks and the doctor all speak bytes."""

from __future__ import annotations

import re

from lorakit.errors import PlanError

# GPU makers and cloud consoles say "40GB" for 40 * 10^9 bytes (an A100 40GB has 40 * 10^9 B = 37.3 GiB
# usable to torch minus the context): decimal units are decimal, binary units binary.
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: int | float | str | None, field: str) -> int | None:
    """Bytes from an int, or a string such as "40GB", "80GiB", "1.5TB" (None stays None)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise PlanError(f"{field}: expected a size such as 40GB or 80GiB, got {value!r}")
    if isinstance(value, int | float):
        if value <= 0:
            raise PlanError(f"{field}: a size must be positive, got {value!r}")
        return int(value)
    m = _SIZE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise PlanError(f"{field}: expected a size such as 40GB, 80GiB or 1100GB, got {value!r}")
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n <= 0:
        raise PlanError(f"{field}: a size must be positive, got {value!r}")
    return int(n)


def format_bytes(n: float | None) -> str:
    """Human-readable binary size: 1.50 GiB, 12.0 MiB, 512 B."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
