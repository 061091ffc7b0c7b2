"""CTranslate2: the merged model converted by CTranslate2's own converter (TransformersConverter), then
loaded by ctranslate2.Translator (T5) or Generator (causal) and checked against transformers' greedy tokens.

transformers 5 and ctranslate2 4.8.5 (its converter was written for transformers 4): for T5 it reads
`config.tie_word_embeddings` to decide whether to scale the decoder output by d_model**-0.5. transformers 5's
T5Config forces that field to True and keeps the real flag in `scale_decoder_outputs` (False for T5 v1.1 and
FLAN-T5), so the converter would scale every T5: greedy tokens stay equal (the argmax does not move) but
every probability (sampling, beam scores) is wrong. The work-around is at this call site: take the converter's
model spec (TransformersConverter._load, what its own convert() calls), set the decoder's output scale from
`scale_decoder_outputs`, then validate, quantize and save it as convert() does. The engine check compares
log-probabilities too, so it catches the scaled model.
"""

from __future__ import annotations

import json

from lorakit.export.engines import engine
from lorakit.export.formats import ExportJob
from lorakit.export.greedy import NEW_TOKENS, EngineCheck, Reference, judge, reference
from lorakit.export.result import say

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def write(job: ExportJob) -> EngineCheck:
    """Convert `job.merged` into `job.out` with the job's quantization, copy the tokenizer files beside it,
    and check it with CTranslate2 itself."""
    ct2 = engine("ctranslate2", "--format ct2")
    from ctranslate2.converters import TransformersConverter

    q = job.quantization
    say(f"converting: {job.merged} to CTranslate2 ({q}) with ctranslate2 {ct2.__version__}'s converter")
    converter = TransformersConverter(str(job.merged), copy_files=_tokenizer_files(job))
    spec = converter._load()  # see the module docstring: the T5 output scale under transformers 5
    _t5_output_scale(spec, job)
    spec.validate()
    spec.optimize(quantization=None if q == "float32" else q)
    spec.save(str(job.out))
    check = check_ct2(job.out, reference(job.merged), q)
    say(check.describe())
    (job.out / "lorakit_export.json").write_text(
        json.dumps({"format": "ct2", "quantization": q, "check": check.describe()}, indent=1) + "\n"
    )
    return check


def _t5_output_scale(spec, job: ExportJob) -> None:
    """Scale T5's decoder output by d_model**-0.5 only where transformers does (config.scale_decoder_outputs)."""
    config = json.loads((job.merged / "config.json").read_text())
    if config.get("model_type") in ("t5", "mt5") and hasattr(spec, "decoder"):
        if config.get("scale_decoder_outputs", config.get("tie_word_embeddings", True)):
            spec.decoder.scale_outputs = config["d_model"] ** -0.5
        else:
            from ctranslate2.specs import model_spec

            spec.decoder.scale_outputs = model_spec.OPTIONAL  # unset: no scaling


def _tokenizer_files(job: ExportJob) -> list[str]:
    return [f for f in TOKENIZER_FILES if (job.merged / f).is_file()]


def check_ct2(directory, ref: Reference, quantization: str) -> EngineCheck:
    """Load `directory` with CTranslate2, generate greedily from the reference prompts and score the
    reference continuations; judge against `ref`."""
    import ctranslate2

    vocab = _vocabulary(directory)
    inverse = {i: t for t, i in vocab.items()}
    targets = [[inverse[t] for t in c] for c in ref.continuations]
    if ref.seq2seq:
        translator = ctranslate2.Translator(str(directory), device="cpu")
        results = translator.translate_batch(ref.tokens, beam_size=1, max_decoding_length=NEW_TOKENS)
        hyps = [r.hypotheses[0] for r in results]
        # Scores of the target tokens, then of </s>.
        scores = translator.score_batch(ref.tokens, targets)
        logprobs = [list(s.log_probs[: len(t)]) for s, t in zip(scores, targets, strict=True)]
    else:
        generator = ctranslate2.Generator(str(directory), device="cpu")
        results = generator.generate_batch(
            ref.tokens, max_length=NEW_TOKENS, sampling_topk=1, include_prompt_in_result=False
        )
        hyps = [r.sequences[0] for r in results]
        # Scores of every token after the first: the continuation's are the last len(t).
        scores = generator.score_batch([p + t for p, t in zip(ref.tokens, targets, strict=True)])
        logprobs = [list(s.log_probs)[-len(t) :] if t else [] for s, t in zip(scores, targets, strict=True)]
    got = [[vocab[t] for t in h] for h in hyps]
    return judge(f"ctranslate2 {ctranslate2.__version__}", ref, got, logprobs, quantization)


def _vocabulary(directory) -> dict[str, int]:
    """CTranslate2's vocabulary (token string -> id: the model's ids, in the order it saved them)."""
    for name in ("shared_vocabulary.json", "target_vocabulary.json", "vocabulary.json"):
        path = directory / name
        if path.is_file():
            return {t: i for i, t in enumerate(json.loads(path.read_text()))}
    raise FileNotFoundError(f"{directory}: no CTranslate2 vocabulary file")
