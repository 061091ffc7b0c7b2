"""Batching: how a recipe's training rows become micro-batches, for every row layout.

One decision, made here once the data is prepared and the model build has settled whether it packs; the
row layout (lorakit.data.layouts) supplies only its collators and the lengths its rows are budgeted at:

- causal LMs that pack: multipack rows of at most `train.max_tokens` tokens (by default what a padded
  micro-batch holds: a pair counts its two sequences) and the layout's packed collator; preference pairs
  hold each prompt once (dpo.share_prompt) where the model's attention can run the tree;
- encoder-decoders that pack: rows of `micro_batch_size` random examples (BalancedRandomBatchSampler), or
  with `train.max_tokens` / `train.max_target_tokens`, rows filled to those budgets by the two-capacity
  multipack sampler; the layout's packed seq2seq collator;
- encoder-decoders that cannot pack, under `data.packing: auto` with length grouping: padded micro-batches
  sized by token budgets (TokenBudgetBatchSampler), for SFT's examples;
- everything else: length-grouped (or random) padded micro-batches of `micro_batch_size`.

Whatever is chosen, the layout's `wrap` adds what rides beside the tokens (reference log-probabilities,
KTO's labels) to both collators.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from lorakit.data.balanced import BalancedRandomBatchSampler
from lorakit.data.layouts import Collators, layout_named
from lorakit.data.multipack import MultipackBatchSampler
from lorakit.data.multipack_seq2seq import Seq2SeqMultipackBatchSampler, default_max_target_tokens
from lorakit.data.sampler import LengthGroupedBatchSampler
from lorakit.data.token_budget import TokenBudgetBatchSampler, token_budget_for_rows
from lorakit.errors import DataError
from lorakit.model.families.start import decoder_start_token_id
from lorakit.recipe import Recipe
from lorakit.recipe.known_objectives import section_of


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


# The share of a packed encoder row the two-capacity packer fills (0.94-0.97 measured, docs/packing.md).
_SEQ2SEQ_ROW_FILL = 0.95


def make_batching(
    recipe: Recipe,
    data,
    tokenizer,
    config,
    *,
    packing: bool,
    world: int = 1,
    rank: int = 0,
    share_prompt_problem: str | None = None,
    layout: str = "examples",
) -> Batching:
    """Sampler and collators for the rows of `data` (PreparedData, in row layout `layout`) on `rank` of
    `world`: by the model family (`config`), and `packing`, what the model build decided
    (BuiltModel.packing). `share_prompt_problem`: why the model cannot share a prompt among a packed row's
    sequences (None when it can; lorakit.model.shared_prompt.sharing_problem)."""
    c = layout_named(layout).collators(tokenizer, config)
    b = _choose(recipe, data, config, c, packing, world, rank, share_prompt_problem)
    if c.wrap is None:
        return b
    return dataclasses.replace(b, collator=c.wrap(b.collator), eval_collator=c.wrap(b.eval_collator))


def _choose(recipe: Recipe, data, config, c: Collators, packing, world, rank, problem) -> Batching:
    t = recipe.train
    if getattr(config, "is_encoder_decoder", False):
        if packing:
            lengths = c.seq2seq_lengths(data)
            return seq2seq_packing(recipe, data, config, c.padded, world, rank, lengths, c.packed_seq2seq)
        if c.token_budget and recipe.data.packing == "auto" and recipe.data.group_by_length:
            # Packing is not exact for this model or backend: the fallback auto promises. An explicit
            # data.packing: false keeps fixed micro-batches of micro_batch_size.
            return _seq2seq_token_budget(recipe, data, c.padded, world, rank, c.seq2seq_lengths(data))
    elif packing:
        return _causal_packing(recipe, data, c, world, rank, problem)
    sampler = LengthGroupedBatchSampler(
        data.train["length"],
        t.micro_batch_size,
        num_replicas=world,
        rank=rank,
        seed=t.seed,
        group_by_length=recipe.data.group_by_length,
    )
    return Batching(sampler, c.padded, c.padded, False)


def packing_max_tokens(recipe: Recipe, max_length: int) -> int:
    """The token budget of one packed causal row: train.max_tokens, else what a full padded micro-batch
    holds."""
    return recipe.train.max_tokens or recipe.train.micro_batch_size * max_length


def seq2seq_packing_max_tokens(recipe: Recipe, sources: list[int], max_source_length: int) -> int:
    """The encoder row budget of budget-filled rows: train.max_tokens, else (only train.max_target_tokens
    set) one that holds train.micro_batch_size examples on average (micro_batch_size x mean source length /
    the packer's fill), so packing changes neither the examples per optimizer step nor the number of steps
    of an unpacked recipe; never below the longest source, never above what a padded micro-batch holds
    (micro_batch_size x max_source_length)."""
    if recipe.train.max_tokens:
        return recipe.train.max_tokens
    per_row = recipe.train.micro_batch_size * sum(sources) / max(len(sources), 1) / _SEQ2SEQ_ROW_FILL
    padded = recipe.train.micro_batch_size * max_source_length
    return max(max(sources, default=1), min(padded, 8 * math.ceil(per_row / 8)))


def _causal_packing(recipe: Recipe, data, c: Collators, world: int, rank: int, problem) -> Batching:
    """Multipack rows of at most packing_max_tokens tokens (a row of the layout counting its sequences),
    each pair's prompt once where the layout and the model can share it."""
    max_tokens = packing_max_tokens(recipe, c.sequences * data.lengths.max_length)
    lengths, collator, packed_as = data.train["length"], c.packed_causal, c.packed_as
    if c.shared_prompt is not None and _shares_prompt(recipe, problem):
        lengths, collator = c.shared_prompt[0](data.train), c.shared_prompt[1]
        packed_as = "prompt + chosen + rejected, packed together"
    if max(lengths) > max_tokens:
        raise DataError(
            f"train.max_tokens={max_tokens} is smaller than the longest {c.unit} ({max(lengths)} tokens"
            + (f": {packed_as}" if packed_as else "")
            + "); raise train.max_tokens or lower data.max_length"
        )
    sampler = MultipackBatchSampler(
        lengths, max_tokens, num_replicas=world, rank=rank, seed=recipe.train.seed
    )
    return Batching(sampler, collator(max_tokens), c.padded, True, max_tokens, sampler.efficiency())


def _shares_prompt(recipe: Recipe, problem: str | None) -> bool:
    """Whether packed pairs hold their prompt once: dpo.share_prompt (orpo., kto.) on, and no `problem`
    (why the model's attention cannot run the tree: said on the console)."""
    if not section_of(recipe).share_prompt:
        return False
    if problem is not None:
        _say(f"dpo.share_prompt: each pair's prompt is packed twice here: {problem}")
        return False
    return True


def _say(line: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


def _target_budget(recipe: Recipe, src: list[int], tgt: list[int], max_src: int, what: str) -> int:
    """The target budget that goes with `max_src` (train.max_target_tokens, else the data's target/source
    ratio); refuses budgets that an example exceeds."""
    max_tgt = recipe.train.max_target_tokens or default_max_target_tokens(src, tgt, max_src)
    for name, lengths, cap, setting in (
        ("source", src, max_src, "train.max_tokens"),
        ("target", tgt, max_tgt, "train.max_target_tokens"),
    ):
        if max(lengths) > cap:
            raise DataError(
                f"{setting}={cap} is smaller than the longest {name} ({max(lengths)} tokens): {what} must hold "
                f"any one example; raise {setting} or lower data.max_{name}_length"
            )
    return max_tgt


def seq2seq_packing(
    recipe: Recipe,
    data,
    config,
    eval_collator,
    world: int,
    rank: int,
    lengths: tuple[list[int], list[int]],
    make_collator,
) -> Batching:
    """Packed encoder and decoder rows: by default rows of micro_batch_size random examples (the optimizer
    steps of random padded batches, without the padding); with train.max_tokens or max_target_tokens, rows
    filled to those budgets by the two-capacity multipack sampler. `lengths`: (source, target tokens) of the
    training rows; `make_collator`: the layout's packed seq2seq collator."""
    t = recipe.train
    src, tgt = lengths
    if t.max_tokens is None and t.max_target_tokens is None:
        sampler = BalancedRandomBatchSampler(
            src,
            t.micro_batch_size,
            target_lengths=tgt,
            accumulation=t.gradient_accumulation_steps,
            num_replicas=world,
            rank=rank,
            seed=t.seed,
        )
        return Batching(
            sampler,
            make_collator(None, None, decoder_start_token_id(config)),
            eval_collator,
            True,
            efficiency=sampler.efficiency(),
            target_efficiency=sampler.target_efficiency(),
            row_examples=t.micro_batch_size,
        )
    max_src = seq2seq_packing_max_tokens(recipe, src, data.lengths.max_source_length)
    max_tgt = _target_budget(recipe, src, tgt, max_src, "a packed row")
    sampler = Seq2SeqMultipackBatchSampler(
        src, tgt, max_src, max_tgt, num_replicas=world, rank=rank, seed=t.seed
    )
    collator = make_collator(max_src, max_tgt, decoder_start_token_id(config))
    return Batching(
        sampler,
        collator,
        eval_collator,
        True,
        max_src,
        sampler.efficiency(),
        max_tgt,
        sampler.target_efficiency(),
    )


def _seq2seq_token_budget(recipe: Recipe, data, eval_collator, world: int, rank: int, lengths) -> Batching:
    """Encoder-decoders that cannot pack: padded micro-batches of similar lengths, as many rows as the
    budgets allow (rows x longest source <= max_tokens, rows x longest target <= max_target_tokens); by
    default micro_batch_size examples on average, so the optimizer steps are those of fixed batches."""
    t = recipe.train
    src, tgt = lengths
    max_src = t.max_tokens or token_budget_for_rows(
        t.micro_batch_size, src, tgt, max_length=data.lengths.max_source_length
    )
    max_tgt = _target_budget(recipe, src, tgt, max_src, "a micro-batch")
    sampler = TokenBudgetBatchSampler(
        src,
        max_src,
        target_lengths=tgt,
        max_target_tokens=max_tgt,
        num_replicas=world,
        rank=rank,
        seed=t.seed,
    )
    return Batching(
        sampler,
        eval_collator,
        eval_collator,
        False,
        max_src,
        sampler.efficiency(),
        max_tgt,
        sampler.target_efficiency(),
        token_budget=True,
    )
