"""Speed: forward + backward of one transformer block (one per stack for encoder-decoders) at the recipe's
dimensions and sequence length, loaded as training loads it (attention backend, packing, dtype, adapter,
checkpointing), timed on this device; FLOPs counted by torch.utils.flop_counter (the recompute of
checkpointing included), against the device's peak where it is known; and an estimate of the whole run."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from lorakit.doctor.result import CheckResult, passed, skipped
from lorakit.meter import peak_tflops
from lorakit.model.families.start import decoder_start_token_id

SECTION = "speed"
# On CPU the block is scaled to stay quick: at most this hidden size and this many tokens per batch.
CPU_MAX_WIDTH, CPU_MAX_TOKENS = 512, 512
DEFAULT_AUTO_LENGTH = 2048


def _length(value, config, notes: list[str], field: str, default: int | None = None) -> int:
    if isinstance(value, int):
        return value
    if default is None:
        limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
        default = min(limit or DEFAULT_AUTO_LENGTH, DEFAULT_AUTO_LENGTH)
    notes.append(f"{field} auto: timed at {default} tokens")
    return default


def batch_rows(recipe, config, cap: int | None, notes: list[str]) -> tuple[list[dict], bool]:
    """Random examples filling one micro-batch as the recipe shapes it, and whether it is packed; with
    `cap`, at most that many source tokens (noted)."""
    from lorakit.model.attention import packing_enabled

    d, t = recipe.data, recipe.train
    enc_dec = bool(getattr(config, "is_encoder_decoder", False))
    attention = "sdpa" if recipe.model.attention == "auto" else recipe.model.attention
    packed = packing_enabled(d.packing, attention, enc_dec, config.model_type)
    if enc_dec:
        src = _length(d.max_source_length, config, notes, "data.max_source_length")
        tgt = _length(d.max_target_length, config, notes, "data.max_target_length", max(16, src // 4))
        n = t.micro_batch_size
    else:
        src, tgt = _length(d.max_length, config, notes, "data.max_length"), 0
        row = (t.max_tokens or t.micro_batch_size * src) if packed else t.micro_batch_size * src
        n = max(1, row // src)
    if cap is not None and n * src > cap:
        src = min(src, cap)
        tgt = min(tgt, max(1, cap // 4)) if enc_dec else 0
        n = max(1, cap // src)
        notes.append(f"CPU: capped at {n} example(s) of {src} tokens")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(4, 2000, (src,), generator=gen).tolist()
        labels = torch.randint(4, 2000, (tgt,), generator=gen).tolist() if enc_dec else ids
        rows.append({"input_ids": ids, "labels": labels})
    return rows, packed


def _collator(built, rows: list[dict], packed: bool):
    """The training collator of the recipe's layout, its packed rows sized to hold `rows`."""
    from lorakit.data import collate

    if not packed:
        from lorakit.doctor.contracts import collators

        return collators(built, packed=False)[1]
    src = sum(len(r["input_ids"]) for r in rows)
    if built.is_encoder_decoder:
        tgt = sum(len(r["labels"]) for r in rows)
        return collate.PackedSeq2SeqCollator(src, tgt, decoder_start_token_id(built.model.config))
    return collate.PackedCausalCollator(max_tokens=src)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_block(recipe, config, device: str, *, quick: bool) -> dict:
    """Build one block per stack as training would, time forward + backward on one micro-batch; returns the
    measurements (seconds per step, tokens, counted FLOPs) and notes on what was scaled."""
    from torch.utils.flop_counter import FlopCounterMode

    from lorakit.doctor.models import save_block_model, with_model
    from lorakit.model import build_model
    from lorakit.model.loss import token_loss_sum

    notes: list[str] = []
    cpu = device == "cpu"
    with tempfile.TemporaryDirectory(prefix="lorakit-doctor-block-") as tmp:
        scale = save_block_model(config, Path(tmp), recipe.model.dtype, CPU_MAX_WIDTH if cpu else None)
        if scale != 1.0:
            notes.append(f"CPU: widths scaled by {scale:.3g} (hidden size {CPU_MAX_WIDTH})")
        built = build_model(with_model(recipe, tmp))
    model = built.model.to(device).train()
    rows, packed = batch_rows(recipe, config, CPU_MAX_TOKENS if cpu else None, notes)
    batch = _collator(built, rows, packed and built.packing)(rows)

    def step() -> None:
        logits = built.inputs.logits(model, batch, device)
        token_loss_sum(logits, batch["labels"]).backward()
        model.zero_grad(set_to_none=True)

    with FlopCounterMode(display=False) as counter:
        step()  # also the warm-up (kernels chosen, caches allocated)
    flops = counter.get_total_flops()
    iters = 1 if quick else 3 if device == "cpu" else 10
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    _sync(device)
    seconds = (time.perf_counter() - start) / iters
    tokens = sum(len(r["input_ids"]) + (len(r["labels"]) if built.is_encoder_decoder else 0) for r in rows)
    return {"seconds": seconds, "tokens": tokens, "flops": flops, "packed": packed and built.packing,
            "attention": built.attention, "notes": notes, "width_scale": scale}  # fmt: skip


def block_speed(
    recipe, config, device: str, *, quick: bool, device_name: str | None
) -> tuple[CheckResult, dict]:
    """The block's tokens/s and achieved TFLOP/s (and share of the device's peak)."""
    m = time_block(recipe, config, device, quick=quick)
    tflops = m["flops"] / m["seconds"] / 1e12
    peak = peak_tflops(device_name) if device != "cpu" else None
    share = f", {100 * tflops / peak:.0f}% of the {peak:.0f} TFLOP/s bf16 peak" if peak else (
        ", peak of this device unknown")  # fmt: skip
    detail = (
        f"one block per stack on {device_name or device} ({m['attention']}"
        f"{', packed' if m['packed'] else ''}): {m['tokens'] / m['seconds']:,.0f} tokens/s, "
        f"{tflops:.3g} TFLOP/s achieved{share}"
    )
    if m["notes"]:
        detail += " [" + "; ".join(m["notes"]) + "]"
    data = {**m, "tokens_per_second": m["tokens"] / m["seconds"], "tflops": tflops, "peak_tflops": peak}
    return passed(SECTION, "block forward+backward", detail, **data), data


def _train_tokens(recipe, encoder_decoder: bool) -> int | None:
    """Tokens of one epoch of the recipe's training data, when it is local (builtin or files): tokenized and
    cached as `python -m lorakit.prepare` would; None for hub data (no network here)."""
    source = recipe.data.source
    if not isinstance(source, str) or not (
        source.startswith("builtin:") or Path(source).expanduser().exists()
    ):
        return None
    from lorakit.preflight import prepare

    train = prepare(recipe).train
    # Causal rows' labels are their input_ids again; an encoder-decoder's are the decoder's tokens.
    keys = ("input_ids", "labels") if encoder_decoder else ("input_ids",)
    return sum(len(x) for key in keys for x in train[key])


def run_estimate(recipe, config, block: dict, devices: int) -> CheckResult:
    """The whole run's training time from the block's speed: layers x block time per token, over the
    epochs' tokens on `devices` devices (the head, evaluation and saving not counted)."""
    if block.get("width_scale", 1.0) != 1.0:
        return skipped(SECTION, "run time estimate", "the block was scaled down to run on CPU: no estimate of the "
                       "real run from it")  # fmt: skip
    capped = any("capped" in n for n in block["notes"])
    # An encoder-decoder like T5Gemma keeps its layer counts in its encoder and decoder configs.
    configs = (config, getattr(config, "encoder", None), getattr(config, "decoder", None))
    layers = max(
        getattr(c, k, 0) or 0
        for c in configs
        for k in ("num_hidden_layers", "num_layers", "num_decoder_layers")
    )
    t = recipe.train
    per_device_tps = block["tokens_per_second"] / max(layers, 1)
    if t.max_steps is not None:
        tokens_per_step = block["tokens"] * t.gradient_accumulation_steps * devices
        tokens, basis = t.max_steps * tokens_per_step, f"train.max_steps {t.max_steps}"
    else:
        epoch = _train_tokens(recipe, bool(getattr(config, "is_encoder_decoder", False)))
        if epoch is None:
            return skipped(SECTION, "run time estimate", "the training data is on the hub: run "
                           "`python -m lorakit.prepare RECIPE` first, or set train.max_steps")  # fmt: skip
        tokens, basis = epoch * t.epochs, f"{t.epochs} epoch(s) of {epoch:,} tokens"
    seconds = tokens / (per_device_tps * devices)
    detail = (
        f"about {_duration(seconds)} on {devices} device(s) for {basis} ({layers} layers at the block's speed; "
        "evaluation, saving and the output head not counted"
        + (
            "; timed at the capped CPU sequence length, so long sequences' attention is undercounted)"
            if capped
            else ")"
        )
    )
    return passed(SECTION, "run time estimate", detail, seconds=seconds, tokens=tokens, devices=devices)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
