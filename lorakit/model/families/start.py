"""The token an encoder-decoder's decoder starts on, read where its family's checkpoints keep it: T5, mT5 and
BART in `config.decoder_start_token_id`, T5Gemma in `config.decoder.bos_token_id` (its config has no
decoder_start_token_id; transformers' T5Gemma shifts its labels right onto the decoder's bos). Training's
collators, evaluation, generation and the export all take it from here, so the decoder is taught and run
from the token it was pretrained on."""

from __future__ import annotations

from dataclasses import dataclass

from lorakit.errors import RecipeError
from lorakit.model.families.registry import family_of


@dataclass(frozen=True)
class DecoderStart:
    """The decoder's start token and the config attribute it was read from (`decoder.bos_token_id`)."""

    token_id: int
    field: str

    def describe(self, tokenizer=None) -> str:
        """`decoder start: token 2 ('<bos>', the checkpoint's config.decoder.bos_token_id)` in one line."""
        name = tokenizer.convert_ids_to_tokens(self.token_id) if tokenizer is not None else None
        what = f"{name!r}, " if name else ""
        return f"decoder start: token {self.token_id} ({what}the checkpoint's config.{self.field})"


def _attribute(config, path: str):
    for name in path.split("."):
        config = getattr(config, name, None)
        if config is None:
            return None
    return config


def decoder_start(config) -> DecoderStart:
    """Where the family of `config` (an encoder-decoder's) keeps its decoder start token, and the token; a
    RecipeError (exit 2) when the config sets none of the places its family looks."""
    family = family_of(config)
    for path in family.decoder_start:
        token = _attribute(config, path)
        if token is not None:
            return DecoderStart(int(token), path)
    raise RecipeError(
        f"model.name_or_path: the {getattr(config, 'model_type', None)!r} config sets none of "
        f"{', '.join(family.decoder_start)}: lorakit cannot tell which token its decoder starts on"
    )


def decoder_start_summary(config, tokenizer=None) -> dict | None:
    """summary.json's `decoder_start`: {token_id, token, field} for an encoder-decoder, else None."""
    if not getattr(config, "is_encoder_decoder", False):
        return None
    start = decoder_start(config)
    token = tokenizer.convert_ids_to_tokens(start.token_id) if tokenizer is not None else None
    return {"token_id": start.token_id, "token": token, "field": start.field}


def decoder_start_token_id(config) -> int:
    """The token id the decoder of `config` starts on (decoder_start)."""
    return decoder_start(config).token_id


def start_generation_on_it(model_or_generation_config, config) -> None:
    """Make generate() start the decoder of `config` (an encoder-decoder's) on its family's start token:
    sets `generation_config.decoder_start_token_id` on a model (its generation_config) or on a
    GenerationConfig, in place; nothing for a causal LM. transformers would otherwise fall back to the
    config's bos_token_id where the generation config names no start token."""
    if not getattr(config, "is_encoder_decoder", False):
        return
    target = getattr(model_or_generation_config, "generation_config", model_or_generation_config)
    if target is not None:
        target.decoder_start_token_id = decoder_start_token_id(config)
