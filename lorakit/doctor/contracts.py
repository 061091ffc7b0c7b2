"""The contracts lorakit's correctness rests on, as functions returning CheckResults: the doctor runs them on
the user's hardware with the kernels and dtype the recipe picks, and the tests run the same functions on
CPU (tests/integration/test_packed_attention.py, test_packed_seq2seq.py, tests/unit/test_chunked_loss.py).

- packing: a packed row (or a padded batch, when the recipe does not pack) computes exactly what each of
  its examples computes alone, through ModelInputs.logits as the training loop calls it;
- chunked_ce: the chunked fp32 token loss equals one cross-entropy over the whole row, loss and gradient;
- merge: the LoRA weights merged into the base give the adapter model's logits;
- accumulation: micro-batches of very different token counts, each scaled by micro_batch_loss, give the
  gradient of the token-weighted mean over the whole window.

Tolerances are relative to the reference's scale (the largest |logit| or |gradient|, at least 1 for logits)
and set per dtype, as lorakit.merge's (export/verify.py): float32 compares kernels that agree to rounding,
bf16 keeps 8 bits of mantissa. Measured on CPU, tiny:llama / tiny:t5 packed against alone: float32 3e-7 /
6e-7, bf16 0 / 1.1e-2; an attention that leaks across the examples of a row: 1.5 / 1.0 in either dtype, ten
times the bf16 tolerance.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from lorakit.doctor.result import CheckResult, failed, passed
from lorakit.export.verify import RELATIVE_TOLERANCE
from lorakit.model import loss as loss_fns
from lorakit.model.families.start import decoder_start_token_id

SECTION = "contracts"
# Example lengths of the causal packing contract: longer than tiny:mistral's sliding window (64), so the
# window is exercised inside an example.
CAUSAL_LENGTHS = (37, 90, 5, 71)
# (source, target) lengths of the seq2seq contract: sources longer than T5's relative-attention max distance
# (128), and examples close enough in size that varlen SDPA attends to them in padded groups.
SEQ2SEQ_PAIRS = ((37, 9), (150, 20), (5, 3), (71, 14), (64, 12), (60, 12), (58, 10), (5, 3))
# Largest difference allowed, relative to the reference's scale, by compute dtype (module docstring).
TOLERANCE = RELATIVE_TOLERANCE
ATTENTION_ADVICE = "use model.attention: sdpa (or eager), and report the backend and versions in doctor.md"


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def prepare_for_contract(built, seed: int = 0):
    """`built` (a BuiltModel) with a non-zero LoRA update (B starts at zero, which would hide the adapter's
    path), dropout off (random per token, so no two forwards would agree) and in train mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in built.model.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.05).to(p.dtype))
    # Dropout lives in nn.Dropout modules and, for attention weights, as a float on attention modules (T5).
    for m in built.model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        elif isinstance(getattr(m, "dropout", None), float):
            m.dropout = 0.0
    built.model.train()
    return built


def vocab_size(config) -> int:
    """The vocabulary of a model config, a multimodal checkpoint's language model's (Gemma 3)."""
    from lorakit.model.families.base import text_config

    return text_config(config).vocab_size


def contract_rows(built, seed: int = 0) -> list[dict[str, list[int]]]:
    """Fixed random examples for `built`'s family: prompt/response rows (loss on the second half) for causal
    LMs, (source, target) pairs for encoder-decoders."""
    gen = torch.Generator().manual_seed(seed)
    vocab = vocab_size(built.model.config)
    if built.is_encoder_decoder:
        return [
            {
                "input_ids": torch.randint(3, vocab, (s,), generator=gen).tolist(),
                "labels": torch.randint(3, vocab, (t,), generator=gen).tolist(),
            }
            for s, t in SEQ2SEQ_PAIRS
        ]
    from lorakit.data.collate import IGNORE_INDEX

    rows = []
    for n in CAUSAL_LENGTHS:
        ids = torch.randint(4, vocab, (n,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * (n // 2) + ids[n // 2 :]})
    return rows


def collators(built, packed: bool):
    """(collator of one example alone, collator of the batch the recipe trains on)."""
    from lorakit.data import collate

    if built.is_encoder_decoder:
        start = decoder_start_token_id(built.model.config)
        alone = collate.Seq2SeqCollator(0, start)
        return alone, (collate.PackedSeq2SeqCollator(4096, 1024, start) if packed else alone)
    alone = collate.CausalCollator(0)
    return alone, (collate.PackedCausalCollator(max_tokens=4096) if packed else alone)


def attention_kinds(built) -> str:
    """The attention kinds a packing contract on `built` covers, in words."""
    if built.is_encoder_decoder:
        return "encoder self, decoder self and cross attention"
    from lorakit.model.families.base import text_config

    config = text_config(built.model.config)
    window = getattr(config, "sliding_window", None)
    layers = set(getattr(config, "layer_types", None) or ())
    if window and "full_attention" in layers:
        what = f" in layers alternating a {window}-token sliding window and full attention"
    else:
        what = f" with a {window}-token sliding window" if window and layers != {"full_attention"} else ""
    cap = getattr(config, "attn_logit_softcapping", None)
    return "causal self-attention" + what + (f", scores soft-capped at {cap:g}" if cap else "")


def _target_spans(rows, is_encoder_decoder: bool) -> list[tuple[int, int]]:
    """(start, end) of each example's logits in a packed row: consecutive spans of the input (causal) or
    label (encoder-decoder: the decoder row) lengths."""
    key = "labels" if is_encoder_decoder else "input_ids"
    spans, start = [], 0
    for r in rows:
        spans.append((start, start + len(r[key])))
        start += len(r[key])
    return spans


def _scale(t: torch.Tensor) -> float:
    return max(float(t.abs().max()), 1.0)


def packing(
    built, rows=None, *, packed: bool | None = None, device="cpu", tolerance: float | None = None
) -> CheckResult:
    """Packed == each example alone: the logits and token loss of every example, computed alone and inside
    the batch the recipe trains on (packed when `packed`, default built.packing; else padded)."""
    packed = built.packing if packed is None else packed
    rows = contract_rows(built) if rows is None else rows
    tol = TOLERANCE[dtype_name(built.inputs.dtype)] if tolerance is None else tolerance
    alone_collate, batch_collate = collators(built, packed)
    batch = batch_collate(rows)
    logits = built.inputs.logits(built.model, batch, device).detach().float()
    spans = _target_spans(rows, built.is_encoder_decoder)
    worst, worst_loss, worst_example = 0.0, 0.0, 0
    for i, r in enumerate(rows):
        single = alone_collate([r])
        ref = built.inputs.logits(built.model, single, device).detach().float()[0]
        if packed:
            got, labels = logits[0, spans[i][0] : spans[i][1]], batch["labels"][0, spans[i][0] : spans[i][1]]
        else:
            got, labels = logits[i, : ref.shape[0]], batch["labels"][i, : ref.shape[0]]
        rel = float((got - ref).abs().max()) / _scale(ref)
        ref_loss = float(loss_fns.token_loss_sum(ref[None], single["labels"].to(ref.device)))
        got_loss = float(loss_fns.token_loss_sum(got[None], labels.to(got.device)))
        rel_loss = abs(ref_loss - got_loss) / max(abs(ref_loss), 1.0)
        if max(rel, rel_loss) > max(worst, worst_loss):
            worst_example = i
        worst, worst_loss = max(worst, rel), max(worst_loss, rel_loss)
    what = "packed" if packed else "padded"
    name = "packed == alone" if packed else "padded == alone"
    kinds = attention_kinds(built)
    data = {"max_relative_logit_diff": worst, "max_relative_loss_diff": worst_loss, "tolerance": tol,
            "attention": built.attention, "kinds": kinds, "examples": len(rows)}  # fmt: skip
    detail = (
        f"{len(rows)} examples {what} on {built.attention} ({kinds}): max logit diff {worst:.1e}, "
        f"loss diff {worst_loss:.1e} of scale (tolerance {tol:.0e})"
    )
    if worst <= tol and worst_loss <= tol:
        return passed(SECTION, name, detail, **data)
    return failed(
        SECTION,
        name,
        detail + f"; worst: example {worst_example}",
        f"{what} attention leaked on this backend ({built.attention}): examples sharing a {what} batch see "
        "each other, so training learns from tokens it must not see while the loss still falls",
        ATTENTION_ADVICE if packed else "use model.attention: sdpa or eager, and report this in doctor.md",
        **data,
    )


def chunked_ce(
    vocab: int, dtype: torch.dtype, *, device="cpu", tokens: int = 64, chunk_tokens: int = 7
) -> CheckResult:
    """Chunked CE == full CE: lorakit's chunked fp32 token loss (model/loss.py) against one fp32
    cross-entropy over the whole row, loss and gradient, for `vocab` logits in `dtype` on `device`."""
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(tokens, vocab, generator=gen)).to(device=device, dtype=dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    labels[: tokens // 5] = -100  # prompt tokens: no loss
    ref = F.cross_entropy(logits.float(), labels, reduction="sum")
    (ref_grad,) = torch.autograd.grad(ref, logits)
    out = loss_fns.token_loss_sum(logits, labels, chunk_elements=chunk_tokens * vocab)
    (grad,) = torch.autograd.grad(out, logits)
    loss, ref_loss = float(out.detach()), float(ref.detach())
    loss_diff = abs(loss - ref_loss) / max(abs(ref_loss), 1.0)
    grad_diff = float((grad.float() - ref_grad.float()).abs().max()) / max(float(ref_grad.abs().max()), 1e-12)
    # The loss is fp32 either way; the gradient is rounded to the logits' dtype.
    loss_tol, grad_tol = 1e-5, (2**-7 if dtype in (torch.bfloat16, torch.float16) else 1e-5)
    detail = (
        f"{tokens} tokens x {vocab} vocab in {dtype_name(dtype)}, chunks of {chunk_tokens} tokens: loss diff "
        f"{loss_diff:.1e} (tolerance {loss_tol:.0e}), gradient diff {grad_diff:.1e} (tolerance {grad_tol:.0e})"
    )
    data = {"loss_diff": loss_diff, "grad_diff": grad_diff, "vocab": vocab, "dtype": dtype_name(dtype)}
    if loss_diff <= loss_tol and grad_diff <= grad_tol:
        return passed(SECTION, "chunked CE == full CE", detail, **data)
    return failed(
        SECTION,
        "chunked CE == full CE",
        detail,
        "the training loss (or its gradient) computed in chunks differs from one cross-entropy over the row: "
        "every step would train on a wrong loss",
        "report doctor.md as a bug: this is lorakit's own kernel (lorakit/model/loss.py) on this device",
        **data,
    )


def _peft_merge(model):
    return model.merge_and_unload(safe_merge=True)


def merge(built, device="cpu", tolerance: float | None = None, merge_fn=_peft_merge) -> CheckResult:
    """LoRA merged == adapter: the probe logits of a copy of `built` with the adapter merged into its
    weights (`merge_fn`: peft's merge_and_unload, as lorakit.merge does) against the adapter model's. A
    routed model is probed with the adapter model's routing forced on the others (export/verify.py)."""
    from lorakit.export.verify import compare, probe_batch, probe_logits
    from lorakit.model.router import fixed_routing_for

    dtype = dtype_name(built.inputs.dtype)
    tol = TOLERANCE[dtype] if tolerance is None else tolerance
    config = built.model.config
    batch = {k: v.to(device) for k, v in probe_batch(config, config.vocab_size).items()}
    model = copy.deepcopy(built.model)
    routing = fixed_routing_for(config)
    reference = probe_logits(model, batch, routing)
    with model.disable_adapter():
        base = probe_logits(model, batch, routing)
    merged = probe_logits(merge_fn(model), batch, routing)
    check = compare("merged == adapter", merged, reference, tol, base)
    data = {k: v for k, v in check.to_dict().items() if k != "name"} | {"routing_fixed": routing is not None}
    detail = check.describe() + (f"; {routing.describe()}" if routing is not None else "")
    if check.passed and check.effect_visible:
        return passed(SECTION, "LoRA merged == adapter", detail, **data)
    why = "the merged weights do not reproduce the adapter model" if not check.passed else (
        "the adapter's own effect is within the tolerance, so this comparison could not tell a merge from none")  # fmt: skip
    return failed(
        SECTION,
        "LoRA merged == adapter",
        detail,
        f"{why}: an exported model would not be the one you trained",
        "report doctor.md as a bug (peft and torch versions matter here); export with lorakit.merge, which "
        "refuses such a merge",
        **data,
    )


def accumulation(built, rows=None, *, device="cpu", tolerance: float | None = None) -> CheckResult:
    """Token-weighted loss across accumulation: the LoRA gradient of one batch's loss sum / its target
    tokens equals the sum over two micro-batches of very different token counts, each scaled by
    micro_batch_loss (as the loop does), through the recipe's batch layout."""
    # Four examples (all of the causal ones): the split below is one against the rest.
    rows = contract_rows(built, seed=2)[:4] if rows is None else rows
    tol = TOLERANCE[dtype_name(built.inputs.dtype)] if tolerance is None else tolerance
    _, collate = collators(built, built.packing)
    trainable = [(n, p) for n, p in built.model.named_parameters() if p.requires_grad]

    def grads(batches: list[dict[str, Any]], window_tokens: float) -> dict[str, torch.Tensor]:
        built.model.zero_grad()
        for batch in batches:
            logits = built.inputs.logits(built.model, batch, device)
            s = loss_fns.token_loss_sum(logits, batch["labels"])
            loss_fns.micro_batch_loss(s, window_tokens, world_size=1).backward()
        return {n: p.grad.detach().float().clone() for n, p in trainable if p.grad is not None}

    whole = collate(rows)
    total = float(whole["num_target_tokens"])
    want = grads([whole], total)
    got = grads([collate(rows[:1]), collate(rows[1:])], total)
    built.model.zero_grad()
    scale = max((g.abs().max().item() for g in want.values()), default=0.0)
    diff = max(((got[n] - want[n]).abs().max().item() for n in want), default=0.0)
    rel = diff / scale if scale else float("inf")
    split = (float(collate(rows[:1])["num_target_tokens"]), total)
    detail = (
        f"{len(want)} trainable tensors, micro-batches of {split[0]:.0f} and {split[1] - split[0]:.0f} target "
        f"tokens vs one of {total:.0f}: max gradient diff {rel:.1e} of scale (tolerance {tol:.0e})"
    )
    data = {"max_relative_grad_diff": rel, "tolerance": tol, "target_tokens": total}
    if rel <= tol:
        return passed(SECTION, "token-weighted accumulation", detail, **data)
    return failed(
        SECTION,
        "token-weighted accumulation",
        detail,
        "a step accumulated over micro-batches is not the token-weighted mean of the whole step: examples in "
        "short micro-batches weigh more than they should",
        "report doctor.md as a bug (lorakit/model/loss.py micro_batch_loss)",
        **data,
    )
