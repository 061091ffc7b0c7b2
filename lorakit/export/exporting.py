"""One export: resolve the source (a run directory or an adapter), merge it with lorakit's verified merge
when the format reads the merged model, hand it to the format's writer (which converts with the engine's own
code and checks the result with the engine), and publish the output directory atomically with a README that
says how to serve it."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from lorakit.errors import MergeError
from lorakit.export.formats import DOC, ExportJob, format_named
from lorakit.export.greedy import EngineCheck
from lorakit.export.loading import auto_model_class
from lorakit.export.output import atomic_directory, check_output
from lorakit.export.result import say
from lorakit.export.serving import serve_command
from lorakit.export.sources import locate


@dataclass(frozen=True)
class ExportResult:
    """Where the export went, in what format and quantization, and what the engine's check found."""

    output: Path
    format: str
    quantization: str
    check: EngineCheck | None
    serve: str


def export(
    source: str | Path,
    output: str | Path,
    *,
    format: str,
    quantization: str | None = None,
    base: str | None = None,
    force: bool = False,
    llama_cpp: str | Path | None = None,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
) -> ExportResult:
    """Export a run (or an adapter / full model directory) to `format` (ct2, gguf, gguf-lora, vllm; see
    lorakit.export.formats.FORMATS) in `output`, checked by the engine that serves it. `quantization`: one
    of the format's (default: its unquantized one). `llama_cpp`: a llama.cpp checkout (GGUF formats).
    Nothing is left in `output` when a step or the check fails."""
    fmt = format_named(format)
    q = fmt.check_quantization(quantization)
    src = locate(source, base, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    protect = [src.path] + ([Path(src.base_source)] if Path(src.base_source).is_dir() else [])
    out = check_output(Path(output), force, protect)
    _, config = auto_model_class(src)
    model_type = config.get_text_config().model_type if fmt.name != "ct2" else config.model_type
    fmt.check_model_type(model_type)
    adapter = src.path if src.kind == "adapter" else None
    if fmt.reads == "adapter" and adapter is None:
        raise MergeError(
            f"--format {fmt.name} exports an adapter, and {src.path} is a full fine-tuning run: "
            "export it with --format ct2 or gguf",
            doc=f"{DOC}#formats",
        )
    tools = Path(llama_cpp) if llama_cpp else None
    with atomic_directory(out, force) as tmp, tempfile.TemporaryDirectory(dir=out.parent) as work:
        merged = None
        if fmt.reads == "merged":
            from lorakit.export.job import merge

            merged = Path(work) / "merged"
            say(f"export: merging {src.path} first (verified, float32), then converting to {fmt.name}")
            merge(source, merged, dtype="float32", base=base, trust_remote_code=trust_remote_code,
                  allow_pickle=allow_pickle)  # fmt: skip
        job = ExportJob(fmt, merged, adapter, src.base_source, model_type, tmp, q, tools)
        check = fmt.write(job)
        serve = serve_command(fmt.name, out, q, src.base_name, seq2seq=_seq2seq(merged))
        (tmp / "README.md").write_text(readme(fmt.name, q, src.base_name, serve, check))
    say(f"saved:    {out} ({fmt.name}, {q})")
    return ExportResult(out, fmt.name, q, check, serve)


def _seq2seq(merged: Path | None) -> bool:
    """Whether the merged model is an encoder-decoder (CTranslate2 serves it with a Translator)."""
    if merged is None:
        return False
    import json

    return bool(json.loads((merged / "config.json").read_text()).get("is_encoder_decoder"))


def readme(fmt: str, quantization: str, base: str, serve: str, check: EngineCheck | None) -> str:
    """The export's README.md: what it is, how to serve it (one command), and what checked it."""
    checked = check.describe() if check is not None else "not checked by the engine here (see docs/export.md)"
    return (
        f"# {fmt} export ({quantization}) of a lorakit fine-tune of {base}\n\n"
        f"Written by `python -m lorakit.export --format {fmt}`.\n\n"
        f"## Serve it\n\n```bash\n{serve}\n```\n\n"
        f"## Checked\n\n{checked}\n\nSee docs/export.md in lorakit for the formats and their checks.\n"
    )
