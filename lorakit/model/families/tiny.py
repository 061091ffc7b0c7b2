"""Tiny random models and tokenizers of every family with a tiny builder, built locally, for tests, the
doctor, the quickstart and users' smoke tests (lorakit.testing is their public face).

Nothing here touches the network: the tokenizer is trained on the builtin news_summaries dataset and the
weights are random but a pure function of the seed. `model.name_or_path: tiny:t5` (or `tiny:llama`,
`tiny:mistral`, `tiny:qwen2`, `tiny:bart`, `tiny:qwen3`, `tiny:gemma2`, `tiny:gemma3`, `tiny:phi3`,
`tiny:olmo2`) in a recipe resolves, through `resolve_model_source`, to a directory built once under the
cache directory. Each family's `Tiny` says its config, its model and its
tokenizer's layout; this module trains the tokenizer, seeds, saves and caches.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorakit import storage
from lorakit.errors import RecipeError
from lorakit.model.families.base import TINY_MAX_LENGTH
from lorakit.model.families.registry import family_named, tiny_kinds

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

# Bump when anything in the construction changes (tokenizer, config, init): cached directories are keyed by
# it, so a stale build is never picked up.
TINY_VERSION = 3
TINY_VOCAB_SIZE = 2000

PAD, EOS, UNK, BOS = "<pad>", "</s>", "<unk>", "<s>"
# T5's ids for pad/eos/unk (decoder_start = pad = 0); <s> comes next and is used only by the causal kind.
SPECIAL_TOKENS = (PAD, EOS, UNK, BOS)

LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _corpus() -> list[str]:
    """Every article and highlight of the builtin news_summaries dataset, in file order."""
    from lorakit.data.samples import builtin_dataset_dir

    texts = []
    for split in ("train", "validation"):
        with open(builtin_dataset_dir("news_summaries") / f"{split}.jsonl", encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                texts += [row["article"], row["highlights"]]
    return texts


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    """The trained byte-level BPE as JSON; cached so that every build in a process reuses one training run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # Byte-level BPE: every byte is in the base alphabet, so no ASCII (or any) text ever maps to <unk>, and
    # the ByteLevel decoder gives back the exact input text, spaces included.
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok.to_str()


def _tiny(kind: str, field: str):
    """The Tiny builder of the family called `kind`; a RecipeError naming `field` and the tiny kinds."""
    if kind not in tiny_kinds():
        raise RecipeError(
            f"{field}: unknown tiny model {kind!r}; available: "
            + ", ".join(f"tiny:{k}" for k in tiny_kinds())
        )
    return family_named(kind).tiny


def build_tiny_tokenizer(path: str | os.PathLike, kind: str = "t5") -> PreTrainedTokenizerFast:
    """Train (deterministically) and save a ~2000-token fast tokenizer into `path`; returns it.

    The tokenizer layout of the `kind` family: T5's (t5, bart) appends </s> to every sequence; the causal
    one (llama, mistral, qwen2) prepends <s>, no </s> (Llama style), and carries a small chat template.
    """
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    causal = _tiny(kind, field="kind").tokenizer == "causal"
    tok = Tokenizer.from_str(_trained_tokenizer_json())
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    if not causal:
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}", special_tokens=[(EOS, ids[EOS])]
        )
    else:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, ids[BOS])]
        )
    specials = {"pad_token": PAD, "eos_token": EOS, "unk_token": UNK}
    if causal:
        specials.update(bos_token=BOS, chat_template=LLAMA_CHAT_TEMPLATE)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=TINY_MAX_LENGTH,
        # Byte-level decoding already restores the exact spacing; the clean-up would glue " ." etc.
        clean_up_tokenization_spaces=False,
        **specials,
    )
    Path(path).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    return tokenizer


def tiny_config(kind: str):
    """The config of a tiny model of a tiny kind without building anything (the vocabulary at its target
    size, which the trained tokenizer comes within a few tokens of): for size estimates."""
    return _tiny(kind, field="model.name_or_path").config(TINY_VOCAB_SIZE, bos=SPECIAL_TOKENS.index(BOS))


def build_tiny_model(kind: str, path: str | os.PathLike, seed: int = 0, **shape: Any) -> PreTrainedModel:
    """Build a tiny random model of a tiny kind (bit-identical for a given seed) and save it with its
    tokenizer and generation config into `path`; returns the model. `shape`: config fields of a causal kind
    to change (e.g. a wider Llama for tests that need real head sizes)."""
    import torch

    tiny = _tiny(kind, field="kind")
    if shape and not tiny.reshapable:
        raise ValueError("build_tiny_model: shape overrides are for causal kinds")
    tokenizer = build_tiny_tokenizer(path, kind=kind)
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tiny.model(tiny.config(len(tokenizer), bos=SPECIAL_TOKENS.index(BOS), **shape))
    if not model.should_save_on_this_rank(True):
        # Inside an initialised process group transformers writes model files on global rank 0 only, so a
        # build on another rank (a user's own torchrun on a fresh cache, or another node's first process)
        # would leave a directory without config or weights. A fresh process has no group: build there.
        _build_in_subprocess(kind, path, seed, shape)
        return model
    model.save_pretrained(str(path))
    return model


def _build_in_subprocess(kind: str, path: Path, seed: int, shape: dict) -> None:
    """build_tiny_model(kind, path, ...) in a new interpreter, outside this process's group."""
    code = (
        "import sys, json; from lorakit.model.families.tiny import build_tiny_model; "
        "a = json.loads(sys.argv[1]); build_tiny_model(a['kind'], a['path'], seed=a['seed'], **a['shape'])"
    )
    args = json.dumps({"kind": kind, "path": str(path), "seed": seed, "shape": shape})
    subprocess.run([sys.executable, "-c", code, args], check=True)


def resolve_model_source(name_or_path: str, cache_dir: str | os.PathLike) -> str:
    """`tiny:KIND` -> its local directory under `cache_dir`/models, built on first use; else unchanged.

    Safe when several processes (ranks) call it at once: each builds into a private sibling directory and
    renames it into place atomically; a loser discards its copy. A complete directory is never rebuilt.
    """
    if not name_or_path.startswith("tiny:"):
        return name_or_path
    kind = name_or_path.removeprefix("tiny:")
    _tiny(kind, field="model.name_or_path")
    models = Path(cache_dir).expanduser() / "models"
    target = models / f"tiny-{kind}-v{TINY_VERSION}"
    # The directory only ever appears by an atomic rename of a finished build, so existing means complete.
    if target.is_dir():
        return str(target)
    models.mkdir(parents=True, exist_ok=True)
    tmp = models / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        build_tiny_model(kind, tmp)
        try:
            # Durably (its files fsynced before the rename, the parent after), as every lorakit writer.
            storage.publish_directory(tmp, target)
        except OSError:
            # Another process renamed its build into place first: theirs is as good as ours.
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
