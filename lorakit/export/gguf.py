"""GGUF: the merged model (f16/bf16/f32/q8_0) converted by llama.cpp's own convert_hf_to_gguf.py, and the
LoRA adapter by its convert_lora_to_gguf.py, run from a llama.cpp checkout (--llama-cpp DIR or
$LORAKIT_LLAMA_CPP; the llama-cpp-python sdist's vendor/llama.cpp is one, docs/export.md#install) with the
`gguf` package. Where llama-cpp-python is installed, the merged GGUF is loaded by it and checked against
transformers' log-probabilities (the teacher-forced measure of lorakit/export/greedy.py: llama.cpp keeps its KV
cache in f16, as llama-server does by default, so no GGUF is computed in float32 throughout); elsewhere the
README says it was not checked.

llama.cpp recognizes a BPE tokenizer by the hash of its pre-tokenizer's output on a fixed text: a tokenizer
trained locally (lorakit's tiny ones) has an unknown hash and its converter refuses it
("BPE pre-tokenizer was not recognized"). A SentencePiece tokenizer.model converts whatever its vocabulary,
so the base's tokenizer.model is carried into the merged directory (transformers 5 does not save it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from lorakit.errors import MergeError
from lorakit.export.engines import available, engine
from lorakit.export.formats import ExportJob
from lorakit.export.greedy import NEW_TOKENS, EngineCheck, Reference, judge, reference
from lorakit.export.result import say

DOC = "docs/export.md#gguf"
ENV = "LORAKIT_LLAMA_CPP"
KV_CACHE = "f16"  # llama.cpp's default K and V cache type (llama-server's --cache-type-k/-v), set explicitly


def scripts(job: ExportJob) -> Path:
    """The llama.cpp checkout holding the converter scripts; refuses in one line when there is none."""
    where = job.llama_cpp or (Path(os.environ[ENV]) if os.environ.get(ENV) else None)
    if where is None or not (where / "convert_hf_to_gguf.py").is_file():
        raise MergeError(
            f"--format {job.format.name}: needs llama.cpp's converter scripts: pass --llama-cpp DIR (or set "
            f"${ENV}) to a llama.cpp checkout holding convert_hf_to_gguf.py"
            + (f" ({where} has none)" if where else ""),
            doc=DOC,
        )
    return where


def _run(script: Path, args: list[str]) -> None:
    """Run one of llama.cpp's converter scripts; its last error line becomes a one-line MergeError."""
    engine("gguf", "GGUF export")
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
    if done.returncode != 0:
        lines = [x for x in done.stderr.strip().splitlines() if x.strip()] or ["(no output)"]
        raise MergeError(f"llama.cpp's {script.name} failed: {lines[-1]}", doc=DOC)


def write(job: ExportJob) -> EngineCheck | None:
    """The merged model as model-QUANT.gguf in `job.out`, checked by llama-cpp-python where installed."""
    tools = scripts(job)
    base_sp = Path(job.base_source) / "tokenizer.model"
    if base_sp.is_file() and not (job.merged / "tokenizer.model").is_file():
        shutil.copyfile(base_sp, job.merged / "tokenizer.model")
    out = job.out / f"model-{job.quantization}.gguf"
    say(f"converting: {job.merged} to GGUF ({job.quantization}) with {tools / 'convert_hf_to_gguf.py'}")
    _run(
        tools / "convert_hf_to_gguf.py",
        [str(job.merged), "--outfile", str(out), "--outtype", job.quantization],
    )
    if not available("llama_cpp"):
        say("not checked by the engine: llama-cpp-python is not installed (docs/export.md#install)")
        return None
    check = check_gguf(out, reference(job.merged), job.quantization)
    say(check.describe())
    return check


def write_adapter(job: ExportJob) -> None:
    """The LoRA adapter as adapter-QUANT.gguf in `job.out` (llama.cpp's --lora), converted against its base."""
    tools = scripts(job)
    out = job.out / f"adapter-{job.quantization}.gguf"
    say(f"converting: {job.adapter} to a GGUF LoRA adapter ({job.quantization}) with convert_lora_to_gguf.py")
    args = [str(job.adapter), "--base", job.base_source, "--outfile", str(out), "--outtype", job.quantization]
    _run(tools / "convert_lora_to_gguf.py", args)


def check_gguf(path: Path, ref: Reference, quantization: str, lora: Path | None = None) -> EngineCheck:
    """Load `path` (with the GGUF adapter `lora`, applied at run time) in llama-cpp-python; greedy tokens and
    teacher-forced log-probabilities of the reference continuations, judged against `ref`."""
    import numpy as np
    from llama_cpp import GGML_TYPE_F16, Llama

    llm = Llama(
        str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2, seed=0,
        lora_path=str(lora) if lora else None, type_k=GGML_TYPE_F16, type_v=GGML_TYPE_F16,
    )  # fmt: skip
    got, logprobs = [], []
    for prompt, cont in zip(ref.prompts, ref.continuations, strict=True):
        llm.reset()
        tokens = []
        for t in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(int(t))
            if len(tokens) == NEW_TOKENS or t == ref.eos:
                break
        got.append(tokens)
        llm.reset()
        llm.eval(prompt + cont)
        scores = np.asarray(llm.scores[: len(prompt) + len(cont)], dtype=np.float64)
        logp = scores - np.logaddexp.reduce(scores, axis=-1, keepdims=True)
        logprobs.append([float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(cont)])
    import llama_cpp

    adapter = tensor_type(lora) if lora else None
    name = f"llama-cpp-python {llama_cpp.__version__}"
    return judge(name, ref, got, logprobs, quantization, adapter=adapter, kv_cache=KV_CACHE)


def tensor_type(path: Path) -> str:
    """The coarsest tensor type in the GGUF file `path` (f32, f16, bf16, q8_0), as the export names it: what
    llama.cpp computes that file's products with."""
    reader = engine("gguf", "GGUF check").GGUFReader(str(path))
    types = sorted(
        {t.tensor_type.name.lower() for t in reader.tensors} - {"f32"}, key=lambda q: ("8" not in q, q)
    )
    return types[0] if types else "f32"
