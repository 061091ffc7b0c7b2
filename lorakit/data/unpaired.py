"""Unpaired rows for train.objective kto: (prompt, completion, label) -> token ids, capped and cached.

Each row is laid out as a preference pair is (lorakit.data.preference), so the pair batching, the
shared-prompt packed rows, the packed encoder-decoder rows and full fine-tuning's cached reference all take
it unchanged: its own completion in the `chosen_ids` place and, in the `rejected_ids` place, a MISMATCHED
completion, that of another row with another prompt, from which the objective estimates KTO's reference
point z0 = KL(policy || reference) (lorakit.objectives.kto). Rows also hold `label` (True: desirable).

The mismatched completion of row i is that of the next row (cyclically, in the split's order) whose prompt
differs: fixed at preparation, as TRL's KTO fixes it by shifting completions over blocks of the dataset, so
a packed row's length is known to the sampler and the full fine-tuning reference is scored once per row.

The prompt is what SFT and DPO give the model: data.prompt_template over its columns (data.format
instruction), or with data.format chat (causal LMs) data.messages_column's text or messages, rendered with
the completion (text or assistant messages) by the chat template through the row builder DPO shares
(lorakit.data.preference.chat_pair); a row the template refuses is a bad row (data.on_bad_rows), left out
before the mismatched completions are chosen, and those are keyed on the prompt's token ids.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import datasets
import numpy as np

from lorakit.data import cache
from lorakit.data.causal import encode_prompts
from lorakit.data.chat import ChatTurns, TemplateFailed, read_messages
from lorakit.data.preference import auto_cap, cached_rows, chat_pair, last_text, pair_setup, with_eos
from lorakit.data.prepared import PreparedData, bad_rows_stats
from lorakit.data.rows import MAX_QUOTED, SourceRows
from lorakit.data.sources import OVERLONG_DOC, load_split, source_fingerprint, split_holdout
from lorakit.data.templates import prompt_columns, render_prompt, rows_of
from lorakit.data.tokenize import Lengths
from lorakit.errors import DataError

# Bump when the prepared rows change for the same inputs, so stale caches are not reused.
FORMAT_VERSION = 1
# The completion's and the mismatched completion's columns in the pair layout (lorakit.data.preference).
OWN, MISMATCHED = "chosen_ids", "rejected_ids"


def unpaired_columns(recipe) -> dict[str, str]:
    """{recipe field: column} a KTO row must have: its prompt's columns (chat: data.messages_column), the
    completion and the label."""
    data, kto = recipe.data, recipe.kto
    if data.format == "chat":
        return {"data.messages_column": data.messages_column} | kto.pair_columns()
    if data.format != "instruction":
        raise DataError(
            f"train.objective kto reads data.format instruction (the prompt through data.prompt_template) or "
            f"chat (data.messages_column: the prompt as text or messages); not data.format {data.format}"
        )
    columns: dict[str, str] = {}
    for p, column in prompt_columns(data).items():
        columns.setdefault("data.input_column" if p == "input" else f"data.prompt_template {{{p}}}", column)
    return columns | kto.pair_columns()


def mismatched(prompts: Sequence[Hashable]) -> list[int]:
    """For every row, the row whose completion is its mismatched one: the next (cyclically) whose prompt
    differs; the row itself when every prompt is the same (z0 then estimates nothing but is still finite)."""
    n = len(prompts)
    out = []
    for i in range(n):
        j = next((k % n for k in range(i + 1, i + n) if prompts[k % n] != prompts[i]), i)
        out.append(j)
    return out


def _encode_causal(recipe, tokenizer, rows: list[dict]) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, completion ids ending with EOS) of every row: the row builder of text-form rows."""
    prompts = encode_prompts(tokenizer, [render_prompt(recipe.data, r) for r in rows])
    texts = [r[recipe.kto.completion_column] for r in rows]
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return prompts, [with_eos(x, tokenizer.eos_token_id) for x in ids]


def _encode_chat(recipe, src: SourceRows, tokenizer) -> tuple[dict[str, list], SourceRows]:
    """The rows of `src` in chat form as (prompt ids, completion ids), labels and references, and `src` less
    the rows the chat template refuses (bad rows: skipped and counted, or the error under on_bad_rows error)."""
    data, kto = recipe.data, recipe.kto
    chat = ChatTurns(tokenizer)
    out: dict[str, list] = {"prompt": [], OWN: [], "label": [], "reference": []}
    kept, refused = [], []
    for i, r in enumerate(rows_of(src.rows.to_dict())):
        chat.where = src.where(i)
        completion = read_messages(r[kto.completion_column])
        try:
            prompt, (ids,) = chat_pair(chat, read_messages(r[data.messages_column]), [completion])
        except TemplateFailed as e:
            if data.on_bad_rows == "error":
                raise
            refused.append(str(e))
            continue
        kept.append(i)
        for key, value in (("prompt", prompt), (OWN, ids), ("label", bool(r[kto.label_column]))):
            out[key].append(value)
        out["reference"].append(last_text(completion))
    if refused:
        where = src.where.take(np.asarray(kept, dtype=np.int64))
        quoted = (src.quoted + refused)[:MAX_QUOTED]
        src = SourceRows(src.rows.select(kept), where, src.skipped + len(refused), quoted)
    return out, src


def _encode_seq2seq(recipe, tokenizer, rows: list[dict]) -> tuple[list[list[int]], list[list[int]]]:
    """(source ids, completion ids) of every row (T5's tokenizer appends EOS)."""
    sources = tokenizer([render_prompt(recipe.data, r) for r in rows], verbose=False)["input_ids"]
    texts = [r[recipe.kto.completion_column] for r in rows]
    ids = tokenizer(texts, verbose=False)["input_ids"]
    return sources, [with_eos(x, tokenizer.eos_token_id) for x in ids]


def _cap(ids: list[int], cap: int, keep_end: bool) -> list[int]:
    if len(ids) <= cap:
        return ids
    return ids[len(ids) - cap :] if keep_end else [*ids[: cap - 1], ids[-1]]


def _encode(recipe, src, tokenizer, enc_dec: bool) -> tuple[dict[str, list], SourceRows]:
    """Every kept row of the split as (prompt, completion, mismatched completion) ids, label and reference,
    and the split's rows less those the chat template refused."""
    if recipe.data.format == "chat":
        out, src = _encode_chat(recipe, src, tokenizer)
        # Keyed on the rendered prompt, so a prompt given as text and as one user message is one prompt.
        partner = mismatched([tuple(p) for p in out["prompt"]])
    else:
        rows = rows_of(src.rows.to_dict())
        prompts, completions = (_encode_seq2seq if enc_dec else _encode_causal)(recipe, tokenizer, rows)
        kto = recipe.kto
        out = {
            "prompt": prompts,
            OWN: completions,
            "label": [bool(r[kto.label_column]) for r in rows],
            "reference": [r[kto.completion_column] for r in rows],
        }
        partner = mismatched([render_prompt(recipe.data, r) for r in rows])
    out[MISMATCHED] = [out[OWN][j] for j in partner]
    return out, src


def _caps(recipe, encoded: list[dict], enc_dec: bool, model_max: int | None) -> Lengths:
    """The caps of data.max_length (max_source_length, max_target_length); auto: the longest row's."""
    data = recipe.data
    responses = [max(len(a), len(b)) for e in encoded for a, b in zip(e[OWN], e[MISMATCHED], strict=True)]
    prompts = [len(p) for e in encoded for p in e["prompt"]]
    if enc_dec:
        return Lengths(
            max_source_length=auto_cap(data.max_source_length, prompts, model_max),
            max_target_length=auto_cap(data.max_target_length, responses, model_max),
        )
    return Lengths(
        max_length=auto_cap(
            data.max_length, [p + r for p, r in zip(prompts, responses, strict=True)], model_max
        )
    )


def _capped(recipe, src, encoded: dict, enc_dec: bool, lengths: Lengths, counts: dict) -> dict[str, list]:
    """The split's rows in the pair layout, each sequence within its cap (data.overlong)."""
    first = "input_ids" if enc_dec else "prompt_ids"
    out: dict[str, list] = {first: [], OWN: [], MISMATCHED: [], "label": [], "reference": [], "length": []}
    for i, prompt in enumerate(encoded["prompt"]):
        own, other = encoded[OWN][i], encoded[MISMATCHED][i]
        longest = max(len(own), len(other))
        if enc_dec:
            cap, response_cap = lengths.max_source_length, lengths.max_target_length
            over = len(prompt) > cap or longest > response_cap
        else:
            cap = lengths.max_length
            over = len(prompt) + longest > cap
        if over:
            if recipe.data.overlong == "error":
                raise DataError(
                    f"data.overlong is error: {src.where(i)}: its prompt and completion (or the mismatched "
                    "completion it is scored with) are longer than the cap; raise data.max_length "
                    "(data.max_source_length, max_target_length), or set data.overlong: truncate or drop",
                    doc=OVERLONG_DOC,
                )
            if recipe.data.overlong == "drop":
                counts["dropped"] += 1
                continue
            counts["truncated"] += 1
            if enc_dec:
                prompt = _cap(prompt, cap, keep_end=False)
            else:
                prompt = _cap(prompt, max(cap - longest, cap // 2), keep_end=True)
                response_cap = cap - len(prompt)
            own, other = _cap(own, response_cap, False), _cap(other, response_cap, False)
        for key, value in ((first, prompt), (OWN, own), (MISMATCHED, other)):
            out[key].append(value)
        out["label"].append(encoded["label"][i])
        out["reference"].append(encoded["reference"][i])
        # Packed causal rows hold prompt + completion and prompt + mismatched completion (sharing the
        # prompt: less); encoder-decoders the source once and both completions.
        out["length"].append((1 if enc_dec else 2) * len(prompt) + len(own) + len(other))
    return out


def prepare_unpaired(recipe, tokenizer, model_config) -> PreparedData:
    """Load, tokenize, cap and cache the recipe's KTO rows (train and eval), or reuse the cache."""
    data = recipe.data
    columns = unpaired_columns(recipe)  # refuses formats other than instruction and chat
    enc_dec, tokenizer, split_names, eval_split, held_out, model_max = pair_setup(
        recipe, tokenizer, model_config
    )
    # What the prepared rows depend on: a change to any of them prepares them again.
    depends = {"unpaired": FORMAT_VERSION, "objective": recipe.train.objective, "causal": not enc_dec}
    depends["sources"] = {k: source_fingerprint(data, s) for k, s in split_names.items()}
    depends["data"] = data.model_dump(exclude={"cache_dir", "num_proc", "packing", "group_by_length"})
    depends.update(columns=list(columns.values()), tokenizer=cache.tokenizer_fingerprint(tokenizer))
    depends["model_max"] = model_max
    if data.format == "chat":
        depends["chat_template"] = getattr(tokenizer, "chat_template", None)
    key = cache.fingerprint(depends)
    path = cache.cache_path(data.cache_dir, key)
    found = cached_rows(path)
    if found is not None:
        return found
    flags = frozenset({recipe.kto.label_column})
    if held_out:
        train, held = split_holdout(data, load_split(data, data.split, None, columns, flags))
        raw = {"train": train, "eval": held}
    else:
        limits = {"train": data.max_samples, "eval": data.max_eval_samples}
        raw = {k: load_split(data, s, limits[k], columns, flags) for k, s in split_names.items()}
    encoded = {}
    for k, src in raw.items():
        encoded[k], raw[k] = _encode(recipe, src, tokenizer, enc_dec)
    lengths = _caps(recipe, list(encoded.values()), enc_dec, model_max)
    splits, overlong = {}, {"policy": data.overlong}
    for k, src in raw.items():
        counts = {"truncated": 0, "dropped": 0}
        rows = _capped(recipe, src, encoded[k], enc_dec, lengths, counts)
        if not rows["length"]:
            raise DataError(f"data.overlong is drop: no row of {src.where.origin} is left", doc=OVERLONG_DOC)
        splits[k] = datasets.Dataset.from_dict(rows)
        prefix = "" if k == "train" else f"{k}_"
        overlong.update({f"{prefix}{name}": n for name, n in counts.items()})
    stats: dict[str, Any] = {"format": data.format, "objective": recipe.train.objective, "eval_rows": 0}
    stats.update({f"{k}_rows": len(ds) for k, ds in splits.items()})
    stats.update(desirable_rows=sum(splits["train"]["label"]), overlong=overlong, model_max_length=model_max)
    stats["bad_rows"] = bad_rows_stats(data.on_bad_rows, raw)
    if eval_split:
        stats["eval_source"] = {"split": eval_split, "held_out": held_out, "rows": len(raw["eval"].rows)}
    cache.save_cached(path, splits, {"lengths": vars(lengths), "stats": stats, "key": key})
    return PreparedData(splits["train"], splits.get("eval"), lengths, path, False, stats)
