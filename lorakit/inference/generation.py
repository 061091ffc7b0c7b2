"""lorakit.generate: run a trained model on new inputs with the prompts it was trained on.

Rows are sorted by prompt length, so a batch pads its prompts little, generated a batch at a time (greedy
unless num_beams > 1, as training's eval generates) and put back in input order.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorakit.errors import InferenceError
from lorakit.inference.model import OPTIONS_DOC, Trained, find_trained, load_model
from lorakit.inference.prompts import InputRow, Prompter

# max_new_tokens when the run says nothing better (no recipe number, no target cap in summary.json).
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class GenerateResult:
    """What lorakit.generate returns: one record per input row, in input order, and where they went."""

    # The row's columns, "prompt", "output" and, for classifier runs, "label".
    records: list[dict[str, Any]]
    output: Path | None
    max_new_tokens: int
    # The run's label words (classifier runs), else None.
    labels: list[str] | None


def _say(line: str) -> None:
    # stderr: stdout may be the JSONL output itself.
    print(line, file=sys.stderr, flush=True)


def default_max_new_tokens(trained: Trained) -> int:
    """The run's eval.max_new_tokens; for `auto`, its target cap (summary.json data.max_target_length);
    else DEFAULT_MAX_NEW_TOKENS."""
    recipe = trained.recipe
    if recipe is not None and isinstance(recipe.eval.max_new_tokens, int):
        return recipe.eval.max_new_tokens
    cap = ((trained.summary or {}).get("data") or {}).get("max_target_length")
    return int(cap) if cap else DEFAULT_MAX_NEW_TOKENS


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InferenceError(
            f"--{name.replace('_', '-')} {value!r}: must be a whole number >= 1", doc=OPTIONS_DOC
        )
    return value


def generate(
    source: str | Path,
    inputs: str | Path | Iterable[Any],
    *,
    output: str | Path | None = None,
    max_new_tokens: int | None = None,
    num_beams: int = 1,
    batch_size: int = 8,
    device: str | None = None,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    allow_code: Collection[str] = (),
) -> GenerateResult:
    """Generate with the trained model at `source` (a run directory, its adapter directory, or a merged or
    full model directory) for every row of `inputs`, using the run's prompt template.

    inputs: a JSONL / text file, "-" for stdin, or a list of rows (dicts of columns) and texts. output: a
    JSONL file written atomically (default: none; the records are returned). max_new_tokens: default
    default_max_new_tokens. device: default the GPU if any, else the CPU. dtype: default the run's
    model.dtype. Raises DataError / InferenceError (exit code 2 from the CLI) for bad input, before any
    model is loaded, and writes nothing then."""
    trained = find_trained(
        source, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle, allow_code=allow_code
    )
    out = Path(output).expanduser().resolve() if output is not None else None
    if out is not None and isinstance(inputs, str | Path) and str(inputs) != "-":
        if Path(inputs).expanduser().resolve() == out:
            raise InferenceError(f"--output {output}: is the --input file; choose another", doc=OPTIONS_DOC)
    if out is not None and out.is_dir():
        raise InferenceError(f"--output {output}: is a directory; give a file name", doc=OPTIONS_DOC)
    max_new = _positive("max_new_tokens", max_new_tokens or default_max_new_tokens(trained))
    _positive("num_beams", num_beams)
    _positive("batch_size", batch_size)
    labels = trained.labels
    data = trained.recipe.data if trained.recipe is not None else None
    rows = Prompter(data, writes_label=bool(labels)).rows(inputs)
    _say(f"generate: {len(rows)} row(s) with the {trained.describe()}")

    model = load_model(trained, device=device, dtype=dtype)
    _say(f"model:    {model.dtype} on {model.device}, up to {max_new} new tokens, {num_beams} beam(s)")
    prompts, ids = _encode(rows, model, data)
    outputs = _generate_sorted(model, ids, max_new, num_beams, batch_size)
    records = [
        _record(row, prompt, text, labels) for row, prompt, text in zip(rows, prompts, outputs, strict=True)
    ]
    if out is not None:
        from lorakit import rundir

        out.parent.mkdir(parents=True, exist_ok=True)
        rundir.write_text(out, to_jsonl(records))
        _say(f"saved:    {out}")
    return GenerateResult(records, out, max_new, labels)


def to_jsonl(records: list[dict[str, Any]]) -> str:
    """The records as JSON lines (non-ASCII kept as is)."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def _encode(rows: list[InputRow], model, data) -> tuple[list[str], list[list[int]]]:
    """(prompt texts, token ids) as training tokenized its prompts."""
    from lorakit.data.causal import chat_prompt, encode_prompts
    from lorakit.data.chat import use_template

    tok = model.tokenizer
    if data is not None and data.format == "chat":
        tok = use_template(tok, data.chat_template)  # the run's data.chat_template, as training rendered
        rendered = [chat_prompt(tok, r.columns[data.messages_column], r.where) for r in rows]
        return [text for text, _ in rendered], [ids for _, ids in rendered]
    texts = [r.prompt for r in rows]
    if model.is_encoder_decoder:
        return texts, tok(texts)["input_ids"]
    return texts, encode_prompts(tok, texts)


def _generate_sorted(model, ids: list[list[int]], max_new: int, num_beams: int, batch_size: int) -> list[str]:
    """Generations for every prompt, in prompt order, generated longest first in batches of batch_size."""
    from lorakit.data.collate import left_pad_prompts, right_pad_sources
    from lorakit.evaluation.generate import generate_texts

    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    texts: list[str | None] = [None] * len(ids)
    pad = model.tokenizer.pad_token_id
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        prompts = [ids[i] for i in batch]
        causal = not model.is_encoder_decoder
        padded = left_pad_prompts(prompts, pad) if causal else right_pad_sources(prompts, pad)
        outs = generate_texts(
            model.module,
            model.tokenizer,
            padded,
            model.device,
            causal=causal,
            max_new_tokens=max_new,
            num_beams=num_beams,
        )
        for i, text in zip(batch, outs, strict=True):
            texts[i] = text
    return texts


def _record(row: InputRow, prompt: str, text: str, labels: list[str] | None) -> dict[str, Any]:
    from lorakit.evaluation.classify import match_label

    record = {**row.columns, "prompt": prompt, "output": text}
    if labels:
        record["label"] = match_label(text, labels)
    return record
