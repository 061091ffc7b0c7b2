"""The shape the planner sizes activations for: token counts of one micro-batch (packed rows, padded
batches, DPO pairs), the attention kernels, and what `auto` lengths become (the option given, else the
model's maximum)."""

from __future__ import annotations

from lorakit.objectives import objective_type
from lorakit.planner.activations import Kernels, Shape
from lorakit.planner.arch import Arch
from lorakit.planner.units import PlanError


def positive(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{field}: expected a whole number >= 1, got {value!r}")
    return value


def _length(
    value, option: int | None, model_max: int | None, field: str, option_name: str, notes: list
) -> int:
    if isinstance(value, int):
        return value
    if option is not None:
        notes.append(f"{field} is auto: planned with {option_name}={option}")
        return positive(option, option_name)
    if model_max is None:
        raise PlanError(f"{field} is auto and the model's maximum length is unknown: pass {option_name}")
    notes.append(f"{field} is auto: planned with the model's maximum, {model_max} tokens (pass {option_name} "
                 "for the data's real length)")  # fmt: skip
    return model_max


def attention_label(requested: str, kernels: Kernels) -> str:
    """The attention the plan assumes, as the report says it: for auto, what the machine that trains picks
    (flash_attention_2 where it is installed, else SDPA), not what this machine has installed."""
    label = "sdpa or flash_attention_2 (model.attention auto, chosen where it trains; they plan alike)"
    return (label if requested == "auto" else kernels.attention) + (", packed rows" if kernels.packed else "")


def micro_batch_shape(
    recipe, arch: Arch, seq_len, target_len, device: str, notes: list
) -> tuple[Shape, Kernels, int | None]:
    """Token counts of one micro-batch, the attention kernels, and the smallest packed row allowed."""
    from lorakit.model.attention import packing_enabled

    d, t = recipe.data, recipe.train
    requested = recipe.model.attention
    # auto: flash_attention_2 or SDPA on GPUs; both keep no attention scores, so they plan alike.
    attention = "sdpa" if requested == "auto" else requested
    packed = packing_enabled(d.packing, attention, arch.is_encoder_decoder, arch.model_type)
    if attention == "flash_attention_2" and device == "cpu":
        raise PlanError("model.attention flash_attention_2 runs on GPUs only; plan with device='cuda'")
    kernels = Kernels(attention=attention, device=device, packed=packed)
    objective = objective_type(recipe)
    sequences = objective.passes(recipe).sequences
    if sequences > 1:
        notes += objective.plan_notes(recipe)
        return _sequences_shape(recipe, arch, seq_len, target_len, kernels, notes, sequences)
    if arch.is_encoder_decoder:
        src = _length(
            d.max_source_length, seq_len, arch.max_length, "data.max_source_length", "--seq-len", notes
        )
        tgt = _length(d.max_target_length, target_len, arch.max_length, "data.max_target_length", "--target-len",
                      notes)  # fmt: skip
        if packed:
            rows_src = t.max_tokens or t.micro_batch_size * src
            if not t.max_tokens:
                # Rows of micro_batch_size examples (or, with only max_target_tokens, a budget holding that
                # many on average): never more than this; plan for the most it can be.
                notes.append(
                    f"train.max_tokens unset: rows of {t.micro_batch_size} examples, planned at their most, "
                    f"{rows_src} encoder tokens"
                )
            rows_tgt = t.max_target_tokens or max(tgt, round(rows_src * tgt / src))
            if not t.max_target_tokens:
                notes.append(f"train.max_target_tokens unset: planned decoder rows of {rows_tgt} tokens")
            return Shape(1, rows_src, rows_tgt, example_len=src), kernels, src
        return Shape(t.micro_batch_size, src, tgt), kernels, None
    length = _length(d.max_length, seq_len, arch.max_length, "data.max_length", "--seq-len", notes)
    if packed:
        row = t.max_tokens or t.micro_batch_size * length
        sp = recipe.distributed.sequence_parallel
        return (
            Shape(1, row, None, example_len=min(length, row), sequence_parallel=sp),
            kernels,
            min(length, row),
        )
    notes.append("padded batches: planned every row at the full length (the longest row of a batch sets it)")
    return Shape(t.micro_batch_size, length, None), kernels, None


def _sequences_shape(recipe, arch: Arch, seq_len, target_len, kernels: Kernels, notes: list, n: int):
    """A micro-batch of an objective whose examples are `n` sequences each (DPO's pairs: lorakit.data.
    pair_collate). Causal LMs: n x micro_batch_size rows (packed: a row of
    train.max_tokens, by default micro_batch_size x n x data.max_length); encoder-decoders: each prompt
    once, the decoder n times (DPO: chosen and rejected)."""
    d, t = recipe.data, recipe.train
    if arch.is_encoder_decoder:
        src = _length(
            d.max_source_length, seq_len, arch.max_length, "data.max_source_length", "--seq-len", notes
        )
        tgt = _length(d.max_target_length, target_len, arch.max_length, "data.max_target_length", "--target-len",
                      notes)  # fmt: skip
        if kernels.packed:
            rows_src = t.max_tokens or t.micro_batch_size * src
            rows_tgt = t.max_target_tokens or max(tgt, round(rows_src * tgt / src))
            return Shape(1, rows_src, rows_tgt, example_len=src, decoder_passes=n), kernels, src
        return Shape(t.micro_batch_size, src, tgt, decoder_passes=n), kernels, None
    length = _length(d.max_length, seq_len, arch.max_length, "data.max_length", "--seq-len", notes)
    if kernels.packed:
        row = t.max_tokens or t.micro_batch_size * n * length
        return Shape(1, row, None, example_len=min(length, row)), kernels, min(length, row)
    return Shape(n * t.micro_batch_size, length, None), kernels, None
