"""Causal-LM rows: instruction, completion and chat examples as whole sequences with unshifted labels.

Every row has `input_ids` (the full sequence), `labels` (same length: the token where the loss is taken on
it, else -100; the collator shifts), `length`, `prompt_ids` (what generation starts from at eval) and
`reference` (the text generation should produce).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import datasets
import numpy as np

from lorakit.data.caps import policy_rows, record, require_rows
from lorakit.data.chat import IGNORE_INDEX, ChatTurns, TemplateFailed, normalize_messages, read_messages
from lorakit.data.rows import BAD_ROWS_DOC, MAX_QUOTED, SourceRows
from lorakit.data.sources import SOURCE
from lorakit.data.templates import render_prompt, render_target, rows_of
from lorakit.data.tokenize import Lengths, longest, map_processes
from lorakit.errors import DataError
from lorakit.recipe.schema import DataSection, Recipe

# Tokenizer calls pass verbose=False: sequences are tokenized whole on purpose and then capped by the
# data.overlong policy (counted, reported); transformers' "Token indices sequence length is longer than the
# specified maximum" line would only alarm the user about what lorakit handles (see data/tokenize.py).

__all__ = ["IGNORE_INDEX", "ChatTurns", "TemplateFailed", "chat_prompt", "prepare_causal", "tokenize_causal"]

_IDS = datasets.List(datasets.Value("int32"))
FEATURES = datasets.Features(
    {
        "input_ids": _IDS,
        "labels": _IDS,
        "length": datasets.Value("int32"),
        "prompt_ids": _IDS,
        "reference": datasets.Value("string"),
    }
)
# Chat rows also carry why the template refused a row ("" when it did not), until drop_refused.
CHAT_FEATURES = datasets.Features({**FEATURES, "_bad": datasets.Value("string")})


def check_tokenizer(data: DataSection, tokenizer) -> None:
    """The tokenizer can produce this format: a chat template for chat, an EOS token for the others."""
    if data.format == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "data.format chat: the model's tokenizer has no chat template (tokenizer.chat_template is "
                "unset), so messages cannot be rendered; give one in data.chat_template (the Jinja text or a "
                "file), use a tokenizer that ships one, or use data.format instruction or completion"
            )
    elif tokenizer.eos_token_id is None:
        raise DataError(
            f"data.format {data.format}: the model's tokenizer has no EOS token, so the model could not "
            "learn where a response ends; use a tokenizer with an eos_token"
        )


def _adds_eos(tokenizer) -> bool:
    """Whether plain tokenization already ends every sequence with EOS (T5-style, or add_eos_token)."""
    return tokenizer("a")["input_ids"][-1:] == [tokenizer.eos_token_id]


def encode_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of instruction prompts, as training saw them before the response: the tokenizer's special
    tokens (BOS), but no EOS, which belongs after the response."""
    prompts = tokenizer(texts, verbose=False)["input_ids"]
    if _adds_eos(tokenizer):
        eos = tokenizer.eos_token_id
        prompts = [p[:-1] if p[-1:] == [eos] else p for p in prompts]
    return prompts


def chat_prompt(tokenizer, messages: list[dict], where: str) -> tuple[str, list[int]]:
    """(text, token ids) that generation continues for a conversation, as training's eval prompts are made
    (lorakit.data.causal); TemplateFailed (a DataError naming `where`) when the template refuses it."""
    normal, problem = normalize_messages(messages, None, {})
    if problem:
        raise TemplateFailed(f"{where}: {problem}")
    chat = ChatTurns(tokenizer, where)
    text = chat.prompt_text(normal)
    return text, chat.encode(text)


def tokenize_causal(
    ds: datasets.Dataset, data: DataSection, tokenizer, where: Callable[[int], str], num_proc: int = 1
) -> datasets.Dataset:
    """Untruncated causal rows (input_ids, labels, length, prompt_ids, reference) for data.format.

    The rows were checked when loaded (lorakit.data.sources). Chat rows the template refuses stop the run
    under data.on_bad_rows error; under skip they come out empty, with the reason in a `_bad` column for
    drop_refused to remove and count."""
    eos = tokenizer.eos_token_id

    def with_eos(ids: list[int]) -> list[int]:
        return ids if ids[-1:] == [eos] else ids + [eos]

    def instruction(batch, first: int) -> dict[str, list]:
        rows = rows_of(batch)
        targets = [render_target(data, r) for r in rows]
        prompts = encode_prompts(tokenizer, [render_prompt(data, r) for r in rows])
        responses = [
            with_eos(r) for r in tokenizer(targets, add_special_tokens=False, verbose=False)["input_ids"]
        ]
        ids = [p + r for p, r in zip(prompts, responses, strict=True)]
        if data.train_on_inputs:
            labels = [list(x) for x in ids]
        else:
            labels = [[IGNORE_INDEX] * len(p) + r for p, r in zip(prompts, responses, strict=True)]
        return {"input_ids": ids, "labels": labels, "prompt_ids": prompts, "reference": list(targets)}

    def completion(batch, first: int) -> dict[str, list]:
        texts = batch[data.text_column]
        ids = [with_eos(x) for x in tokenizer(texts, verbose=False)["input_ids"]]
        return {
            "input_ids": ids,
            "labels": ids,
            "prompt_ids": [[] for _ in ids],
            "reference": [""] * len(ids),
        }

    def chat(batch, first: int) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": [], "prompt_ids": [], "reference": [], "_bad": []}
        conv = ChatTurns(tokenizer)
        for k, stored in enumerate(batch[data.messages_column]):
            conv.where, messages = where(first + k), read_messages(stored)
            try:
                ids, labels = conv.labels(messages, data.train_on_inputs)
                prompt, reference = conv.prompt(messages)
                bad = ""
            except TemplateFailed as e:
                if data.on_bad_rows == "error":
                    raise DataError(
                        f"data.on_bad_rows is error: {e}. Fix or remove that row, or set data.on_bad_rows: "
                        "skip to leave such rows out (they are counted in summary.json)",
                        doc=BAD_ROWS_DOC,
                    ) from None
                ids, labels, prompt, reference, bad = [], [], [], "", str(e)
            for key, value in zip(out, (ids, labels, prompt, reference, bad), strict=True):
                out[key].append(value)
        return out

    build = {"instruction": instruction, "completion": completion, "chat": chat}[data.format]

    def fn(batch, indices):
        rows = build(batch, indices[0])
        rows["length"] = [len(x) for x in rows["input_ids"]]
        return rows

    features = CHAT_FEATURES if data.format == "chat" else FEATURES
    if SOURCE in ds.column_names:  # a mixture's source names stay with their rows
        features = datasets.Features({**features, SOURCE: datasets.Value("string")})
    return ds.map(
        fn,
        batched=True,
        with_indices=True,
        remove_columns=[c for c in ds.column_names if c != SOURCE],
        features=features,
        num_proc=map_processes(num_proc),
        desc="tokenizing",
        load_from_cache_file=False,
    )


def drop_refused(ds: datasets.Dataset, source: SourceRows) -> tuple[datasets.Dataset, SourceRows]:
    """Remove the chat rows the template refused (data.on_bad_rows skip), counting them with the rows
    left out at loading, and keep the row locations in step."""
    if "_bad" not in ds.column_names:
        return ds, source
    reasons = ds["_bad"]
    ds = ds.remove_columns("_bad")
    refused = [i for i, r in enumerate(reasons) if r]
    if not refused:
        return ds, source
    keep = np.asarray([i for i, r in enumerate(reasons) if not r], dtype=np.int64)
    if keep.size == 0:
        raise DataError(
            f"data.on_bad_rows is skip, but the chat template refused every row of {source.where.origin}, "
            f"e.g. {reasons[refused[0]]}",
            doc=BAD_ROWS_DOC,
        )
    quoted = source.quoted + [reasons[i] for i in refused][: max(MAX_QUOTED - len(source.quoted), 0)]
    located = source.where.take(keep)
    return ds.select(keep), SourceRows(source.rows, located, source.skipped + len(refused), quoted)


def resolve_max_length(recipe: Recipe, lengths: np.ndarray, model_max: int | None) -> tuple[int, str]:
    """(cap, the recipe field it comes from): data.max_length (auto: the longest example, capped at the
    model's maximum), lowered to train.max_tokens when packing with a smaller budget."""
    data = recipe.data
    cap = longest(lengths, model_max) if data.max_length == "auto" else data.max_length
    budget = recipe.train.max_tokens
    if data.packing and budget is not None and budget < cap:
        return budget, "train.max_tokens"
    return cap, "data.max_length"


def apply_overlong(
    ds: datasets.Dataset, policy: str, cap: int, cap_field: str, where: Callable[[int], str]
) -> tuple[datasets.Dataset, int, int]:
    """Apply data.overlong to rows longer than `cap`; returns (rows, truncated count, dropped count)."""
    lengths = np.asarray(ds["length"], dtype=np.int64)
    ds, truncated, dropped = policy_rows(
        ds,
        policy,
        lengths > cap,
        lambda i, n: (
            f"data.overlong is error: {where(i)} is {int(lengths[i])} tokens, longer than "
            f"the cap of {cap} ({cap_field}); {n} row(s) are over it. Raise {cap_field}, or set "
            "data.overlong: truncate or drop"
        ),
    )
    if not truncated:
        return ds, 0, dropped

    def cut(batch):
        ids = [x[:cap] for x in batch["input_ids"]]
        return {
            "input_ids": ids,
            "labels": [x[:cap] for x in batch["labels"]],
            "length": [len(x) for x in ids],
        }

    return ds.map(cut, batched=True, desc="truncating", load_from_cache_file=False), truncated, 0


def prepare_causal(
    raw: dict[str, SourceRows], recipe: Recipe, tokenizer, model_max: int | None
) -> tuple[dict[str, datasets.Dataset], Lengths, dict[str, Any]]:
    """Tokenize, cap and count causal splits ("train" and maybe "eval"): (splits, lengths, stats).

    `raw` is updated in place when the chat template refuses rows (data.on_bad_rows skip)."""
    data = recipe.data
    check_tokenizer(data, tokenizer)
    tokenized = {}
    for k, src in raw.items():
        tokenized[k], raw[k] = drop_refused(
            tokenize_causal(src.rows, data, tokenizer, src.where, data.num_proc), src
        )
    all_lengths = np.concatenate([np.asarray(ds["length"], dtype=np.int64) for ds in tokenized.values()])
    train_len = np.asarray(tokenized["train"]["length"], dtype=np.int64)
    cap, cap_field = resolve_max_length(recipe, all_lengths, model_max)
    overlong: dict[str, Any] = {"policy": data.overlong, "cap": cap, "cap_from": cap_field}
    splits = {}
    for k, ds in tokenized.items():
        splits[k], truncated, dropped = apply_overlong(ds, data.overlong, cap, cap_field, raw[k].where)
        record(overlong, k, truncated, dropped)
        require_rows(
            len(splits[k]),
            f"data.overlong is drop: every row of {raw[k].where.origin} is longer than the cap of "
            f"{cap} ({cap_field}), so none is left; raise {cap_field} or set data.overlong: truncate",
        )
    labels = splits["train"]["labels"]
    stats = {
        "tokens_untruncated": {"mean": float(train_len.mean()), "max": int(train_len.max())},
        "loss_tokens": sum(sum(1 for t in row if t != IGNORE_INDEX) for row in labels),
        "rows_without_loss": sum(1 for row in labels if all(t == IGNORE_INDEX for t in row)),
        "overlong": overlong,
    }
    return splits, Lengths(max_length=cap), stats
