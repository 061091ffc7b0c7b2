"""What the model is trained on: prepared rows decoded, with the tokens in the loss marked
(`python -m lorakit.prepare RECIPE --show N`)."""

from __future__ import annotations

import itertools

from lorakit.data.chat import IGNORE_INDEX

# Around every run of tokens in the loss: brackets no template or dataset is likely to hold.
OPEN, CLOSE = "⟦", "⟧"


def marked(tokenizer, ids: list[int], in_loss: list[bool]) -> str:
    """`ids` decoded, each run of tokens in the loss between OPEN and CLOSE (special tokens kept)."""
    out = []
    for trained, run in itertools.groupby(zip(ids, in_loss, strict=True), key=lambda pair: pair[1]):
        text = tokenizer.decode([token for token, _ in run])
        out.append(f"{OPEN}{text}{CLOSE}" if trained else text)
    return "".join(out)


def show_rows(train, tokenizer, n: int, encoder_decoder: bool) -> str:
    """The first `n` training rows as the model sees them, the loss tokens marked."""
    blocks = []
    for k in range(min(n, len(train))):
        row = train[k]
        if "chosen_ids" in row:  # a preference pair: each response after the prompt is scored
            prompt = row.get("prompt_ids") or row.get("input_ids")
            parts = []
            for key in ("chosen_ids", "rejected_ids"):
                response = row[key]
                if encoder_decoder:
                    text = f"source: {tokenizer.decode(prompt)}\ntarget: {marked(tokenizer, response, [True] * len(response))}"
                else:
                    ids = list(prompt) + list(response)
                    text = marked(tokenizer, ids, [False] * len(prompt) + [True] * len(response))
                parts.append(f"{key.removesuffix('_ids')}:\n{text}")
            body, loss = "\n".join(parts), len(row["chosen_ids"]) + len(row["rejected_ids"])
            tokens = row.get("length") or len(prompt) + loss  # the pair's two sequences
        elif encoder_decoder:
            labels = row["labels"]
            body = f"source: {tokenizer.decode(row['input_ids'])}\ntarget: {marked(tokenizer, labels, [True] * len(labels))}"
            tokens, loss = len(row["input_ids"]) + len(labels), len(labels)
        else:
            trained = [label != IGNORE_INDEX for label in row["labels"]]
            body, tokens, loss = marked(tokenizer, row["input_ids"], trained), len(trained), sum(trained)
        blocks.append(
            f"--- row {k} of {len(train)}: {tokens} tokens, {loss} in the loss {OPEN}marked{CLOSE}\n{body}"
        )
    return "\n".join(blocks)
