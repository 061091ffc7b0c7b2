"""python -m lorakit.export --format ct2: tiny T5, Llama, Qwen2, Qwen3 and Gemma 3 adapters merged, converted by
CTranslate2's converter and checked by CTranslate2 itself against transformers' greedy tokens and
log-probabilities; the merged model card's CTranslate2 command, run."""

import json
from pathlib import Path

import pytest

from lorakit.errors import MergeError, VerificationError
from tests.export_fixtures import random_adapter

ctranslate2 = pytest.importorskip("ctranslate2")

from lorakit.export.exporting import export  # noqa: E402
from lorakit.export.greedy import NEW_TOKENS, PROMPTS, reference  # noqa: E402


class _Adapters(dict):
    """tiny:KIND's adapter, made on first use (a test of one family builds that family only)."""

    def __init__(self, base, cache_dir):
        super().__init__()
        self.base, self.cache_dir = base, cache_dir

    def __missing__(self, kind):
        self[kind] = random_adapter(kind, self.cache_dir, self.base / kind)
        return self[kind]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, cache_dir):
    return _Adapters(tmp_path_factory.mktemp("ct2-adapters"), cache_dir)


@pytest.mark.parametrize("kind", ["t5", "llama", "qwen2", "qwen3", "gemma3"])
def test_float32_export_generates_transformers_greedy_tokens(adapters, tmp_path, kind):
    result = export(adapters[kind], tmp_path / "ct2", format="ct2")
    check = result.check
    assert check.sequences_equal == check.sequences == len(PROMPTS)
    assert check.max_logprob_diff < 1e-4
    assert (tmp_path / "ct2" / "model.bin").is_file()
    readme = (tmp_path / "ct2" / "README.md").read_text()
    engine = "Translator" if kind == "t5" else "Generator"
    assert f"ctranslate2.{engine}('{tmp_path / 'ct2'}'" in readme and "passed" in readme
    from lorakit.export.ct2 import _vocabulary

    assert len(_vocabulary(tmp_path / "ct2")) > 100 and check.token_agreement == 1.0


@pytest.mark.parametrize(
    "kind,quantization",
    [
        ("t5", "int8_float32"),
        ("llama", "int8"),
        ("t5", "float16"),
        ("qwen3", "int8"),
        ("gemma3", "int8_float32"),
    ],
)
def test_quantized_export_within_the_stated_measure(adapters, tmp_path, kind, quantization):
    check = export(adapters[kind], tmp_path / "q", format="ct2", quantization=quantization).check
    assert check.passed and check.max_logprob_diff <= check.tolerance
    assert json.loads((tmp_path / "q" / "lorakit_export.json").read_text())["quantization"] == quantization


def test_the_merged_model_cards_ctranslate2_command_exports_it(adapters, tmp_path):
    """lorakit.merge's card says how to serve the merged model, one command per engine; its CTranslate2 line
    exports the merged directory (a full model: no second merge of an adapter) and loads it."""
    import shlex

    from lorakit.export.__main__ import main as export_main
    from lorakit.export.job import merge

    merge(adapters["gemma3"], tmp_path / "m", dtype="float32")
    card = (tmp_path / "m" / "README.md").read_text()
    assert "## Serve it" in card and "vllm serve path/to/this/directory" in card
    assert "--format gguf --quantization q8_0" in card  # llama.cpp's line; run in test_export_gguf.py
    line = next(x for x in card.splitlines() if x.startswith("python -m lorakit.export") and "ct2" in x)
    command = line.replace("path/to/this/directory", str(tmp_path / "m"))
    export_args, serve = command.split(" && ")
    assert export_main(shlex.split(export_args)[3:]) == 0
    code = shlex.split(serve)[2]  # python -c CODE: it prints the loaded Generator
    assert code.startswith("import ctranslate2;") and f"Generator('{tmp_path / 'm'}-ct2'" in code
    exec(code, {})
    assert json.loads((tmp_path / "m-ct2" / "lorakit_export.json").read_text())["quantization"] == "int8"


def test_gemma2_is_refused_ctranslate2_drops_its_soft_capping(adapters, tmp_path):
    with pytest.raises(MergeError, match="model type 'gemma2' is not supported"):
        export(adapters["gemma2"], tmp_path / "x", format="ct2")
    assert not (tmp_path / "x").exists()


def test_the_check_catches_the_upstream_t5_output_scale(cache_dir, tmp_path):
    """Negative control: CTranslate2's converter run as is on a transformers 5 FLAN-T5-shaped config scales
    the decoder output (it reads the forced tie_word_embeddings); greedy tokens survive, the check does not."""
    from ctranslate2.converters import TransformersConverter

    from lorakit.export.ct2 import check_ct2
    from lorakit.testing import resolve_model_source

    src = Path(resolve_model_source("tiny:t5", cache_dir))
    assert json.loads((src / "config.json").read_text())["scale_decoder_outputs"] is False
    TransformersConverter(str(src)).convert(str(tmp_path / "raw"), force=True)
    with pytest.raises(VerificationError, match="log-prob difference"):
        check_ct2(tmp_path / "raw", reference(src), "float32")


def test_refusals_are_one_line_and_write_nothing(adapters, tmp_path, cache_dir):
    with pytest.raises(MergeError, match="--quantization 'q4'"):
        export(adapters["t5"], tmp_path / "x", format="ct2", quantization="q4")
    with pytest.raises(MergeError, match="--format 'onnx'"):
        export(adapters["t5"], tmp_path / "x", format="onnx")
    bart = random_adapter("bart", cache_dir, tmp_path / "bart", target_modules=["q_proj"])
    with pytest.raises(MergeError, match="model type 'bart' is not supported"):
        export(bart, tmp_path / "x", format="ct2")
    assert not (tmp_path / "x").exists()


def test_cli_exit_codes(adapters, tmp_path, capsys):
    from lorakit.export.__main__ import main

    assert (
        main(
            [str(adapters["t5"]), "--format", "ct2", "--output", str(tmp_path / "o"), "--quantization", "q4"]
        )
        == 2
    )
    assert "error: --quantization 'q4'" in capsys.readouterr().err
    assert NEW_TOKENS > 0 and not (tmp_path / "o").exists()
