"""PreparedData: the tokenized, cached splits the data step hands on (lorakit.data.prepare, for every row
layout), and the bad-rows record it writes into it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets

from lorakit.data.rows import MAX_QUOTED, SourceRows
from lorakit.data.tokenize import Lengths


@dataclass
class PreparedData:
    """Tokenized train (and eval) splits with the caps they were cut to."""

    train: datasets.Dataset
    eval: datasets.Dataset | None
    lengths: Lengths
    path: Path
    cache_hit: bool
    stats: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for the terminal: what was prepared, what the caps did to it, and where it is cached."""
        state = "reused cached" if self.cache_hit else "tokenized and cached"
        n_eval = len(self.eval) if self.eval is not None else 0
        if self.lengths.max_length is not None:
            caps = f"format={self.stats.get('format', '?')}, max_length={self.lengths.max_length}"
        else:
            caps = (
                f"max_source_length={self.lengths.max_source_length}, "
                f"max_target_length={self.lengths.max_target_length}"
            )
        line = f"data: {state} {len(self.train)} train / {n_eval} eval rows at {self.path} ({caps})"
        over = self.stats.get("overlong")
        if over:
            line += (
                f"; over-long examples ({over['policy']}): train {over['truncated']} truncated, "
                f"{over['dropped']} dropped"
            )
            if "eval_truncated" in over:
                line += f"; eval {over['eval_truncated']} truncated, {over['eval_dropped']} dropped"
        targetless = self.stats.get("rows_without_loss", 0)
        if targetless:
            line += (
                f"\nwarning: {targetless} train row(s) have no target tokens (an empty target, or truncation "
                "cut all of it): they add nothing to the loss. Raise the length cap, or set data.overlong: drop"
            )
        bad = self.stats.get("bad_rows") or {}
        skipped = bad.get("skipped", 0) + bad.get("eval_skipped", 0)
        if skipped:
            counts = f"train {bad['skipped']}" + (
                f", eval {bad['eval_skipped']}" if "eval_skipped" in bad else ""
            )
            line += f"\nbad rows left out (data.on_bad_rows skip): {counts}; the first:"
            line += "".join(f"\n  {reason}" for reason in bad["first"])
        return line


def bad_rows_stats(policy: str, loaded: dict[str, SourceRows]) -> dict[str, Any]:
    """What summary.json records about bad rows: the policy, rows left out per split, the first reasons."""
    out: dict[str, Any] = {"policy": policy, "skipped": loaded["train"].skipped}
    if "eval" in loaded:
        out["eval_skipped"] = loaded["eval"].skipped
    out["first"] = [q for src in loaded.values() for q in src.quoted][:MAX_QUOTED]
    return out
