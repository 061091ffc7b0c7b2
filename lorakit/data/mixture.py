"""Dataset mixtures: several sources, each with its own columns and templates, drawn into one training set by
weight, every example keeping its source's name.

How many examples each source gives (`allocate`): a source with `max_samples` gives exactly that many (at
most what it has), one with neither weight nor max_samples gives all its rows, and the weighted sources
share the rest by weight: data.max_samples minus the fixed counts when data.max_samples is set, else as many
as the sources hold without repeating a row (the largest total at which no weighted source runs out). Counts
are rounded by largest remainder, so they sum to the total and follow the weights to within one example.
Which rows: a random draw without replacement, seeded by data.split_seed and the source's position, kept in
file order. Evaluation rows are each source's own (its eval split, or held out of its training split), at
most data.max_eval_samples per source.

Each source's rows are rendered with its own templates into canonical columns (`lorakit.data.templates`),
so the tokenizers see one dataset: for instruction data the rendered prompt and target, for completion the
text, for chat the messages. One difference from a single source: an over-long prompt is cut at its end,
since the template is already applied (a single source cuts its columns and keeps the template's text).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import datasets
import numpy as np

from lorakit.data.rows import ALPACA_PROMPT, ALPACA_TARGET, SourceRows
from lorakit.data.sources import SOURCE, eval_source, load_split, split_holdout, subset
from lorakit.data.templates import render_prompt, render_target
from lorakit.errors import DataError
from lorakit.recipe.schema import DataSection, SourceSpec, data_parts

# The canonical columns a mixture's rows are rendered into (read by the tokenizers through mixed_view).
PROMPT, TARGET, TEXT, MESSAGES = "__prompt", "__target", "__text", "__messages"


def mixed_view(data: DataSection) -> DataSection:
    """The data section the tokenizers use for a mixture: one source of canonical, already rendered columns."""
    return data.model_copy(
        update={
            "source": "(mixture)",
            "format": "instruction" if data.format == "alpaca" else data.format,
            "input_column": PROMPT,
            "prompt_template": "{input}",
            "target_column": TARGET,
            "target_template": None,
            "text_column": TEXT,
            "messages_column": MESSAGES,
        }
    )


def allocate(specs: list[SourceSpec], available: list[int], total: int | None) -> list[int]:
    """Training examples to draw from each source (module docstring)."""
    counts = [0] * len(specs)
    weighted = []
    for i, (spec, n) in enumerate(zip(specs, available, strict=True)):
        if spec.weight is None:
            counts[i] = n if spec.max_samples is None else min(spec.max_samples, n)
        else:
            weighted.append(i)
    if not weighted:
        return counts
    shares = np.array([specs[i].weight for i in weighted], dtype=np.float64)
    shares /= shares.sum()
    if total is None:
        budget = min(math.floor(available[i] / s + 1e-9) for i, s in zip(weighted, shares, strict=True))
    else:
        budget = max(total - sum(counts), 0)
    exact = shares * budget
    floors = np.floor(exact).astype(int)
    for j in np.argsort(-(exact - floors), kind="stable")[: budget - int(floors.sum())]:
        floors[j] += 1
    for i, want in zip(weighted, floors, strict=True):
        if want > available[i]:
            raise DataError(
                f"data.source {specs[i].display_name()!r}: its weight asks for {want} training examples but it "
                f"has {available[i]} usable rows; lower data.max_samples or its weight"
            )
        counts[i] = int(want)
    return counts


def _canonical(data: DataSection, rows: datasets.Dataset, name: str) -> datasets.Dataset:
    """One source's rows as the mixture's canonical columns, plus its name."""

    def render(batch):
        n = len(next(iter(batch.values())))
        cols = list(batch)
        out: dict[str, list] = {SOURCE: [name] * n}
        if data.format == "instruction":
            items = [{c: batch[c][i] for c in cols} for i in range(n)]
            out[PROMPT] = [render_prompt(data, r) for r in items]
            out[TARGET] = [render_target(data, r) for r in items]
        elif data.format == "alpaca":
            out[PROMPT], out[TARGET] = batch[ALPACA_PROMPT], batch[ALPACA_TARGET]
        elif data.format == "completion":
            out[TEXT] = batch[data.text_column]
        else:
            out[MESSAGES] = batch[data.messages_column]
        return out

    return rows.map(render, batched=True, remove_columns=rows.column_names, load_from_cache_file=False)


@dataclass(frozen=True)
class MixedLocator:
    """Names row i of a mixture by its source's file and line (RowLocator's interface)."""

    origin: str
    parts: tuple  # ((first row, RowLocator), ...)

    def __call__(self, i: int) -> str:
        start, where = max((p for p in self.parts if p[0] <= i), key=lambda p: p[0])
        return where(i - start)


def _concat(parts: list[tuple[str, DataSection, SourceRows]]) -> SourceRows:
    tables, locators, start = [], [], 0
    for name, data, rows in parts:
        tables.append(_canonical(data, rows.rows, name))
        locators.append((start, rows.where))
        start += len(rows.rows)
    origin = "mixture of " + ", ".join(name for name, _, _ in parts)
    skipped = sum(rows.skipped for _, _, rows in parts)
    quoted = [q for _, _, rows in parts for q in rows.quoted]
    labels = sorted({label for _, _, rows in parts for label in (rows.labels or [])}) or None
    return SourceRows(
        datasets.concatenate_datasets(tables), MixedLocator(origin, tuple(locators)), skipped, quoted, labels
    )


def load_mixture(data: DataSection, with_eval: bool) -> tuple[dict[str, SourceRows], dict]:
    """{"train", "eval"?: rows in canonical columns} of a mixture, and what summary.json records of it."""
    parts = data_parts(data)
    train_parts, eval_parts, info, loaded = [], [], {}, []
    for name, part, _ in parts:
        split, held_out = eval_source(part) if with_eval and part.eval_split is not None else (None, False)
        rows = load_split(part, part.split)
        held = None
        if held_out:
            rows, held = split_holdout(part.model_copy(update={"max_samples": None}), rows)
        elif split is not None:
            held = load_split(part, split, data.max_eval_samples)
        loaded.append((name, part, rows, held, split, held_out))
    specs = [spec for _, _, spec in parts]
    counts = allocate(specs, [len(rows.rows) for _, _, rows, *_ in loaded], data.max_samples)
    for k, ((name, part, rows, held, split, held_out), want) in enumerate(zip(loaded, counts, strict=True)):
        rng = np.random.default_rng([data.split_seed, k])
        chosen = np.sort(rng.choice(len(rows.rows), size=want, replace=False))
        train_parts.append((name, part, subset(rows, chosen)))
        if held is not None:
            eval_parts.append((name, part, held))
        info[name] = {
            "source": specs[k].source,
            "weight": specs[k].weight,
            "available": len(rows.rows),
            "eval_split": split,
            "eval_held_out": held_out,
        }
    out = {"train": _concat(train_parts)}
    if eval_parts:
        out["eval"] = _concat(eval_parts)
    return out, info


def source_counts(ds: datasets.Dataset | None) -> dict[str, dict[str, int]]:
    """{source name: {examples, tokens}} of a tokenized mixture split."""
    if ds is None or SOURCE not in ds.column_names:
        return {}
    out: dict[str, dict[str, int]] = {}
    for name, length in zip(ds[SOURCE], ds["length"], strict=True):
        entry = out.setdefault(name, {"examples": 0, "tokens": 0})
        entry["examples"] += 1
        entry["tokens"] += int(length)
    return out
