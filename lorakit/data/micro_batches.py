"""Batching: the record of how a recipe's training rows become micro-batches (sampler, collators, what to
report), which every batching decision returns (lorakit.data.batching; sequence_split wraps
one). Its own module, below them all, so that each may build one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Batching:
    """How training rows become micro-batches: sampler, collators, and what to report about them."""

    sampler: Any
    collator: Any
    eval_collator: Any
    packing: bool
    max_tokens: int | None = None
    # Tokens / capacity of the packed micro-batches (the sampler's own measure; encoder rows for seq2seq).
    efficiency: float | None = None
    # Encoder-decoder packing: the decoder row's capacity and how full it is.
    max_target_tokens: int | None = None
    target_efficiency: float | None = None
    # Padded micro-batches sized by token budgets (rows x longest <= max_tokens / max_target_tokens): the
    # encoder-decoders that cannot pack.
    token_budget: bool = False
    # Encoder-decoder packing without budgets: packed rows of exactly this many random examples.
    row_examples: int | None = None

    def summary(self, plan) -> dict[str, Any]:
        """The batching facts recorded in summary.json (`plan`: the loop's StepPlan)."""
        out: dict[str, Any] = {
            "packing": self.packing,
            "micro_batches_per_epoch_per_rank": plan.micro_batches_per_epoch,
            "steps_per_epoch": plan.steps_per_epoch,
            "examples_dropped_per_epoch": self.sampler.dropped,
        }
        if self.packing or self.token_budget:
            out["max_tokens"] = self.max_tokens
            out["sampler_efficiency_epoch0"] = self.efficiency
        if self.token_budget:
            out["token_budget"] = True
        if self.row_examples is not None:
            out["row_examples"] = self.row_examples
        if self.target_efficiency is not None:
            out["max_target_tokens"] = self.max_target_tokens
            out["source_efficiency"] = self.efficiency
            out["target_efficiency"] = self.target_efficiency
        return out

    def describe(self, plan, world: int) -> str:
        """One line for the terminal at start: micro-batches, steps, packing."""
        line = (
            f"batching: {plan.micro_batches_per_epoch} micro-batches per epoch on each of {world} rank(s) -> "
            f"{plan.steps_per_epoch} steps per epoch, {plan.total_steps} steps in all"
        )
        if self.token_budget:
            line += (
                f"; padded micro-batches of similar lengths, <= {self.max_tokens} source tokens "
                f"({self.efficiency:.1%} real) and <= {self.max_target_tokens} target tokens "
                f"({self.target_efficiency:.1%} real) as rows x longest"
            )
        elif self.row_examples is not None:
            line += (
                f"; packed encoder and decoder rows of {self.row_examples} random examples each, unpadded "
                f"(ranks' rows {self.efficiency:.1%} / {self.target_efficiency:.1%} as long as the longest "
                "of their micro-step)"
            )
        elif self.max_target_tokens is not None:
            line += (
                f"; packed encoder rows of <= {self.max_tokens} tokens ({self.efficiency:.1%} full) and decoder "
                f"rows of <= {self.max_target_tokens} ({self.target_efficiency:.1%} full)"
            )
        elif self.packing:
            line += f"; packed rows of <= {self.max_tokens} tokens, {self.efficiency:.1%} full"
        if self.sampler.dropped:
            line += f"; {self.sampler.dropped} examples per epoch dropped by drop_last"
        return line
