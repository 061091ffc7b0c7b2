"""Generation speed of each export (CTranslate2; GGUF with $LORAKIT_LLAMA_CPP and llama-cpp-python) of a tiny
T5 and a tiny Llama adapter against transformers' generate, NEW greedy tokens per prompt, CPU:
`PYTHONPATH=$PWD python benchmarks/export_speed.py [--out benchmarks/results/export_speed.md]`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

NEW = 64
PROMPTS = [
    "The city council met on Tuesday to discuss the new park.",
    "A storm closed schools",
    "Prices rose",
] * 4


def _hf(model_dir: Path, tok, seq2seq: bool) -> float:
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    model = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(model_dir).eval()
    n, t0 = 0, time.perf_counter()
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        n += out.shape[1] - (1 if seq2seq else ids.shape[1])
    return n / (time.perf_counter() - t0)


def _ct2(directory: Path, tok, seq2seq: bool) -> float:
    import ctranslate2

    batches = [tok.convert_ids_to_tokens(tok(p)["input_ids"]) for p in PROMPTS]
    n, t0 = 0, time.perf_counter()
    threads = {"device": "cpu", "inter_threads": 1, "intra_threads": 2}
    if seq2seq:
        tr = ctranslate2.Translator(str(directory), **threads)
        for b in batches:
            r = tr.translate_batch([b], beam_size=1, max_decoding_length=NEW, min_decoding_length=NEW)
            n += len(r[0].hypotheses[0])
    else:
        gen = ctranslate2.Generator(str(directory), **threads)
        for b in batches:
            r = gen.generate_batch(
                [b], max_length=NEW, min_length=NEW, sampling_topk=1, include_prompt_in_result=False
            )
            n += len(r[0].sequences[0])
    return n / (time.perf_counter() - t0)


def _gguf(path: Path, tok) -> float:
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=256, verbose=False, n_threads=2)
    n, t0 = 0, time.perf_counter()
    for p in PROMPTS:
        for i, _ in enumerate(llm.generate(tok(p)["input_ids"], top_k=1, temp=0.0, reset=True)):
            if i + 1 == NEW:
                break
        n += NEW
    return n / (time.perf_counter() - t0)


def main() -> None:
    """Export, time and write the result table."""
    import ctranslate2
    import transformers

    from lorakit.export.exporting import export
    from lorakit.export.job import merge
    from tests.export_fixtures import llama_with_sentencepiece, random_adapter

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/export_speed.md")
    args = p.parse_args()
    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache = tmp / "cache"
        base = llama_with_sentencepiece(cache, tmp / "llama-sp")
        adapters = {
            "t5": random_adapter("t5", cache, tmp / "a-t5"),
            "llama": random_adapter("llama", cache, tmp / "a-llama", base=str(base)),
        }
        for kind, adapter in adapters.items():
            seq2seq, merged = kind == "t5", tmp / f"m-{kind}"
            merge(adapter, merged, dtype="float32")
            tok = transformers.AutoTokenizer.from_pretrained(merged)
            rows.append((kind, "transformers generate (float32)", _hf(merged, tok, seq2seq)))
            for q in ("float32", "int8"):
                export(adapter, tmp / f"ct2-{kind}-{q}", format="ct2", quantization=q)
                rows.append((kind, f"CTranslate2 {q}", _ct2(tmp / f"ct2-{kind}-{q}", tok, seq2seq)))
            llama_cpp = os.environ.get("LORAKIT_LLAMA_CPP")
            if not seq2seq and llama_cpp and importlib.util.find_spec("llama_cpp"):
                for q in ("f16", "q8_0"):
                    export(adapter, tmp / f"gguf-{q}", format="gguf", quantization=q, llama_cpp=llama_cpp)
                    gguf = _gguf(tmp / f"gguf-{q}" / f"model-{q}.gguf", tok)
                    rows.append((kind, f"llama.cpp GGUF {q}", gguf))
    lines = [
        "# Export generation speed (CPU, tiny models)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs visible, 2 threads used; "
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"ctranslate2 {ctranslate2.__version__}. {len(PROMPTS)} prompts, {NEW} greedy tokens each, batch 1.",
        "Command: `PYTHONPATH=$PWD python benchmarks/export_speed.py`. Tiny random models (hidden 32-64): the "
        "numbers show each engine's per-token overhead, not real-model throughput.",
        "",
        "| model | engine | tokens/s |",
        "|---|---|---|",
        *[f"| tiny {k} | {e} | {v:.0f} |" for k, e, v in rows],
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
