"""Tiny random models and tokenizers built locally, for tests, the quickstart and users' smoke tests.

Nothing here touches the network: the tokenizer is trained on the builtin news_summaries dataset and the
weights are random but a pure function of the seed. `model.name_or_path: tiny:t5` (or `tiny:llama`,
`tiny:mistral`, `tiny:qwen2`) in a recipe resolves, through `resolve_model_source`, to a directory built once
under the cache directory.
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

from lorakit.errors import RecipeError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

TINY_KINDS: tuple[str, ...] = ("t5", "llama", "mistral", "qwen2")
# The decoder-only kinds: they share the Llama-style tokenizer (BOS prepended, no EOS, chat template).
CAUSAL_KINDS: tuple[str, ...] = ("llama", "mistral", "qwen2")
# tiny:mistral's attention window: deliberately small, so sequences longer than it exercise sliding-window
# attention (real Mistral uses 4096).
TINY_SLIDING_WINDOW = 64
# Bump when anything in the construction changes (tokenizer, config, init): cached directories are keyed by
# it, so a stale build is never picked up.
TINY_VERSION = 2
TINY_VOCAB_SIZE = 2000
TINY_MAX_LENGTH = 512

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


def build_tiny_tokenizer(path: str | os.PathLike, kind: str = "t5") -> PreTrainedTokenizerFast:
    """Train (deterministically) and save a ~2000-token fast tokenizer into `path`; returns it.

    t5: appends </s> to every sequence, as T5's tokenizer does. llama, mistral, qwen2: prepends <s>, no </s>
    (Llama style), and carries a small chat template.
    """
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    _check_kind(kind, field="kind")
    tok = Tokenizer.from_str(_trained_tokenizer_json())
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    if kind == "t5":
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}", special_tokens=[(EOS, ids[EOS])]
        )
    else:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, ids[BOS])]
        )
    extra = {"bos_token": BOS, "chat_template": LLAMA_CHAT_TEMPLATE} if kind in CAUSAL_KINDS else {}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=TINY_MAX_LENGTH,
        # Byte-level decoding already restores the exact spacing; the clean-up would glue " ." etc.
        clean_up_tokenization_spaces=False,
        **extra,
    )
    Path(path).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    return tokenizer


def _check_kind(kind: str, field: str) -> None:
    if kind not in TINY_KINDS:
        raise RecipeError(
            f"{field}: unknown tiny model {kind!r}; available: " + ", ".join(f"tiny:{k}" for k in TINY_KINDS)
        )


def _t5_config(vocab_size: int):
    from transformers import T5Config

    return T5Config(
        vocab_size=vocab_size,
        d_model=64,
        d_ff=128,
        d_kv=16,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        # FLAN-T5 / T5 v1.1: separate lm_head, no output scaling. transformers 5.x keeps the flag only as
        # `scale_decoder_outputs=False` and stores tie_word_embeddings=True; the untied lm_head is restored
        # from the checkpoint (see build_tiny_model).
        tie_word_embeddings=False,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        n_positions=TINY_MAX_LENGTH,
    )


def _causal_config(kind: str, vocab_size: int, bos: int, **shape: Any):
    """Config of a tiny decoder-only model: the same shape for every causal kind, unless `shape` replaces
    some of its fields (hidden_size, num_hidden_layers, ...)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=bos,
        eos_token_id=1,
        pad_token_id=0,
    )
    common.update(shape)
    if kind == "mistral":
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=TINY_SLIDING_WINDOW)
    if kind == "qwen2":
        # Small Qwen2 checkpoints (0.5B, 1.5B) tie the output head to the input embedding.
        return Qwen2Config(**common, tie_word_embeddings=True)
    return LlamaConfig(**common, tie_word_embeddings=False)


def tiny_config(kind: str):
    """The config of a tiny model of a TINY_KINDS kind without building anything (the vocabulary at its
    target size, which the trained tokenizer comes within a few tokens of): for size estimates."""
    _check_kind(kind, field="model.name_or_path")
    if kind == "t5":
        return _t5_config(TINY_VOCAB_SIZE)
    return _causal_config(kind, TINY_VOCAB_SIZE, bos=SPECIAL_TOKENS.index(BOS))


def build_tiny_model(kind: str, path: str | os.PathLike, seed: int = 0, **shape: Any) -> PreTrainedModel:
    """Build a tiny random model of a TINY_KINDS kind (bit-identical for a given seed) and save it with its
    tokenizer and generation config into `path`; returns the model. `shape`: config fields of a causal kind
    to change (e.g. a wider Llama for tests that need real head sizes)."""
    import torch
    from transformers import (
        LlamaForCausalLM,
        MistralForCausalLM,
        Qwen2ForCausalLM,
        T5ForConditionalGeneration,
    )

    _check_kind(kind, field="kind")
    if shape and kind == "t5":
        raise ValueError("build_tiny_model: shape overrides are for causal kinds")
    tokenizer = build_tiny_tokenizer(path, kind=kind)
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "t5":
            config = _t5_config(len(tokenizer))
            model = T5ForConditionalGeneration(config)
            # transformers 5.x always ties lm_head to the shared embedding for T5 (upstream PR #42815), but
            # FLAN-T5 checkpoints carry their own lm_head, and from_pretrained keeps the two apart when both
            # are saved with different values. Mirror that layout so the tiny model exercises the same path.
            # std d_model**-0.5 (not T5's 1.0) keeps initial logits O(1), so a smoke run trains smoothly.
            lm_head = torch.empty_like(model.shared.weight)
            torch.nn.init.normal_(lm_head, std=config.d_model**-0.5)
            model.lm_head.weight = torch.nn.Parameter(lm_head)
        else:
            config = _causal_config(kind, len(tokenizer), bos=tokenizer.bos_token_id, **shape)
            model_cls = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}
            model = model_cls[kind](config)
            # The default init (std 0.02) caps logits near +-1 with hidden size 64, so the loss of a LoRA smoke
            # run could barely fall; hidden**-0.5 (as for the tiny T5's head) gives logits of order 1-10.
            # In place, so Qwen2's tied embedding gets the same values.
            with torch.no_grad():
                torch.nn.init.normal_(model.lm_head.weight, std=config.hidden_size**-0.5)
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
        "import sys, json; from lorakit.testing import build_tiny_model; "
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
    _check_kind(kind, field="model.name_or_path")
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
            os.rename(tmp, target)
        except OSError:
            # Another process renamed its build into place first: theirs is as good as ours.
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
