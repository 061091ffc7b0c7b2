"""The decoder start token, read where each encoder-decoder family's checkpoints keep it
(lorakit.model.families.start): T5 and BART in config.decoder_start_token_id, T5Gemma in
config.decoder.bos_token_id. A tiny T5Gemma configured as google/t5gemma-* ship (decoder bos 3, pad 0, no
decoder_start_token_id) starts its decoder on 3 in training's collators and in generation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lorakit.data.collate import padded_collator
from lorakit.data.pair_collate import pair_collator
from lorakit.errors import RecipeError
from lorakit.model.families.start import (
    decoder_start,
    decoder_start_summary,
    decoder_start_token_id,
    start_generation_on_it,
)
from lorakit.testing import BOS, PAD, SPECIAL_TOKENS, build_tiny_model, tiny_config

START = SPECIAL_TOKENS.index(BOS)  # the tiny T5Gemma's decoder bos, as Gemma's <bos> (2) is not its pad (0)


def test_each_family_reads_its_own_place():
    t5gemma = tiny_config("t5gemma")
    assert not hasattr(t5gemma, "decoder_start_token_id")  # as the real checkpoints' config.json
    assert t5gemma.decoder.bos_token_id == START != t5gemma.pad_token_id == SPECIAL_TOKENS.index(PAD)
    assert decoder_start(t5gemma) == decoder_start(t5gemma).__class__(START, "decoder.bos_token_id")
    assert decoder_start(tiny_config("t5")).field == "decoder_start_token_id"
    assert decoder_start_token_id(tiny_config("t5")) == 0
    assert decoder_start(tiny_config("bart")).token_id == tiny_config("bart").decoder_start_token_id
    # A T5 config without decoder_start_token_id (transformers 5's T5Config default) starts on its pad.
    from transformers import T5Config

    assert decoder_start(T5Config(pad_token_id=0)) == decoder_start(t5gemma).__class__(0, "pad_token_id")


def test_a_config_that_names_no_start_token_is_a_recipe_error():
    config = SimpleNamespace(model_type="my-seq2seq", is_encoder_decoder=True)
    with pytest.raises(RecipeError, match="my-seq2seq.*decoder_start_token_id"):
        decoder_start_token_id(config)


@pytest.fixture(scope="module")
def t5gemma(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("t5gemma")
    model = build_tiny_model("t5gemma", path).eval()
    return model, AutoTokenizer.from_pretrained(str(path))


def test_training_collators_start_on_the_decoder_bos(t5gemma):
    model, tok = t5gemma
    rows = [{"input_ids": [5, 6, 7, 1], "labels": [8, 9, 1]}, {"input_ids": [5, 1], "labels": [10, 1]}]
    batch = padded_collator(tok, model.config)(rows)
    assert batch["decoder_input_ids"][:, 0].tolist() == [START, START]
    assert batch["decoder_input_ids"][0, 1:].tolist() == [8, 9]
    # DPO's padded pairs (evaluation, unpacked training) start there too.
    assert pair_collator(tok, model.config).decoder_start_token_id == START
    assert decoder_start_summary(model.config, tok) == {
        "token_id": START,
        "token": BOS,
        "field": "decoder.bos_token_id",
    }
    assert decoder_start(model.config).describe(tok) == (
        f"decoder start: token {START} ('{BOS}', the checkpoint's config.decoder.bos_token_id)"
    )


def test_generation_starts_on_the_decoder_bos(t5gemma):
    from lorakit.evaluation.generate import generate_texts

    model, tok = t5gemma
    # A generation config naming another start token (pad, as lorakit's tiny T5Gemma had before) must not
    # win: generate_texts starts where training does.
    model.generation_config.decoder_start_token_id = 0
    first = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda m, args, kwargs: first.append(kwargs["input_ids"][:, 0].tolist()) if not first else None,
        with_kwargs=True,
    )
    try:
        prompt = tok(["The council met.", "A storm."], return_tensors="pt", padding=True)
        generate_texts(model, tok, dict(prompt), "cpu", causal=False, max_new_tokens=2, num_beams=1)
    finally:
        hook.remove()
    assert first == [[START, START]]
    # And the model's own generate() starts there once lorakit set its generation config (model build,
    # export).
    start_generation_on_it(model, model.config)
    assert model.generation_config.decoder_start_token_id == START
    out = model.generate(**prompt, max_new_tokens=1, do_sample=False)
    assert out[:, 0].tolist() == [START, START]
