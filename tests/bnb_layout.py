"""Force bitsandbytes' answer to "does this CPU have AVX512-BF16?", so both of its CPU code paths are tested
on every machine (CI lands on CPUs with and without the instructions).

bitsandbytes asks its native library (`lib.has_avx512bf16_cpu()`, through
`bitsandbytes.functional.has_avx512bf16`) when a `Linear4bit` is built, and uses the answer to decide whether
the layer may switch to its CPU inference layout. Forcing the library's answer forces that decision for every
layer built afterwards, exactly where bitsandbytes makes it. (Which gemv kernel bitsandbytes registered at
import is not changed: that is decided once, before any test can act.)

Launched processes get it through tests/integration/faults/sitecustomize.py and LORAKIT_BNB_AVX512BF16=0|1.
"""

from __future__ import annotations

ENV = "LORAKIT_BNB_AVX512BF16"


def force_avx512bf16(flag: bool) -> None:
    """Make bitsandbytes report `flag` for AVX512-BF16 support from now on, in this process."""
    from bitsandbytes.cextension import lib

    lib.has_avx512bf16_cpu = lambda: flag
