"""The engine check every export ends with: transformers' greedy continuations of the probe prompts (from the
merged model in float32), against what the serving engine generates from the same token ids.

Which measure judges an export follows from what the engine rounds, not from the format's name. An engine that
computes in float32 throughout (float32 weights, and for llama.cpp a float32 LoRA adapter and KV cache) differs
from transformers by float32 summation order alone (3e-7 nats on the tiny Llama), so it must reproduce every
greedy token. Anything rounded to 16 or 8 bits on the way (the weights; a LoRA adapter llama.cpp applies at run
time in its own type, B(A x) added to W x rather than merged into W; llama.cpp's KV cache, f16 by default
whatever the weights) moves log-probabilities by 1e-4 nats or more, and on a tiny or uncertain model a near-tied
argmax then flips and changes the rest of the continuation. Those are judged teacher-forced: the engine's
log-probability of each token of transformers' continuation against transformers' own, the mean absolute
difference (nats) within QUANTIZED_LOGPROB_TOLERANCE of the coarsest rounding. Greedy token agreement is
reported too. Where the engine gives log-probabilities, exact ones must also match them within the 16-bit
tolerance (a model whose outputs are rescaled keeps its argmax but not its probabilities).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lorakit.errors import VerificationError

PROMPTS = (
    "Summarize the following news article:\nThe city council met on Tuesday to discuss the new park.\nSummary:",
    "A storm closed schools across the region for two days.",
    "The team won the final",
    "Prices rose again in March, the statistics office said.",
)
NEW_TOKENS = 16
# Mean |log p_engine - log p_transformers| (nats) on the reference tokens, per quantization family: 8-bit
# weights move a logit by a few hundredths on the tiny models (measured: below 0.1), half precision less.
QUANTIZED_LOGPROB_TOLERANCE = {"16bit": 0.05, "8bit": 0.5}
# Precisions that round nothing beyond float32: an engine computing only with these must equal transformers'
# greedy tokens. Everything else is judged by the teacher-forced measure: CTranslate2's float16 (weights rounded,
# computed in float32 on CPU: one of 4 probe prompts of the tiny T5 flipped at 0.00115 nats with one OpenMP
# thread), llama.cpp's f16 (one near-tied token of 64 of the tiny Llama at 0.00056 nats), and any GGUF as
# llama-cpp-python serves it: its f16 KV cache puts even an f32 GGUF at 0.00025 nats (3e-7 with an f32 cache),
# and the f16 adapter on the f32 base flipped one token of 64 at 0.000366 nats (a CI run).
FLOAT32 = ("float32", "f32")


@dataclass(frozen=True)
class Reference:
    """transformers' greedy continuation of each prompt (ids, EOS excluded) and their log-probabilities."""

    prompts: list[list[int]]
    continuations: list[list[int]]
    logprobs: list[list[float]]
    tokens: list[list[str]]  # the prompts as token strings (what CTranslate2 takes)
    eos: int | None
    seq2seq: bool


@dataclass(frozen=True)
class EngineCheck:
    """What the engine produced against the reference, and the verdict."""

    engine: str
    exact: bool  # the engine computes in float32 throughout: every greedy token must be equal
    sequences_equal: int
    sequences: int
    token_agreement: float
    max_logprob_diff: float | None
    tolerance: float | None

    @property
    def passed(self) -> bool:
        """Exact: all greedy sequences equal (and log-probabilities, if any, within tolerance); otherwise the
        teacher-forced log-probabilities within tolerance."""
        within = self.max_logprob_diff is None or self.max_logprob_diff <= self.tolerance
        if self.exact:
            return self.sequences_equal == self.sequences and within
        return self.max_logprob_diff is not None and within

    def describe(self) -> str:
        """One line for the log, the card and the README."""
        line = (
            f"{self.engine}: greedy tokens equal to transformers' on {self.sequences_equal}/{self.sequences} "
            f"probe prompts ({NEW_TOKENS} new tokens; token agreement {self.token_agreement:.0%})"
        )
        if self.max_logprob_diff is not None:
            line += (
                f"; teacher-forced mean |log-prob difference| {self.max_logprob_diff:.3g} nats "
                f"(tolerance {self.tolerance:g})"
            )
        return line + (" - passed" if self.passed else " - FAILED")


def reference(model_dir: Path) -> Reference:
    """Greedy continuations and their log-probabilities from the model in `model_dir`, in float32."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    seq2seq = bool(getattr(AutoConfig.from_pretrained(model_dir), "is_encoder_decoder", False))
    tok = AutoTokenizer.from_pretrained(model_dir)
    auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    prompts, conts, lps = [], [], []
    for text in PROMPTS:
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1,
                output_scores=True, return_dict_in_generate=True, repetition_penalty=None,
            )  # fmt: skip
        cont = out.sequences[0].tolist()[1 if seq2seq else len(ids) :]
        cont = cont[: cont.index(eos)] if eos in cont else cont
        steps = [torch.log_softmax(s[0].float(), -1) for s in out.scores]
        prompts.append(ids)
        conts.append(cont)
        lps.append([steps[i][t].item() for i, t in enumerate(cont)])
    tokens = [tok.convert_ids_to_tokens(p) for p in prompts]
    return Reference(prompts, conts, lps, tokens, eos, seq2seq)


def judge(
    engine: str,
    ref: Reference,
    got: list[list[int]],
    logprobs: list[list[float]] | None,
    quantization: str,
    *,
    adapter: str | None = None,
    kv_cache: str | None = None,
) -> EngineCheck:
    """Compare the engine's greedy continuations (`got`, EOS excluded) and its teacher-forced log-probabilities
    of the reference tokens; raise VerificationError when it fails. What the engine rounds decides the measure:
    the weights' `quantization`, a LoRA `adapter` it applies at run time (its quantization) and its `kv_cache`
    type, where it has one that is not float32."""
    got = [g[: g.index(ref.eos)] if ref.eos in g else g for g in got]
    equal = sum(g == c for g, c in zip(got, ref.continuations, strict=True))
    agree = sum(
        sum(a == b for a, b in zip(g, c, strict=False)) for g, c in zip(got, ref.continuations, strict=True)
    )
    total = sum(max(len(g), len(c), 1) for g, c in zip(got, ref.continuations, strict=True))
    rounded = [q for q in (quantization, adapter, kv_cache) if q is not None]
    exact = all(q in FLOAT32 for q in rounded)
    diff = tol = None
    if logprobs is not None:
        diffs = [
            abs(a - b)
            for e, r in zip(logprobs or [], ref.logprobs, strict=True)
            for a, b in zip(e, r, strict=True)
        ]
        diff = sum(diffs) / max(len(diffs), 1)
        tol = QUANTIZED_LOGPROB_TOLERANCE["8bit" if any("8" in q for q in rounded) else "16bit"]
    check = EngineCheck(engine, exact, equal, len(got), agree / total, diff, tol)
    if not check.passed:
        raise VerificationError(f"engine check failed: {check.describe()}", doc="docs/export.md#checks")
    return check
