"""How to serve a fine-tune, one command per engine, in one place: an export's README.md gives its format's
command (lorakit.export), and a merged model's card (lorakit.merge) gives one for each engine that serves its
model type (docs/export.md#serving-one-command-per-engine)."""

from __future__ import annotations

from lorakit.export.formats import FORMATS

# {out}: the export's directory; {base}: the base model; {engine}: CTranslate2's Translator or Generator.
COMMANDS = {
    "ct2": "python -c \"import ctranslate2; print(ctranslate2.{engine}('{out}', device='cpu'))\"",
    "gguf": "llama-server -m {out}/model-{quantization}.gguf",
    "gguf-lora": "llama-server -m BASE.gguf --lora {out}/adapter-{quantization}.gguf",
    "vllm": "vllm serve {base} --enable-lora --lora-modules adapter={out}",
}


def serve_command(fmt: str, out, quantization: str, base: str, seq2seq: bool = False) -> str:
    """The one command that serves an export of format `fmt` written to `out`."""
    engine = "Translator" if seq2seq else "Generator"
    return COMMANDS[fmt].format(out=out, quantization=quantization, base=base, engine=engine)


def merged_model_lines(auto_class: str, model_type: str | None) -> list[str]:
    """The merged model card's "Serve it" section: transformers, then vLLM, llama.cpp and CTranslate2 where
    lorakit's formats cover `model_type` (None when unknown: transformers only)."""
    here = "path/to/this/directory"
    lines = [
        "## Serve it",
        "",
        "transformers:",
        "",
        "```python",
        f"from transformers import {auto_class}, AutoTokenizer",
        "",
        f'model = {auto_class}.from_pretrained("{here}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{here}")',
        "```",
    ]
    engines = []
    if model_type in FORMATS["vllm"].model_types:
        engines.append(("vLLM", f"vllm serve {here}"))
    if model_type in FORMATS["gguf"].model_types:
        gguf = serve_command("gguf", f"{here}-gguf", "q8_0", here)
        export = f"python -m lorakit.export {here} --format gguf --quantization q8_0 --output {here}-gguf"
        engines.append(("llama.cpp (docs/export.md#gguf)", f"{export} && {gguf}"))
    if model_type in FORMATS["ct2"].model_types:
        seq2seq = auto_class == "AutoModelForSeq2SeqLM"
        ct2 = serve_command("ct2", f"{here}-ct2", "int8", here, seq2seq=seq2seq)
        export = f"python -m lorakit.export {here} --format ct2 --quantization int8 --output {here}-ct2"
        engines.append(("CTranslate2", f"{export} && {ct2}"))
    for name, command in engines:
        lines += ["", f"{name}:", "", "```bash", command, "```"]
    return lines


def model_type_of(model_class: str) -> str | None:
    """The transformers model type whose causal-LM or seq2seq class is `model_class` (None if none is)."""
    from transformers.models.auto import modeling_auto as auto

    for names in (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES):
        for model_type, cls in names.items():
            if cls == model_class:
                return model_type
    return None
