"""The export formats, as entries of one registry: what each reads (the verified merged model or the
adapter), the model types it is for, and how it is written and checked; how each is served is in
lorakit/export/serving.py.

To add a format: a module in lorakit/export/ with `write(job) -> EngineCheck`, an entry in FORMATS naming it,
its serve command in lorakit/export/serving.py, its optional dependency in lorakit/export/engines.py, a row in docs/export.md, and a test beside
tests/integration/test_export_ct2.py. See docs/export.md.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from lorakit.errors import MergeError

DOC = "docs/export.md"


@dataclass(frozen=True)
class Format:
    """One export format. `reads`: "merged" (lorakit merges first, verified) or "adapter"."""

    name: str
    reads: str
    model_types: tuple[str, ...]
    quantizations: tuple[str, ...]
    writer: str  # "module:function", imported only when the format is used

    def check_model_type(self, model_type: str) -> None:
        """Refuse, in one line, a model type the format (or its check) does not cover."""
        if model_type not in self.model_types:
            raise MergeError(
                f"--format {self.name}: model type {model_type!r} is not supported "
                f"(supported: {', '.join(self.model_types)})",
                doc=f"{DOC}#formats",
            )

    def check_quantization(self, quantization: str | None) -> str:
        """The quantization asked for, or the format's first (unquantized) one; refuses others."""
        q = quantization or self.quantizations[0]
        if q not in self.quantizations:
            raise MergeError(
                f"--quantization {q!r}: --format {self.name} takes {', '.join(self.quantizations)}",
                doc=f"{DOC}#formats",
            )
        return q

    def write(self, job: ExportJob):
        """Write the export of `job` and check it with the engine; returns its EngineCheck."""
        module, function = self.writer.split(":")
        return getattr(importlib.import_module(module), function)(job)


@dataclass(frozen=True)
class ExportJob:
    """What a format's writer is given: the merged model directory (None for an adapter format), the
    adapter directory (None for a full run), the base model, and where to write (a private directory that
    becomes the output only when the writer returns)."""

    format: Format
    merged: Path | None
    adapter: Path | None
    base_source: str
    model_type: str
    out: Path
    quantization: str
    llama_cpp: Path | None = None


# Not gemma2 for ct2: CTranslate2 4.8.5's Gemma 2 loader drops its attention and final logit soft-capping.
CAUSAL_GGUF = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2")
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format(
            "ct2",
            "merged",
            ("t5", "mt5", "llama", "mistral", "qwen2", "qwen3", "gemma3_text"),
            ("float32", "float16", "int8", "int8_float32", "int8_float16", "bfloat16"),
            "lorakit.export.ct2:write",
        ),
        Format(
            "gguf",
            "merged",
            CAUSAL_GGUF,
            ("f16", "bf16", "f32", "q8_0"),
            "lorakit.export.gguf:write",
        ),
        Format(
            "gguf-lora",
            "adapter",
            CAUSAL_GGUF,
            ("f16", "bf16", "f32", "q8_0"),
            "lorakit.export.gguf:write_adapter",
        ),
        Format(
            "vllm",
            "adapter",
            ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen3_moe"),
            ("none",),
            "lorakit.export.vllm:write",
        ),
    )
}


def format_named(name: str) -> Format:
    """The registered format `name`; refuses an unknown one in one line."""
    if name not in FORMATS:
        raise MergeError(f"--format {name!r}: choose one of {', '.join(FORMATS)}", doc=f"{DOC}#formats")
    return FORMATS[name]
