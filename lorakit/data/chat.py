"""Conversations: messages as they come (OpenAI `messages`, ShareGPT `conversations`, other layouts through
data.message_keys and data.roles) made into one form, the chat template that renders them (the tokenizer's,
or data.chat_template), and where each assistant turn lies in the whole conversation's rendering.

The loss falls on the assistant turns as the *whole* conversation renders them. A template with
`{% generation %}` blocks says where they are (transformers' assistant mask). Any other template is rendered
once and each assistant message's text is located in that rendering, in order, from the end of the
template's assistant header (its generation prompt) through its end-of-turn text; both are learnt once per
template from a probe conversation. Templates that rewrite earlier turns (Qwen3 drops the reasoning of
earlier assistant turns, Mistral folds the system prompt into a user turn) need no prefix stability this
way. A turn that cannot be found makes its row a bad row (data.on_bad_rows), never a stopped run.
"""

from __future__ import annotations

import bisect
import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lorakit.errors import DataError

# Same value as lorakit.data.collate.IGNORE_INDEX (not imported: that module pulls in torch).
IGNORE_INDEX = -100
# Source roles understood with no configuration (ShareGPT's and the common aliases); data.roles adds more.
DEFAULT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
}
# The layouts read with no configuration: (role key, content key).
_LAYOUTS = (("role", "content"), ("from", "value"))
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_THINK_END = "</think>"
# Template errors a row can cause (jinja2.TemplateError is caught by name: jinja2 is imported lazily).
_RENDER_ERRORS = (TypeError, ValueError, KeyError, IndexError)


class TemplateFailed(DataError):
    """The chat template refused one conversation, or an assistant turn was not found in its rendering: a
    bad row."""


def _drop_nones(value: Any) -> Any:
    """`value` without None-valued mapping keys, at any depth: Arrow gives every message (and every tool
    call) the keys that only some have, filled with None; templates test for a key's presence."""
    if isinstance(value, dict):
        return {k: _drop_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nones(v) for v in value]
    return value


def _text_of(content: Any, j: int) -> tuple[str | None, str | None]:
    """(text, problem) of a message's content: a string, or a list of text parts joined by newlines."""
    if isinstance(content, str):
        return content, None
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif (
                isinstance(part, dict)
                and part.get("type", "text") == "text"
                and isinstance(part.get("text"), str)
            ):
                texts.append(part["text"])
            else:
                return None, f"message {j} has a content part that is not text: {part!r:.60}"
        return "\n".join(texts), None
    return None, f"message {j} needs a text 'content', got {type(content).__name__}: {content!r:.60}"


def normalize_messages(
    value: Any, keys: dict[str, str] | None, roles: dict[str, str]
) -> tuple[list | None, str | None]:
    """(messages, None) in the one form templates read ({role, content, ...}), or (None, why not).

    `keys`: {"role": key, "content": key} of the source's layout (None: `role`/`content`, else ShareGPT's
    `from`/`value`); `roles` maps source roles to chat roles (over DEFAULT_ROLES). A message whose content
    is null keeps no content when it carries tool_calls; a `weight` of 0 (or false) keeps its turn out of
    the loss."""
    if not isinstance(value, list) or not value:
        return (
            None,
            f"must be a non-empty list of {{role, content}} messages, got {type(value).__name__}: {value!r:.60}",
        )
    names = {**DEFAULT_ROLES, **roles}
    out = []
    for j, raw in enumerate(value):
        if not isinstance(raw, dict):
            return None, f"message {j} is {type(raw).__name__}, not a {{role, content}} mapping"
        m = _drop_nones(raw)
        role_key, content_key = (
            (keys["role"], keys["content"])
            if keys
            else next(((r, c) for r, c in _LAYOUTS if r in m), _LAYOUTS[0])
        )
        role = m.pop(role_key, None)
        if not isinstance(role, str) or not role:
            return None, f"message {j} needs a text {role_key!r}, got {type(role).__name__}: {role!r:.60}"
        content = m.pop(content_key, None)
        message = {"role": names.get(role, role), **m}
        if content is None and m.get("tool_calls"):
            out.append(message)
            continue
        text, problem = _text_of(content, j)
        if problem:
            return None, problem
        weight = message.get("weight", 1)
        if isinstance(weight, bool):
            message["weight"] = int(weight)
        elif not isinstance(weight, int | float) or weight not in (0, 1):
            return None, f"message {j} has weight {weight!r}; a message's weight is 0 (no loss) or 1"
        out.append({**message, "content": text})
    return out, None


def read_messages(stored: str | list) -> list[dict]:
    """Messages as SourceRows holds them (JSON text, so rows of any shape share one Arrow column)."""
    return json.loads(stored) if isinstance(stored, str) else stored


def template_text(value: str) -> str:
    """data.chat_template's template: the value itself when it holds Jinja, else the file it names."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise DataError(f"data.chat_template: {value!r} is neither Jinja template text nor a readable file")
    return path.read_text(encoding="utf-8")


def use_template(tokenizer, chat_template: str | None):
    """The tokenizer carrying data.chat_template when one is set (supplying or replacing its own): a shallow
    copy, so the caller's tokenizer keeps its own."""
    if not chat_template:
        return tokenizer
    text = template_text(chat_template)
    if getattr(tokenizer, "chat_template", None) == text:
        return tokenizer
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = text
    return tokenizer


def _render_for(m: dict) -> dict:
    return {k: v for k, v in m.items() if k != "weight"}


class ChatTurns:
    """Renders conversations with one tokenizer's chat template and finds the span of each assistant turn.
    Build it once per tokenizer (it probes the template's shape); `where` names the row being rendered."""

    def __init__(self, tokenizer, where: str = ""):
        self.tok, self.where = tokenizer, where
        self._shape: tuple[str, str] | None = None

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        import jinja2

        try:
            return self.tok.apply_chat_template(
                [_render_for(m) for m in messages], tokenize=False, add_generation_prompt=generation_prompt
            )
        except (jinja2.TemplateError, *_RENDER_ERRORS) as e:
            raise TemplateFailed(f"{self.where}: the chat template failed: {e}") from e

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False, verbose=False)["input_ids"]

    def shape(self) -> tuple[str, str]:
        """(header, turn end): what the template writes before an assistant turn (its generation prompt)
        and after one, both mid-conversation and last; "" where a probe cannot tell."""
        if self._shape is None:
            self._shape = ("", "")
            # Some templates refuse a conversation without a system message: probe with one then.
            for lead in ([], [{"role": "system", "content": "lkprobesystem"}]):
                found = self._probe(lead)
                if found is not None:
                    self._shape = found
                    break
        return self._shape

    def _probe(self, lead: list[dict]) -> tuple[str, str] | None:
        u1, a1, u2 = "lkprobeuserone", "lkprobeanswer", "lkprobeusertwo"
        user, answer = {"role": "user", "content": u1}, {"role": "assistant", "content": a1}
        try:
            asked = self.render([*lead, user], False)
            header = self.render([*lead, user], True)
            last = self.render([*lead, user, answer], False)
            mid = self.render([*lead, user, answer, {"role": "user", "content": u2}], False)
        except TemplateFailed:
            return None
        head = header[len(asked) :] if header.startswith(asked) else ""
        tail_last = last[last.find(a1) + len(a1) :] if a1 in last else ""
        tail_mid = mid[mid.find(a1) + len(a1) : mid.find(u2)] if a1 in mid and u2 in mid else ""
        n = 0
        while n < min(len(tail_last), len(tail_mid)) and tail_last[n] == tail_mid[n]:
            n += 1
        return head, tail_last[:n]

    def spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int, int | None]]]:
        """(the whole rendering, [(start char, end char, message index or None)]) of the assistant turns."""
        template = self.tok.chat_template
        if isinstance(template, str) and _GENERATION.search(template):
            return self._tagged(messages, template)
        full = self.render(messages, generation_prompt=False)
        header, turn_end = self.shape()
        cursor, found = 0, []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                text = (m.get("content") or "").strip()
                at = full.find(text, cursor) if text else -1
                if at >= 0 and m["role"] != "system":  # a system prompt may be folded in further on
                    cursor = at + len(text)
                continue
            span = _locate(full, m, cursor, header, turn_end)
            if span is None:
                raise TemplateFailed(
                    f"{self.where}: assistant message {i} was not found in the chat template's rendering of "
                    "the conversation, so its tokens cannot be marked for the loss"
                )
            found.append((*span, i))
            cursor = span[1]
        return full, found

    def _tagged(self, messages: list[dict], template: str) -> tuple[str, list[tuple[int, int, int | None]]]:
        import jinja2
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, indices = render_jinja_template(
                [[_render_for(m) for m in messages]],
                chat_template=template,
                return_assistant_tokens_mask=True,
                **self.tok.special_tokens_map,
            )
        except (jinja2.TemplateError, *_RENDER_ERRORS) as e:
            raise TemplateFailed(f"{self.where}: the chat template failed: {e}") from e
        blocks = [tuple(b) for b in indices[0]]
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if len(blocks) == len(turns):
            return rendered[0], [(s, e, i) for (s, e), i in zip(blocks, turns, strict=True)]
        if any(messages[i].get("weight", 1) == 0 for i in turns):
            raise TemplateFailed(
                f"{self.where}: the template's {{% generation %}} blocks ({len(blocks)}) do not pair with the "
                f"{len(turns)} assistant messages, so a message's weight 0 cannot be applied"
            )
        return rendered[0], [(s, e, None) for s, e in blocks]

    def labels(self, messages: list[dict], train_on_inputs: bool) -> tuple[list[int], list[int]]:
        """(input_ids, labels) of the conversation, labels set on assistant turns only (or everywhere)."""
        full, spans = self.spans(messages)
        if getattr(self.tok, "is_fast", False):
            enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        else:  # a Python (slow) tokenizer has no character offsets: compare token prefixes instead
            enc = self.tok(full, add_special_tokens=False, verbose=False)
        ids, offsets = list(enc["input_ids"]), enc.get("offset_mapping")
        if train_on_inputs:
            return ids, list(ids)
        labels = [IGNORE_INDEX] * len(ids)
        ends = [end for _, end in offsets] if offsets is not None else None
        begins = [begin for begin, _ in offsets] if offsets is not None else None
        for s, e, i in spans:
            if i is not None and messages[i].get("weight", 1) == 0:
                continue
            if ends is not None:
                # A token straddling a boundary belongs to the assistant turn (trained), at either end.
                start, stop = bisect.bisect_right(ends, s), bisect.bisect_left(begins, e)
            else:
                start, stop = len(self.encode(full[:s])), len(self.encode(full[:e]))
                if ids[:stop] != self.encode(full[:e]):
                    raise TemplateFailed(
                        f"{self.where}: the tokens of the conversation up to an assistant turn's end are not a "
                        "prefix of the whole conversation's tokens (a slow tokenizer merges across it)"
                    )
            labels[start:stop] = ids[start:stop]
        return ids, labels

    def prompt(self, messages: list[dict]) -> tuple[list[int], str]:
        """(prompt_ids, reference): the conversation before its last assistant turn, and that turn."""
        last = messages[-1]
        reference = (last.get("content") or "") if last["role"] == "assistant" else ""
        return self.encode(self.prompt_text(messages)), reference

    def prompt_text(self, messages: list[dict]) -> str:
        """What generation continues: the conversation before its last assistant turn, rendered with the
        template's generation prompt."""
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        return self.render(messages, generation_prompt=True)


def _candidates(m: dict) -> list[str]:
    """Texts that mark an assistant message in a rendering: its content, the answer after its reasoning
    (templates drop earlier turns' `<think>` blocks), else its first tool call's name."""
    content = (m.get("content") or "").strip()
    out = [content] if content else []
    if _THINK_END in content:
        answer = content.rsplit(_THINK_END, 1)[1].strip()
        out += [answer] if answer else []
    for call in m.get("tool_calls") or []:
        name = (call.get("function") or {}).get("name") if isinstance(call, dict) else None
        name = name or (call.get("name") if isinstance(call, dict) else None)
        if isinstance(name, str) and name:
            out.append(name)
            break
    return out


def _locate(full: str, m: dict, cursor: int, header: str, turn_end: str) -> tuple[int, int] | None:
    """(start, end) characters of one assistant turn at or after `cursor`: from the end of the assistant
    header before its text (or the text itself when the template has no header) through its turn end."""
    for text in _candidates(m):
        at = full.find(text, cursor)
        while at >= 0:
            start = at
            if header:
                h = full.rfind(header, cursor, at)
                start = h + len(header) if h >= 0 else -1
            if start >= 0:
                end = at + len(text)
                if turn_end:
                    close = full.find(turn_end, end)
                    # The text itself ends the turn unless more of it follows (a tool call's arguments).
                    if close >= 0 and (close == end or text != (m.get("content") or "").strip()):
                        end = close + len(turn_end)
                return start, end
            at = full.find(text, at + 1)
    if header and not _candidates(m):  # an empty turn: its header through its turn end
        h = full.find(header, cursor)
        if h >= 0:
            start = h + len(header)
            close = full.find(turn_end, start) if turn_end else -1
            return start, close + len(turn_end) if close >= 0 else start
    return None


def encode_each(
    src, rows: list[dict], columns: tuple[str, ...], on_bad_rows: str, encode: Callable[[int, dict], tuple]
):
    """`columns` of each row of `src` (a data.rows.SourceRows; `rows`: its rows as dicts) from
    `encode(i, row)`, one value per column, and `src` less the rows whose chat template failed: each such
    TemplateFailed is raised under data.on_bad_rows error, else the row is left out, counted and quoted
    (SourceRows.keeping)."""
    out: dict[str, list] = {c: [] for c in columns}
    kept, refused = [], []
    for i, row in enumerate(rows):
        try:
            values = encode(i, row)
        except TemplateFailed as e:
            if on_bad_rows == "error":
                raise
            refused.append(str(e))
            continue
        kept.append(i)
        for column, value in zip(columns, values, strict=True):
            out[column].append(value)
    return out, src.keeping(kept, refused)
