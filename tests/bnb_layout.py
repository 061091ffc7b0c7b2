"""Force bitsandbytes' answer to "does this CPU have AVX512-BF16?", so both of its CPU code paths are tested
on every machine (CI lands on CPUs with and without the instructions).

bitsandbytes asks its native library (`lib.has_avx512bf16_cpu()`, through
`bitsandbytes.functional.has_avx512bf16`) when a `Linear4bit` is built, and uses the answer to decide whether
the layer may switch to its CPU inference layout. Forcing the library's answer forces that decision for every
layer built afterwards, exactly where bitsandbytes makes it. In this process (force_avx512bf16) the CPU
kernels bitsandbytes registered at import stay as they were; launched processes
(tests/integration/faults/sitecustomize.py, LORAKIT_BNB_AVX512BF16=0|1) are forced as bitsandbytes loads its
native library, before it registers them, so there both decisions follow the forced answer.
"""

from __future__ import annotations

ENV = "LORAKIT_BNB_AVX512BF16"


def force_avx512bf16(flag: bool) -> None:
    """Make bitsandbytes report `flag` for AVX512-BF16 support from now on, in this process."""
    from bitsandbytes.cextension import lib

    lib.has_avx512bf16_cpu = lambda: flag


class _AfterImport:
    """A meta-path finder that runs `then(module)` once `name` has been imported, wherever the import is."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_and_then(module):
            exec_module(module)
            then(module)

        spec.loader.exec_module = exec_and_then
        return spec


def force_avx512bf16_when_imported(flag: bool) -> None:
    """force_avx512bf16 as soon as bitsandbytes loads its native library, without importing it now: a launched
    process then imports bitsandbytes exactly when and where it would (after lorakit's console setup)."""
    import sys

    if "bitsandbytes.cextension" in sys.modules:
        force_avx512bf16(flag)
        return

    def force(module):
        module.lib.has_avx512bf16_cpu = lambda: flag

    sys.meta_path.insert(0, _AfterImport("bitsandbytes.cextension", force))
