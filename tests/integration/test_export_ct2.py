"""python -m lorakit.export --format ct2: tiny T5, Llama and Qwen2 adapters merged, converted by CTranslate2's
converter and checked by CTranslate2 itself against transformers' greedy tokens and log-probabilities."""

import json
from pathlib import Path

import pytest

from lorakit.errors import MergeError, VerificationError
from tests.export_fixtures import random_adapter

ctranslate2 = pytest.importorskip("ctranslate2")

from lorakit.export.exporting import export  # noqa: E402
from lorakit.export.greedy import NEW_TOKENS, PROMPTS, reference  # noqa: E402


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, cache_dir):
    base = tmp_path_factory.mktemp("ct2-adapters")
    return {k: random_adapter(k, cache_dir, base / k) for k in ("t5", "llama", "qwen2")}


@pytest.mark.parametrize("kind", ["t5", "llama", "qwen2"])
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


@pytest.mark.parametrize("kind,quantization", [("t5", "int8_float32"), ("llama", "int8"), ("t5", "float16")])
def test_quantized_export_within_the_stated_measure(adapters, tmp_path, kind, quantization):
    check = export(adapters[kind], tmp_path / "q", format="ct2", quantization=quantization).check
    assert check.passed and check.max_logprob_diff <= check.tolerance
    assert json.loads((tmp_path / "q" / "lorakit_export.json").read_text())["quantization"] == quantization


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
