"""One streaming merge: the base read shard by shard, each LoRA delta added in float32, each merged tensor
checked against W + scale * B A and written straight into the output shard, every shard read back; then
config, generation config, tokenizer and card, and (on request, or where the machine has room for one copy
of the model) the whole-model logits check; all in a temporary directory renamed into place at the end.

Memory: one tensor at a time in float32 (a few copies of the largest adapted matrix) plus the adapter,
whatever the model's size; the logits check, when it runs, loads the model (one copy at a time).
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from lorakit.errors import MergeError, VerificationError
from lorakit.export.adapter import Adapter
from lorakit.export.card import CARD, QLORA_NOTE, model_card
from lorakit.export.loading import (
    adapter_on_4bit,
    check_architecture,
    load_pretrained,
    peft_from_pretrained,
    save_tokenizer,
)
from lorakit.export.output import atomic_directory
from lorakit.export.result import MergeOptions, MergeResult, TensorCheck, require, say
from lorakit.export.shards import (
    Reader,
    ShardWriter,
    check_written,
    plan_shards,
    shard_names,
    write_index,
)
from lorakit.export.sources import MergeSource
from lorakit.export.stream import CannotStream, Probe, StreamPlan, merge_tensor, plan
from lorakit.export.verify import compare, probe_batch, probe_logits
from lorakit.model.families.start import start_generation_on_it
from lorakit.model.router import fixed_routing_for

VERIFY = ("auto", "always", "never")
# The logits check loads the base (then the export) once: room means that much memory, plus working space.
_VERIFY_MARGIN, _VERIFY_SLACK = 1.25, 1 << 30


def streaming_plan(src: MergeSource, adapter: Adapter | None, auto_cls, config, dtype: str, required: bool):
    """The streaming merge's plan, or None (said why) when this merge must run in memory."""
    if adapter is not None:
        check_architecture(src, config)
    try:
        return plan(src, adapter, auto_cls, config, dtype)
    except CannotStream as e:
        if required:
            raise MergeError(
                f"--strategy stream: this merge cannot run shard by shard: {e}", doc="docs/merge.md#streaming"
            ) from e
        say(f"note: merging in memory (one copy of the model), not shard by shard: {e}")
        return None


def room_for_logits_check(plan: StreamPlan) -> bool:
    """Whether this machine has the memory for the whole-model logits check (one copy of the model)."""
    import psutil

    return psutil.virtual_memory().available > _VERIFY_MARGIN * plan.output_bytes + _VERIFY_SLACK


def merge_streamed(
    plan: StreamPlan,
    src: MergeSource,
    adapter: Adapter | None,
    out: Path,
    auto_cls,
    config,
    options: MergeOptions,
) -> MergeResult:
    """Merge shard by shard into `out` (atomically) and return what was written and checked."""
    dtype, verify = options.dtype, options.verify
    what = adapter.describe() if adapter is not None else f"the fully fine-tuned model {src.path}"
    verb = "merging" if adapter is not None else "exporting"
    say(f"{verb} (streaming, shard by shard): {what} into {src.base_name} ({plan.base_dir}) in {dtype}")
    notes = list(plan.notes)
    if src.method == "qlora":
        notes.append(QLORA_NOTE.format(dtype=dtype))
        say(notes[-1])
    logits = verify == "always" or (verify == "auto" and room_for_logits_check(plan))
    if not logits:
        why = "--verify-logits never" if verify == "never" else "not enough free memory for one model copy"
        notes.append(f"whole-model logits check skipped ({why}); every tensor was checked")
        say(notes[-1])
    checks, quantized = [], None
    with atomic_directory(out, options.force) as tmp:
        shards, tensor_check = write_shards(plan, tmp, options.shard_bytes)
        say(tensor_check.describe())
        notes.append(tensor_check.describe())
        _save_config(plan, src, config, getattr(torch, dtype), tmp)
        save_tokenizer(src, tmp, notes)
        if logits:
            check, quantized = _logits_check(
                src, adapter, auto_cls, config, dtype, options.tol, tmp, options.compare_quantized
            )
            checks.append(check)
            if not check.effect_visible:
                notes.append(
                    f"warning: the adapter moves the probe logits by at most {check.adapter_effect:.3g}, "
                    f"within the {dtype} tolerance, so this check cannot tell the merged model from the base"
                )
                say(notes[-1])
        card = model_card(
            src,
            dtype=dtype,
            model_class=plan.model_class,
            is_encoder_decoder=bool(getattr(config, "is_encoder_decoder", False)),
            shards=shards,
            checks=[*checks, *([quantized] if quantized else [])],
            notes=notes,
        )
        (tmp / CARD).write_text(card)
    plural = "s" if shards != 1 else ""
    say(
        f"saved:    {out} ({shards} safetensors shard{plural}, {dtype}) + tokenizer, generation config, README.md"
    )
    return MergeResult(
        out, src.method, src.base_name, dtype, shards, tuple(checks), quantized, "stream", tensor_check
    )


def write_shards(plan: StreamPlan, directory: Path, shard_bytes: int) -> tuple[int, TensorCheck]:
    """Write the merged weights into `directory` as shards of at most shard_bytes (+ index); returns the
    number of shards and the tensor check. Raises VerificationError on a merged tensor that is not
    finite or not W + scale * B A, or a shard that does not read back as written."""
    items = plan.items
    groups = plan_shards(items, shard_bytes)
    names = shard_names(len(groups))
    reader, gen = Reader(), torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    worst, total = 0.0, 0
    try:
        for n, (name, group) in enumerate(zip(names, groups, strict=True), 1):
            writer = ShardWriter(directory / name, [items[i] for i in group])
            try:
                for i in group:
                    entry, out_dtype = plan.entries[i], items[i][2]
                    w = reader.get(entry)
                    delta = plan.deltas.get(entry.key)
                    if delta is None:
                        tensor = w.to(out_dtype)
                    else:
                        probe = Probe.of(w, gen)
                        tensor = _merged(entry.key, w, delta, out_dtype)
                        worst = max(worst, _checked(entry.key, tensor, probe, delta))
                    writer.write(entry.key, tensor)
                    weight_map[entry.key] = name
                    del w, tensor
            except BaseException:
                writer.abort()
                raise
            writer.close()
            check_written(writer.path, writer.crcs)
            total += writer.size
            if len(groups) > 1:
                say(f"  shard {n}/{len(groups)} written ({writer.size / 1e9:.2f} GB)")
    finally:
        reader.close()
    if len(groups) > 1:
        write_index(directory, weight_map, total)
    return len(groups), TensorCheck(len(items), len(plan.deltas), worst)


def _merged(key: str, w: torch.Tensor, delta, out_dtype: torch.dtype) -> torch.Tensor:
    merged = merge_tensor(w, delta)  # may change w in place
    if not torch.isfinite(merged).all():
        raise VerificationError(
            f"merge refused, nothing written: {key} holds NaN or inf after adding the adapter's {delta.module}",
            doc="docs/merge.md#what-is-checked",
        )
    return merged.to(out_dtype)


def _checked(key: str, tensor: torch.Tensor, probe: Probe, delta) -> float:
    r = probe.residual(tensor, delta)
    if not r <= 1:
        raise VerificationError(
            f"merge refused, nothing written: {key} is not W + scale * B A of {delta.module} within rounding "
            f"(residual {r:.3g} x the rounding bound)",
            doc="docs/merge.md#what-is-checked",
        )
    return r


def _save_config(plan: StreamPlan, src: MergeSource, config, torch_dtype: torch.dtype, directory: Path):
    """config.json as save_pretrained writes it for the merged model (use_cache on for serving), and the
    base's generation config (an encoder-decoder's starting its decoder on its family's start token)."""
    from transformers import GenerationConfig

    config = config.__class__.from_dict(config.to_dict())  # a copy: the caller's config stays as it is
    config.use_cache = True
    config.dtype = torch_dtype
    config.architectures = [plan.model_class]
    if plan.untie:
        config.tie_word_embeddings = False
    config.save_pretrained(str(directory))
    if not plan.can_generate:
        return
    try:
        gen = GenerationConfig.from_pretrained(str(plan.base_dir))
    except OSError:
        gen = GenerationConfig.from_model_config(config)
    start_generation_on_it(gen, config)
    gen.save_pretrained(str(directory))


def _logits_check(src, adapter, auto_cls, config, dtype, tol, directory, compare_quantized):
    """The export reloaded with from_pretrained against the adapter model (base + PeftModel, unmerged) or,
    for a full run, the run's model, on the probe batch."""
    batch = probe_batch(config, config.get_text_config().vocab_size)  # Gemma 3: its text_config holds it
    torch_dtype = getattr(torch, dtype)
    quantized_ref = adapter_on_4bit(src, auto_cls, batch) if compare_quantized else None
    model = load_pretrained(auto_cls, src.base_source, torch_dtype, src)
    base_logits = None
    routing = fixed_routing_for(config)  # routed models: the reference's routing forced (export/verify.py)
    if adapter is None:
        reference, against = probe_logits(model, batch, routing), "the run's model"
    else:
        model = peft_from_pretrained(model, str(src.path), is_trainable=False)
        reference = probe_logits(model, batch, routing)
        with model.disable_adapter():
            base_logits = probe_logits(model, batch, routing)
        against = "the adapter model" + (" (on the unquantized base)" if src.method == "qlora" else "")
    del model
    gc.collect()
    reloaded = load_pretrained(auto_cls, str(directory), torch_dtype, None)
    got = probe_logits(reloaded, batch, routing)
    del reloaded
    gc.collect()
    check = require(
        compare(f"merged vs {against} (the streamed export, reloaded)", got, reference, tol, base_logits)
    )
    quantized = None
    if quantized_ref is not None:
        quantized = compare(
            "merged vs the adapter on the 4-bit base it was trained with (quantization error, reported only)",
            got,
            quantized_ref,
            tol,
        )
        say(quantized.describe())
    return check, quantized
