"""One merge: read and check the adapter, then merge shard by shard (export/stream_job.py, the default) or,
where the merge is not per tensor, in memory: load the base once, merge in place, verify, save atomically,
and verify the saved copy again after reloading it.

Memory of the in-memory merge: one copy of the model at a time. transformers 5 always builds the model on
the meta device and loads the weights straight into it (low_cpu_mem_usage is the only mode), peft's
merge_and_unload folds
B A x scale into each weight in place, and the reference logits are computed from the same PeftModel before
merging, so no second copy is ever needed. The merged model is freed before the saved copy is reloaded.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lorakit.errors import MergeError
from lorakit.export.adapter import Adapter, check_fits, read_adapter
from lorakit.export.card import CARD, QLORA_NOTE, model_card
from lorakit.export.loading import (
    adapter_on_4bit,
    auto_model_class,
    check_architecture,
    load_pretrained,
    peft_from_pretrained,
    save_tokenizer,
)
from lorakit.export.output import atomic_directory, check_output, parse_size
from lorakit.export.result import MergeOptions, MergeResult, require, say
from lorakit.export.sources import MergeSource, locate
from lorakit.export.verify import RELATIVE_TOLERANCE, Check, compare, probe_batch, probe_logits
from lorakit.model.router import fixed_routing_for
from lorakit.runlock import holding_run_lock

INDEX = "model.safetensors.index.json"
STRATEGIES = ("auto", "stream", "memory")


@holding_run_lock
def merge(
    source: str | Path,
    output: str | Path,
    *,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    base: str | None = None,
    force: bool = False,
    tolerance: float | None = None,
    compare_quantized: bool = False,
    strategy: str = "auto",
    verify: str = "auto",
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    allow_code: Collection[str] = (),
) -> MergeResult:
    """Merge the LoRA adapter of a run (or an adapter directory) into its base, or re-export a full
    fine-tuning run, as sharded safetensors with tokenizer, generation config and model card in `output`.

    dtype: bfloat16 | float16 | float32 (default: the run's model.dtype, else bfloat16). base: the base model
    (default: the run's model.name_or_path, else adapter_config.json's). force: replace a non-empty
    `output`. tolerance: relative logit tolerance (default RELATIVE_TOLERANCE[dtype]). compare_quantized
    (QLoRA): also report the merged model against the adapter on the 4-bit base it was trained with.
    strategy: auto (shard by shard where the merge is per tensor, else in memory, saying why) | stream |
    memory. trust_remote_code, allow_pickle, allow_code (modules the run's recipe may import): the caller's, never the run directory's. verify (streaming): the whole-model logits check auto (where there is memory for one model
    copy) | always | never; the in-memory merge always runs it.
    Raises AdapterError / MergeError for bad input and VerificationError when a check fails; `output` is
    then left as it was."""
    src = locate(
        source, base, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle, allow_code=allow_code
    )
    dtype = dtype or src.default_dtype
    tol = _tolerance(dtype, tolerance)
    shard_bytes = parse_size(max_shard_size)
    if compare_quantized and src.method != "qlora":
        raise MergeError(
            f"--compare-quantized: {src.path} is a {src.method} run, not QLoRA",
            doc="docs/merge.md#qlora-runs",
        )
    _check_choice("--strategy", strategy, STRATEGIES)
    from lorakit.export.stream_job import VERIFY

    _check_choice("--verify-logits", verify, VERIFY)
    protect = [src.path] + ([Path(src.base_source)] if Path(src.base_source).is_dir() else [])
    out = check_output(Path(output), force, protect)
    adapter = read_adapter(src.path) if src.kind == "adapter" else None
    auto_cls, config = auto_model_class(src)
    if strategy != "memory":
        from lorakit.export.stream_job import merge_streamed, streaming_plan

        streamed = streaming_plan(src, adapter, auto_cls, config, dtype, strategy == "stream")
        if streamed is not None:
            options = MergeOptions(force, dtype, tol, shard_bytes, verify, compare_quantized)
            return merge_streamed(streamed, src, adapter, out, auto_cls, config, options)
    batch = probe_batch(config, config.get_text_config().vocab_size)  # Gemma 3: its text_config holds it
    # Routed models: every probe after the reference's is forced to its routing (export/verify.py).
    routing = fixed_routing_for(config)
    if adapter is None:
        done = _full_model(src, auto_cls, dtype, batch, routing)
    else:
        done = _merge_adapter(src, adapter, auto_cls, config, dtype, batch, tol, compare_quantized, routing)
    shards = _save_verified(done, src, out, force, auto_cls, config, dtype, batch, tol, shard_bytes, routing)
    plural = "s" if shards != 1 else ""
    say(
        f"saved:    {out} ({shards} safetensors shard{plural}, {dtype}) + tokenizer, generation config, README.md"
    )
    return MergeResult(out, src.method, src.base_name, dtype, shards, tuple(done.checks), done.quantized)


def _check_choice(option: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise MergeError(
            f"{option} {value!r}: choose one of {', '.join(choices)}", doc="docs/merge.md#options"
        )


def _tolerance(dtype: str, tolerance: float | None) -> float:
    """The relative logit tolerance: `tolerance`, else the dtype's default; refuses unknown dtypes."""
    if dtype not in RELATIVE_TOLERANCE:
        raise MergeError(
            f"--dtype {dtype!r}: choose one of {', '.join(RELATIVE_TOLERANCE)}", doc="docs/merge.md#options"
        )
    tol = RELATIVE_TOLERANCE[dtype] if tolerance is None else float(tolerance)
    if not tol > 0:
        raise MergeError(
            f"--tolerance {tolerance!r}: must be a positive number", doc="docs/merge.md#tolerances"
        )
    return tol


@dataclass
class _Exported:
    """The model to save, the logits its saved copy must reproduce, and what was checked and noted."""

    model: Any
    reference: torch.Tensor
    against: str
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    quantized: Check | None = None


def _full_model(src: MergeSource, auto_cls, dtype: str, batch, routing=None) -> _Exported:
    """A full fine-tuning run: its model as it is, in `dtype`."""
    say(f"exporting: the fully fine-tuned model {src.path} in {dtype}")
    model = load_pretrained(auto_cls, src.base_source, getattr(torch, dtype), src)
    return _Exported(model, probe_logits(model, batch, routing), "the run's model")


def _merge_adapter(
    src: MergeSource,
    adapter: Adapter,
    auto_cls,
    config,
    dtype: str,
    batch,
    tol: float,
    compare_quantized: bool,
    routing=None,
) -> _Exported:
    """The adapter merged into its base, checked against the adapter model (and, with compare_quantized,
    reported against the adapter on the 4-bit base)."""
    say(f"merging: {adapter.describe()} into {src.base_name} ({src.base_source}) in {dtype}")
    check_architecture(src, config)
    notes: list[str] = []
    if src.method == "qlora":
        notes.append(QLORA_NOTE.format(dtype=dtype))
        say(notes[-1])
    quantized_ref = adapter_on_4bit(src, auto_cls, batch) if compare_quantized else None
    model, reference, base_logits = _merged_model(
        src, adapter, auto_cls, getattr(torch, dtype), batch, routing
    )
    merged = probe_logits(model, batch, routing)
    against = "the adapter model" + (" (on the unquantized base)" if src.method == "qlora" else "")
    check = require(compare(f"merged vs {against}", merged, reference, tol, base_logits))
    if not check.effect_visible:
        notes.append(
            f"warning: the adapter moves the probe logits by at most {check.adapter_effect:.3g}, "
            f"within the {dtype} tolerance, so this check cannot tell the merged model from the base"
        )
        say(notes[-1])
    quantized = None
    if quantized_ref is not None:
        quantized = compare(
            "merged vs the adapter on the 4-bit base it was trained with (quantization error, reported only)",
            merged,
            quantized_ref,
            tol,
        )
        say(quantized.describe())
    return _Exported(model, reference, against, [check], notes, quantized)


def _save_verified(
    done: _Exported,
    src: MergeSource,
    out: Path,
    force: bool,
    auto_cls,
    config,
    dtype,
    batch,
    tol,
    shard_bytes,
    routing=None,
) -> int:
    """Save the model, tokenizer and card into a temporary sibling of `out`, reload it and check it again,
    then move it into place; returns the number of shards."""
    model, model_class = done.model, type(done.model).__name__
    done.model = None  # the reference below is the only one, so `del model` frees it before the reload
    with atomic_directory(out, force) as tmp:
        # Training turns the KV cache off (and a full run saves that); a served model wants it on.
        model.config.use_cache = True
        _save_model(model, tmp, shard_bytes)
        save_tokenizer(src, tmp, done.notes)
        del model
        gc.collect()
        # What a user will load: the directory just written, read back by transformers.
        reloaded = load_pretrained(auto_cls, str(tmp), getattr(torch, dtype), None)
        reloaded_logits = probe_logits(reloaded, batch, routing)
        del reloaded
        done.checks.append(
            require(compare(f"saved copy, reloaded, vs {done.against}", reloaded_logits, done.reference, tol))
        )
        shards = _count_shards(tmp)
        card = model_card(
            src,
            dtype=dtype,
            model_class=model_class,
            is_encoder_decoder=bool(getattr(config, "is_encoder_decoder", False)),
            shards=shards,
            checks=[*done.checks, *([done.quantized] if done.quantized else [])],
            notes=done.notes,
        )
        (tmp / CARD).write_text(card)
    return shards


def _merged_model(src: MergeSource, adapter: Adapter, auto_cls, torch_dtype, batch, routing=None):
    """(merged model, reference logits of the adapter model, logits of the base alone), one model copy."""
    model = load_pretrained(auto_cls, src.base_source, torch_dtype, src)
    check_fits(adapter, model, src.base_name)
    peft_model = peft_from_pretrained(model, str(src.path), is_trainable=False)
    reference = probe_logits(peft_model, batch, routing)
    with peft_model.disable_adapter():
        base_logits = probe_logits(peft_model, batch, routing)
    return _merge_weights(peft_model), reference, base_logits


def _merge_weights(peft_model):
    """peft adds B A x scale to each adapted weight in place and drops the LoRA layers; safe_merge refuses a
    merge that would put NaNs in a weight."""
    return peft_model.merge_and_unload(safe_merge=True)


def _save_model(model, directory: Path, shard_bytes: int) -> None:
    """Sharded safetensors (+ index when more than one shard), config and generation config (whose decoder
    start token, for an encoder-decoder, is the one its family reads from the checkpoint)."""
    from lorakit.model.families.start import start_generation_on_it

    start_generation_on_it(model, model.config)
    model.save_pretrained(str(directory), max_shard_size=shard_bytes)


def _count_shards(directory: Path) -> int:
    index = directory / INDEX
    if not index.is_file():
        return len(list(directory.glob("*.safetensors")))
    weight_map: dict[str, Any] = json.loads(index.read_text())["weight_map"]
    return len(set(weight_map.values()))
