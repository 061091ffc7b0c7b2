"""The base model's config and tokenizer, found without loading weights or the modeling code: what the
launcher and `lorakit.prepare` need, so they import neither peft nor DeepSpeed (lorakit.model.build does)."""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlparse

from transformers import AutoConfig, AutoTokenizer

from lorakit.errors import RecipeError
from lorakit.model.families.tiny import resolve_model_source
from lorakit.model.families.unknown import unknown_config_type
from lorakit.model.sequence_parallel import check_sequence_parallel
from lorakit.recipe.schema import Recipe

# Weight files read with pickle (torch.load), which can run code while it reads.
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def _pickle_refused(name: str, detail: str) -> RecipeError:
    return RecipeError(
        f"model.name_or_path {name!r}: {detail}; lorakit loads safetensors weights only, because pickle files "
        "can run code when they are read. Convert the weights to safetensors, or set model.allow_pickle: true "
        "if you trust where this checkpoint came from"
    )


def check_weight_files(recipe: Recipe, source: str) -> None:
    """Refuse a local model directory whose weights are pickle files only, unless model.allow_pickle.

    Hub models are held to the same rule by from_pretrained(use_safetensors=True) in build_model; this
    check makes a local directory fail before any data is tokenized."""
    path = Path(source)
    if recipe.model.allow_pickle or not path.is_dir() or any(path.glob("*.safetensors")):
        return
    pickles = sorted(f.name for f in path.iterdir() if f.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise _pickle_refused(
            recipe.model.name_or_path, f"its weights are pickle files only ({', '.join(pickles)})"
        )


def _remote_code_hint(recipe: Recipe, error: Exception) -> str:
    if "trust_remote_code" in str(error) and not recipe.model.trust_remote_code:
        return (
            "; the repository ships its own Python code, which lorakit runs only with model.trust_remote_code: "
            "true (set it only if you trust that code: it runs with your permissions)"
        )
    return ""


def _hub_unreachable(recipe: Recipe, source: str) -> RecipeError | None:
    """A hub model that is not in the local cache while the hub's name does not resolve (no network): the
    error now, naming HF_HUB_OFFLINE, rather than after huggingface_hub's retries (~30 s)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or Path(source).exists():
        return None
    host = urlparse(constants.ENDPOINT).hostname or ""
    try:
        socket.getaddrinfo(host, 443)
        return None
    except (OSError, UnicodeError):
        pass
    try:  # cached: loading goes on as it would (huggingface_hub falls back to the cache)
        AutoConfig.from_pretrained(source, revision=recipe.model.revision, local_files_only=True,
                                   trust_remote_code=recipe.model.trust_remote_code)  # fmt: skip
        return None
    except (OSError, ValueError):
        return RecipeError(
            f"model.name_or_path {recipe.model.name_or_path!r}: not in the local Hugging Face cache, and the hub "
            f"({host}) cannot be reached: its name does not resolve (no network?). Download the model where "
            "there is a network and set HF_HUB_OFFLINE=1 to load it from the cache, or give a local directory"
        )


def load_config(recipe: Recipe):
    """The base model's config and its local (or hub) source, without loading weights."""
    source = resolve_model_source(recipe.model.name_or_path, recipe.data.cache_dir)
    unreachable = _hub_unreachable(recipe, source)
    if unreachable is not None:
        raise unreachable
    try:
        config = AutoConfig.from_pretrained(
            source, revision=recipe.model.revision, trust_remote_code=recipe.model.trust_remote_code
        )
    except (OSError, ValueError) as e:
        # A misspelled hub id, a path without config.json, no route to the hub, or refused remote code.
        raise unknown_config_type(e) or RecipeError(
            f"model.name_or_path {recipe.model.name_or_path!r}: cannot load its config: {e}"
            + _remote_code_hint(recipe, e)
        ) from e
    check_weight_files(recipe, source)
    check_sequence_parallel(recipe.distributed.sequence_parallel, config)
    return source, config


def load_tokenizer(recipe: Recipe, source: str):
    """The base model's tokenizer."""
    tok = AutoTokenizer.from_pretrained(
        source, revision=recipe.model.revision, trust_remote_code=recipe.model.trust_remote_code
    )
    if tok.pad_token_id is None:
        # Causal tokenizers often ship without one; padding is masked, so EOS is a safe stand-in.
        tok.pad_token = tok.eos_token
    from lorakit.data.chat import use_template

    return use_template(tok, recipe.data.chat_template)  # saved with the adapter and merged model
