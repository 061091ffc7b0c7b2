"""python -m lorakit.export --format gguf / gguf-lora: converted by llama.cpp's own scripts, from a llama.cpp
checkout named by $LORAKIT_LLAMA_CPP (skipped without one: docs/export.md#install says how to get it), and
checked by llama-cpp-python where it is installed (skipped otherwise): the tiny Llama, Qwen3 and Gemma 2, each
with a SentencePiece tokenizer (tests/export_fixtures.py says why)."""

import json
import os
from pathlib import Path

import pytest

from lorakit.errors import MergeError
from tests.export_fixtures import random_adapter, with_sentencepiece

gguf = pytest.importorskip("gguf")
pytest.importorskip("sentencepiece")
LLAMA_CPP = os.environ.get("LORAKIT_LLAMA_CPP")
# .ci/run installs llama-cpp-python and sets LORAKIT_LLAMA_CPP: in CI a missing one fails these tests.
IN_CI = os.environ.get("CI") == "true"
pytestmark = pytest.mark.skipif(
    not (LLAMA_CPP and (Path(LLAMA_CPP) / "convert_hf_to_gguf.py").is_file()) and not IN_CI,
    reason="set LORAKIT_LLAMA_CPP to a llama.cpp checkout (docs/export.md#install)",
)


def _engine_or_skip() -> None:
    """Skip the engine's part of a test where llama-cpp-python is not installed (never in CI)."""
    if not IN_CI:
        pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: converted, not checked")


from lorakit.export.exporting import export  # noqa: E402


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, cache_dir):
    base = tmp_path_factory.mktemp("gguf")
    model = with_sentencepiece(cache_dir, base / "llama-sp")
    return random_adapter("llama", cache_dir, base / "adapter", base=str(model))


def _reader(path: Path):
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"]
    return reader, bytes(arch.parts[arch.data[0]]).decode()


@pytest.mark.parametrize("quantization", ["f16", "q8_0"])
def test_merged_model_converts_and_the_engine_agrees(adapter, tmp_path, quantization):
    result = export(adapter, tmp_path / "g", format="gguf", quantization=quantization)
    reader, arch = _reader(tmp_path / "g" / f"model-{quantization}.gguf")
    assert arch == "llama" and len(reader.tensors) >= 2 + 9 * 2  # embeddings, norm, 9 tensors per layer
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert ("Q8_0" if quantization == "q8_0" else "F16") in kinds
    assert (
        f"llama-server -m {tmp_path / 'g'}/model-{quantization}.gguf"
        in (tmp_path / "g" / "README.md").read_text()
    )
    _engine_or_skip()
    assert result.check.passed and result.check.max_logprob_diff <= result.check.tolerance


@pytest.mark.parametrize("kind,quantization", [("qwen3", "f16"), ("gemma2", "f16"), ("gemma2", "q8_0")])
def test_qwen_and_gemma_convert_and_the_engine_agrees(
    tmp_path_factory, cache_dir, tmp_path, kind, quantization
):
    base = tmp_path_factory.getbasetemp() / f"gguf-{kind}"
    if not (base / "adapter").is_dir():  # one adapter per family for its quantizations
        model = with_sentencepiece(cache_dir, base / "model", kind)
        random_adapter(kind, cache_dir, base / "adapter", base=str(model))
    result = export(base / "adapter", tmp_path / "g", format="gguf", quantization=quantization)
    _, arch = _reader(tmp_path / "g" / f"model-{quantization}.gguf")
    assert arch == kind
    _engine_or_skip()
    assert result.check.passed and result.check.max_logprob_diff <= result.check.tolerance


def test_adapter_converts_to_a_gguf_lora(adapter, tmp_path):
    export(adapter, tmp_path / "a", format="gguf-lora", quantization="f16")
    reader, _ = _reader(tmp_path / "a" / "adapter-f16.gguf")
    names = [t.name for t in reader.tensors]
    assert len(names) == 2 * 2 * 2 and all(n.endswith((".lora_a", ".lora_b")) for n in names)
    _engine_or_skip()
    # llama.cpp applies the f16 GGUF adapter at run time to the f32 base GGUF, with its f16 KV cache: what the
    # merged model generates, within the 16-bit teacher-forced measure (not token for token: a near-tied
    # argmax flipped one token of 64 in a CI run, at 0.000366 nats).
    import subprocess
    import sys

    from lorakit.errors import VerificationError
    from lorakit.export.gguf import check_gguf
    from lorakit.export.greedy import reference
    from lorakit.export.job import merge

    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    script = Path(LLAMA_CPP) / "convert_hf_to_gguf.py"
    subprocess.run([sys.executable, str(script), base, "--outfile", str(tmp_path / "base.gguf"), "--outtype", "f32"],
                   check=True, capture_output=True)  # fmt: skip
    merge(adapter, tmp_path / "merged", dtype="float32")
    ref = reference(tmp_path / "merged")
    check = check_gguf(tmp_path / "base.gguf", ref, "f32", lora=tmp_path / "a" / "adapter-f16.gguf")
    assert check.passed and not check.exact and check.tolerance == 0.05
    assert check.max_logprob_diff < 0.005  # measured 0.00025..0.00037
    # The measure sees the adapter: the base alone is far outside it (2.85 nats measured).
    with pytest.raises(VerificationError, match="engine check failed: .* - FAILED"):
        check_gguf(tmp_path / "base.gguf", ref, "f32")


def test_a_tokenizer_llama_cpp_does_not_know_is_refused_in_one_line(cache_dir, tmp_path):
    # The tiny Llama's own BPE tokenizer, trained locally: llama.cpp knows no hash for its pre-tokenizer.
    plain = random_adapter("llama", cache_dir, tmp_path / "plain")
    with pytest.raises(MergeError, match="BPE pre-tokenizer was not recognized"):
        export(plain, tmp_path / "x", format="gguf")
    assert not (tmp_path / "x").exists()
