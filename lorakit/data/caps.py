"""The over-long policy (data.overlong) and the length caps, once for every row layout.

A layout says which of its rows are over their caps and how one is cut; what happens to those rows is
decided here: `error` stops on the first with the layout's own message, `drop` leaves them out, `truncate`
keeps them for the layout to cut. Each split's counts go into summary.json's `overlong` record.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from lorakit.data.sources import OVERLONG_DOC
from lorakit.errors import DataError


def cap_ids(ids: list[int], cap: int, keep_end: bool) -> list[int]:
    """`ids` cut to `cap` tokens: the end kept (a prompt: the part next to the response), or the start with
    the last token (EOS) kept."""
    if len(ids) <= cap:
        return ids
    return ids[len(ids) - cap :] if keep_end else [*ids[: cap - 1], ids[-1]]


def auto_cap(value: int | str, lengths: Sequence[int], model_max: int | None) -> int:
    """A length cap: `value`, or with "auto" the longest of `lengths` within the model's maximum."""
    if value != "auto":
        return int(value)
    top = max(lengths, default=1)
    return min(top, model_max) if model_max else top


def apply_policy(
    policy: str, over: np.ndarray, refusal: Callable[[int, int], str]
) -> tuple[np.ndarray, int, int]:
    """(indices of the rows kept, truncated count, dropped count) under data.overlong `policy`, for rows
    whose `over` is true. Under `error` a DataError of `refusal(first over row, rows over)`; the kept rows
    include the over-long ones under `truncate` (the layout cuts them)."""
    over = np.asarray(over, dtype=bool)
    flagged = np.flatnonzero(over)
    if flagged.size and policy == "error":
        raise DataError(refusal(int(flagged[0]), int(flagged.size)), doc=OVERLONG_DOC)
    if policy == "drop":
        return np.flatnonzero(~over), 0, int(flagged.size)
    return np.arange(over.size), int(flagged.size), 0


def policy_rows(ds, policy: str, over: np.ndarray, refusal: Callable[[int, int], str]):
    """(rows, truncated count, dropped count) of the dataset `ds` under data.overlong `policy` (apply_policy):
    `ds` itself when nothing is dropped (the truncated rows still to be cut by the layout)."""
    if not np.any(over):
        return ds, 0, 0
    kept, truncated, dropped = apply_policy(policy, over, refusal)
    return (ds.select(kept) if dropped else ds), truncated, dropped


def require_rows(kept: int, message: str) -> None:
    """The DataError of a split that data.overlong drop left empty."""
    if kept == 0:
        raise DataError(message, doc=OVERLONG_DOC)


def record(overlong: dict, split: str, truncated: int, dropped: int) -> None:
    """Add one split's counts to summary.json's `overlong` record (eval's keys prefixed `eval_`)."""
    prefix = "" if split == "train" else f"{split}_"
    overlong[f"{prefix}truncated"], overlong[f"{prefix}dropped"] = truncated, dropped
