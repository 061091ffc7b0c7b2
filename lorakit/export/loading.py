"""Loading what a merge reads: the base model's class and config, the model in a dtype, the adapter on the
4-bit base a QLoRA run trained with, the tokenizer; and the check that a --base is the trained one's kind.
Shared by both merges (export/job.py, export/stream_job.py) and by lorakit.inference."""

from __future__ import annotations

import contextlib
import gc
import logging
import warnings
from pathlib import Path

import torch

from lorakit.errors import MergeError
from lorakit.export.adapter import check_same_architecture, config_signature
from lorakit.export.result import say
from lorakit.export.sources import MergeSource
from lorakit.export.verify import probe_logits


def auto_model_class(src: MergeSource):
    """(AutoModelForSeq2SeqLM or AutoModelForCausalLM, the config) of what `src` loads: its base, or the
    full model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    try:
        config = AutoConfig.from_pretrained(
            src.base_source, revision=src.revision, trust_remote_code=src.trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise MergeError(f"base model {src.base_name!r}: cannot load its config: {e}") from e
    enc_dec = bool(getattr(config, "is_encoder_decoder", False))
    return (AutoModelForSeq2SeqLM if enc_dec else AutoModelForCausalLM), config


class _DropTieNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("The tied weights mapping")


@contextlib.contextmanager
def _quiet_loading():
    """transformers 5 (modeling_utils.tie_weights) warns when a checkpoint's config ties the head to the
    embeddings but the checkpoint holds both, different: what lorakit trained and saved (model/untie.py
    gives a head that ZeRO-3 loading tied its own weights back). It keeps them separate, as trained: nothing
    for the user to act on. peft (PeftModel.__init__) reads transformers' deprecated `is_gradient_checkpointing`
    (a FutureWarning on every adapter load)."""
    tie = _DropTieNotice()
    logger = logging.getLogger("transformers.modeling_utils")
    logger.addFilter(tie)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            yield
    finally:
        logger.removeFilter(tie)


def peft_from_pretrained(model, path: str, **kwargs):
    """PeftModel.from_pretrained without peft's and transformers' notices (see _quiet_loading)."""
    from peft import PeftModel

    with _quiet_loading():
        return PeftModel.from_pretrained(model, path, **kwargs)


def load_pretrained(auto_cls, source: str, torch_dtype: torch.dtype | str, src: MergeSource | None, **kwargs):
    """The model in `torch_dtype` (or "auto": as saved), eval mode; on CPU unless kwargs place it. Only
    safetensors weights are read unless the caller allowed pickles (src.allow_pickle)."""
    from lorakit.model.build import no_safetensors_weights

    pickles = src is not None and src.allow_pickle
    try:
        with _quiet_loading():
            model = auto_cls.from_pretrained(
                source,
                revision=src.revision if src is not None else None,
                trust_remote_code=src.trust_remote_code if src is not None else False,
                # True: only safetensors; None: transformers' default, safetensors else pytorch_model.bin.
                use_safetensors=None if pickles else True,
                dtype=torch_dtype,
                **kwargs,
            )
    except OSError as e:
        if pickles or not no_safetensors_weights(e):
            raise
        raise MergeError(
            f"{source}: no safetensors weights found ({e}); lorakit loads safetensors only, because pickle files "
            "can run code when they are read. Pass --allow-pickle if you trust where these weights came from",
            doc="docs/faults.md#run-directory-durability-and-trust",
        ) from e
    return model.eval()


def check_architecture(src: MergeSource, config) -> None:
    """With --base, refuse a base of another architecture than the model the adapter was trained on (same
    module names and shapes do not make a Llama adapter right for Qwen2)."""
    if not src.base_overridden:
        return
    from transformers import AutoConfig

    for trained in src.trained_on:
        try:
            # local_files_only: an optional check must never wait on the network.
            trained_cfg = AutoConfig.from_pretrained(
                trained, local_files_only=True, trust_remote_code=src.trust_remote_code
            )
        except (OSError, ValueError):
            continue
        check_same_architecture(
            config_signature(trained_cfg), config_signature(config), f"{src.base_name} (trained on {trained})"
        )
        return
    say(
        "note: the config of the model the adapter was trained on is not available; checking module names and shapes only"
    )


def adapter_on_4bit(src: MergeSource, auto_cls, batch) -> torch.Tensor:
    """Logits of the adapter on the 4-bit base, as trained (the recipe's quantization and dtype)."""
    from lorakit.model.quantize import bnb_config, keep_standard_4bit_layout

    train_dtype = getattr(torch, src.recipe.model.dtype)
    quant = bnb_config(src.recipe.method.quantization(), train_dtype)
    model = load_pretrained(auto_cls, src.base_source, train_dtype, src, quantization_config=quant)
    keep_standard_4bit_layout(model)  # the layout it trained in (on AVX512-BF16 CPUs too)
    from lorakit.model.quant_experts import quantize_experts

    quantize_experts(model, src.recipe.method.quantization())  # an MoE's fused experts trained in 4 bits too
    logits = probe_logits(peft_from_pretrained(model, str(src.path)), batch)
    del model
    gc.collect()
    return logits


def save_tokenizer(src: MergeSource, directory: Path, notes: list[str]) -> None:
    """The tokenizer of `src` saved into `directory`; a note (not an error) when there is none to load."""
    from transformers import AutoTokenizer

    where = src.tokenizer_source()
    try:
        tok = AutoTokenizer.from_pretrained(
            where,
            revision=src.revision if where == src.base_source else None,
            trust_remote_code=src.trust_remote_code,
        )
    except (OSError, ValueError) as e:
        notes.append(f"no tokenizer saved: none could be loaded from {where} ({e})")
        say(notes[-1])
        return
    tok.save_pretrained(str(directory))
