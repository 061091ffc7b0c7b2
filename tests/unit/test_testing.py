"""lorakit.testing: tiny tokenizers and models built locally, and the tiny:KIND cache."""

from __future__ import annotations

import multiprocessing
import string
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    GenerationConfig,
)

from lorakit import testing
from lorakit.errors import RecipeError
from lorakit.model.families import family_named, tiny
from lorakit.testing import (
    CAUSAL_KINDS,
    SEQ2SEQ_KINDS,
    TINY_KINDS,
    TINY_VERSION,
    build_tiny_model,
    build_tiny_tokenizer,
    resolve_model_source,
)

AUTO = {kind: AutoModelForSeq2SeqLM for kind in SEQ2SEQ_KINDS} | {
    kind: AutoModelForCausalLM for kind in CAUSAL_KINDS
}
TEXT = "The council voted 41 to 7 on Monday to fund 12 schools in Porto, said Maria Novak."


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """One saved tiny model (with tokenizer) per kind, shared by the tests of this module."""
    dirs = {}
    for kind in TINY_KINDS:
        dirs[kind] = tmp_path_factory.mktemp(f"tiny-{kind}")
        build_tiny_model(kind, dirs[kind])
    return dirs


def _files(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(path.iterdir())}


# --- tokenizer ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tokenizer_special_ids_and_size(tiny_dirs, kind):
    tok = AutoTokenizer.from_pretrained(tiny_dirs[kind])
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "</s>", "<unk>"]
    assert len(tok) == testing.TINY_VOCAB_SIZE
    assert tok.model_max_length == 512


def test_t5_tokenizer_appends_eos_like_t5(tiny_dirs):
    tok = AutoTokenizer.from_pretrained(tiny_dirs["t5"])
    ids = tok(TEXT)["input_ids"]
    assert ids[-1] == tok.eos_token_id and ids.count(tok.eos_token_id) == 1
    assert tok.bos_token_id is None or tok.bos_token_id not in ids
    assert tok("")["input_ids"] == [tok.eos_token_id]
    assert tok(TEXT, add_special_tokens=False)["input_ids"] == ids[:-1]


def test_causal_kinds_are_the_non_seq2seq_kinds():
    assert SEQ2SEQ_KINDS == ("t5", "bart", "t5gemma")
    assert set(CAUSAL_KINDS) == set(TINY_KINDS) - set(SEQ2SEQ_KINDS)


@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_causal_tokenizer_prepends_bos_and_has_chat_template(tiny_dirs, kind):
    tok = AutoTokenizer.from_pretrained(tiny_dirs[kind])
    assert tok.bos_token == "<s>" and tok.bos_token_id == 3
    ids = tok(TEXT)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.eos_token_id not in ids
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s><|user|>\nHi</s>\n<|assistant|>\n"


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tokenizer_roundtrips_ascii_without_unk(tiny_dirs, kind):
    tok = AutoTokenizer.from_pretrained(tiny_dirs[kind])
    for text in (TEXT, string.printable, "  two  spaces, tabs\tand\nnewlines ", "Zürich café"):
        ids = tok(text)["input_ids"]
        assert tok.unk_token_id not in ids, text
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_vocab_fits_the_news_words(tiny_dirs):
    # Trained on news_summaries: a common word of the corpus is one token, not a string of bytes.
    tok = AutoTokenizer.from_pretrained(tiny_dirs["t5"])
    assert len(tok(" council", add_special_tokens=False)["input_ids"]) == 1


def test_tokenizer_training_is_deterministic(tmp_path):
    build_tiny_tokenizer(tmp_path / "a")
    tiny._trained_tokenizer_json.cache_clear()  # retrain, not just re-serialise the cached result
    build_tiny_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_unknown_kind_is_rejected(tmp_path):
    with pytest.raises(RecipeError, match="tiny:t5"):
        build_tiny_model("gpt9", tmp_path)


# --- models ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_model_weights_are_a_function_of_the_seed(tmp_path, kind):
    a = build_tiny_model(kind, tmp_path / "a", seed=0).state_dict()
    b = build_tiny_model(kind, tmp_path / "b", seed=0).state_dict()
    c = build_tiny_model(kind, tmp_path / "c", seed=1).state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_shape_overrides_widen_a_causal_model_and_are_refused_for_t5(tmp_path):
    model = build_tiny_model("llama", tmp_path / "wide", hidden_size=128, num_attention_heads=2)
    assert (model.config.hidden_size, model.config.num_attention_heads, model.config.head_dim) == (128, 2, 64)
    assert model.config.num_key_value_heads == 2 and model.lm_head.weight.shape[1] == 128
    with pytest.raises(ValueError, match="causal kinds"):
        build_tiny_model("t5", tmp_path / "t5", d_model=128)


def test_building_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model("llama", tmp_path)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_saved_model_loads_and_gives_a_finite_loss(tiny_dirs, kind):
    path = tiny_dirs[kind]
    assert (path / "model.safetensors").is_file()
    model = AUTO[kind].from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    batch = tok([TEXT, "Short one."], return_tensors="pt", padding=True)
    if kind in SEQ2SEQ_KINDS:
        labels = tok(["Porto funds 12 schools.", "Short."], return_tensors="pt", padding=True)["input_ids"]
        labels[labels == tok.pad_token_id] = -100
    else:
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    loss = model(**batch, labels=labels).loss
    assert torch.isfinite(loss)
    # Random weights: close to uniform over the vocabulary, ln(2000) ~ 7.6.
    assert 5.0 < loss.item() < 12.0


def test_t5_config_is_flan_t5_style(tiny_dirs):
    cfg = AutoConfig.from_pretrained(tiny_dirs["t5"])
    assert cfg.model_type == "t5" and cfg.feed_forward_proj == "gated-gelu" and cfg.is_gated_act
    assert (cfg.d_model, cfg.d_ff, cfg.d_kv, cfg.num_heads) == (64, 128, 16, 4)
    assert (cfg.num_layers, cfg.num_decoder_layers) == (2, 2)
    assert (cfg.decoder_start_token_id, cfg.pad_token_id, cfg.eos_token_id) == (0, 0, 1)
    assert cfg.vocab_size == testing.TINY_VOCAB_SIZE and cfg.n_positions == 512
    # transformers 5.x stores T5 v1.1's tie_word_embeddings=False as scale_decoder_outputs=False.
    assert getattr(cfg, "scale_decoder_outputs", cfg.tie_word_embeddings) is False
    gen = GenerationConfig.from_pretrained(tiny_dirs["t5"])
    assert (gen.decoder_start_token_id, gen.eos_token_id, gen.pad_token_id) == (0, 1, 0)


def test_t5_lm_head_stays_untied_after_loading(tiny_dirs):
    # Regression guard: transformers 5.x forces tie_word_embeddings=True for T5 and only keeps a saved
    # lm_head apart from the embedding because both are in the checkpoint with different values. FLAN-T5
    # relies on the same rule; if it changes, this fails.
    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_dirs["t5"])
    assert model.lm_head.weight.data_ptr() != model.shared.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.shared.weight)


@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_causal_config(tiny_dirs, kind):
    cfg = AutoConfig.from_pretrained(tiny_dirs[kind])
    assert cfg.model_type in family_named(kind).model_types
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.max_position_embeddings) == (4, 2, 1024)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (3, 1, 0)
    assert cfg.vocab_size == testing.TINY_VOCAB_SIZE
    # Small Qwen2 / Qwen3 checkpoints and every Gemma tie the output head to the embedding; the others not.
    assert cfg.tie_word_embeddings is (kind in ("qwen2", "qwen3", "gemma2", "gemma3"))
    windowed = ("mistral", "phi3", "gemma2", "gemma3")
    assert getattr(cfg, "sliding_window", None) == (testing.TINY_SLIDING_WINDOW if kind in windowed else None)
    gen = GenerationConfig.from_pretrained(tiny_dirs[kind])
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (3, 1, 0)


def test_qwen2_head_is_tied_after_loading(tiny_dirs):
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen2"])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_mistral_attends_within_its_sliding_window(tiny_dirs):
    # The window is 64 tokens: the logits at position p depend only on tokens p-63..p. Changing the first
    # token moves every logit inside the window and none beyond it (2 layers: the receptive field is
    # 2 * 63 tokens, so compare position 130, past it).
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["mistral"]).eval()
    ids = torch.randint(4, testing.TINY_VOCAB_SIZE, (1, 140), generator=torch.Generator().manual_seed(0))
    other = ids.clone()
    other[0, 0] = 4 if ids[0, 0] != 4 else 5
    with torch.no_grad():
        a, b = model(ids).logits[0], model(other).logits[0]
    assert not torch.allclose(a[10], b[10])
    assert torch.allclose(a[130:], b[130:], atol=1e-6)


# --- resolve_model_source ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["google/flan-t5-xl", "/models/my-t5", "tiny", "t5:tiny"])
def test_resolve_passes_other_names_through(tmp_path, name):
    assert resolve_model_source(name, tmp_path) == name
    assert not (tmp_path / "models").exists()


def test_resolve_unknown_tiny_kind(tmp_path):
    with pytest.raises(
        RecipeError, match=r"model\.name_or_path.*tiny:t5, tiny:llama, tiny:mistral, tiny:qwen2"
    ):
        resolve_model_source("tiny:xyz", tmp_path)


def test_resolve_builds_once_then_reuses(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    path = resolve_model_source("tiny:t5", "~/cache")
    assert Path(path) == tmp_path / "cache" / "models" / f"tiny-t5-v{TINY_VERSION}"
    assert AutoConfig.from_pretrained(path).model_type == "t5"
    before = _files(Path(path))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= before.keys()

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a complete directory must not be rebuilt")

    monkeypatch.setattr(tiny, "build_tiny_model", no_rebuild)
    assert resolve_model_source("tiny:t5", "~/cache") == path
    assert _files(Path(path)) == before
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [Path(path).name]


def test_resolve_loser_of_a_race_discards_its_build(tmp_path, monkeypatch):
    real_build = testing.build_tiny_model
    target = tmp_path / "models" / f"tiny-llama-v{TINY_VERSION}"

    def build_while_another_rank_wins(kind, path, seed=0):
        real_build(kind, path, seed)
        real_build(kind, target, seed)  # the other rank renames its build into place first
        (target / "winner").touch()

    monkeypatch.setattr(tiny, "build_tiny_model", build_while_another_rank_wins)
    assert resolve_model_source("tiny:llama", tmp_path) == str(target)
    assert (target / "winner").exists()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [target.name]  # no temporary left


@pytest.mark.slow  # two processes (multiprocessing: no subprocess.Popen for the audit hook to see)
def test_resolve_concurrent_builds_from_two_processes(tmp_path):
    # spawn, not fork: forking a process that already ran torch's thread pools can hang.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        paths = pool.starmap(resolve_model_source, [("tiny:llama", str(tmp_path))] * 2)
    assert paths[0] == paths[1] == str(tmp_path / "models" / f"tiny-llama-v{TINY_VERSION}")
    assert [p.name for p in (tmp_path / "models").iterdir()] == [Path(paths[0]).name]
    model = AutoModelForCausalLM.from_pretrained(paths[0])
    expected = build_tiny_model("llama", tmp_path / "fresh").state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_resolve_on_a_rank_other_than_0_builds_a_whole_model(tmp_path, monkeypatch):
    """Under torch.distributed, transformers' save_pretrained writes only on global rank 0, so a rank-1 build
    once left a directory without config.json or weights (a user's own torchrun on a fresh cache)."""
    from transformers import PreTrainedModel

    # What transformers decides on rank 1 of an initialised group (rank 0 only writes).
    monkeypatch.setattr(PreTrainedModel, "should_save_on_this_rank", lambda self, is_main: False)
    path = Path(resolve_model_source("tiny:qwen2", tmp_path))
    assert (path / "config.json").is_file() and list(path.glob("*.safetensors"))
    monkeypatch.undo()
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen2"
