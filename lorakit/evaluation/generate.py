"""Evaluation on any backend, sharded or not: token-weighted eval loss and generation with every rank taking
part."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from lorakit import dist
from lorakit.data.collate import IGNORE_INDEX, left_pad_prompts
from lorakit.data.sequence_split import EXAMPLE_INDEX, split_eval_rows
from lorakit.model.families.start import decoder_start_token_id
from lorakit.model.loss import token_loss_sum


class EvalModel(Protocol):
    """What evaluation asks of the model it scores: the module, the device its batches go to, and the
    forward. A training Engine (lorakit.backends) answers it, and so does lorakit.inference's LoadedModel."""

    module: torch.nn.Module
    device: torch.device

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward."""
        ...

    def generation_weights(self) -> contextlib.AbstractContextManager[bool]:
        """The weights generation runs on: yields True when whole on this rank (lorakit.backends' Engine)."""
        ...


def eval_plan(num_rows: int, batch_size: int, num_replicas: int, rank: int) -> list[tuple[list[int], int]]:
    """This rank's eval batches as (row indices, number of real rows).

    Rows are dealt round-robin. Every rank gets the same number of batches, because with sharded parameters
    each forward gathers them collectively; a rank with no rows left runs a copy of row 0 whose results
    are thrown away (real = 0).
    """
    mine = list(range(rank, num_rows, num_replicas))
    shard = -(-num_rows // num_replicas)
    per_rank = -(-shard // batch_size)
    plan = []
    for b in range(per_rank):
        rows = mine[b * batch_size : (b + 1) * batch_size]
        plan.append((rows, len(rows)) if rows else ([0], 0))
    return plan


def auto_max_new_tokens(data) -> int:
    """Generation cap when eval.max_new_tokens is auto: the target cap (seq2seq), else the longest eval
    response (causal: tokens after the prompt)."""
    if data.lengths.max_target_length is not None:
        return data.lengths.max_target_length
    return max(
        (
            length - len(prompt)
            for length, prompt in zip(data.eval["length"], data.eval["prompt_ids"], strict=True)
        ),
        default=1,
    )


@torch.no_grad()
def generate_ids(
    module: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    synced_gpus: bool = False,
    **sampling: Any,
) -> torch.Tensor:
    """transformers' generate on `module` in eval mode (every submodule's mode put back after) with the KV
    cache, from a padded batch of prompts on its device: the ids it returns (causal LMs: prompt +
    continuation).
    `sampling`: generate's own arguments (max_new_tokens, do_sample, temperature, top_p, num_beams,
    pad_token_id, eos_token_id, ...); an encoder-decoder starts on its family's decoder start token unless
    `sampling` names one. `synced_gpus`: the parameters are sharded over the ranks, so a rank whose
    sequences are done keeps taking part in the others' forwards."""
    # Each submodule's own mode is put back, not the root's on all: a peft model can be in train mode over
    # a base left in eval mode (from_pretrained's), and train(True) would turn the base's dropout on.
    config = getattr(module, "config", None)
    if getattr(config, "is_encoder_decoder", False) and "decoder_start_token_id" not in sampling:
        # The token the family reads from the checkpoint (T5Gemma: decoder.bos_token_id), not whatever
        # generation_config says (lorakit.model.families.start).
        sampling["decoder_start_token_id"] = decoder_start_token_id(config)
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        return module.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            use_cache=True,
            synced_gpus=synced_gpus,
            **sampling,
        )
    finally:
        for m, training in modes:
            m.training = training


def generate_texts(
    model,
    tokenizer,
    prompt: dict[str, torch.Tensor],
    device,
    *,
    causal: bool,
    max_new_tokens: int,
    num_beams: int,
    synced_gpus: bool = False,
) -> list[str]:
    """Greedy (or beam) generation from a padded batch of prompts (`input_ids`, `attention_mask`), decoded
    without special tokens. Causal LMs take left-padded prompts and only the continuation is decoded.
    Encoder-decoders start their decoder on the token their family reads from the checkpoint (generate_ids)."""
    out = generate_ids(
        model,
        prompt["input_ids"].to(device),
        prompt["attention_mask"].to(device),
        synced_gpus=synced_gpus,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        max_new_tokens=max_new_tokens,
        num_beams=num_beams,
        do_sample=False,
    )
    if causal:
        # A causal LM returns prompt + continuation; the prediction is the continuation.
        out = out[:, prompt["input_ids"].shape[1] :]
    return tokenizer.batch_decode(out, skip_special_tokens=True)


def _loss(out: torch.Tensor, labels: torch.Tensor, where, tiled: bool) -> torch.Tensor:
    """Summed loss of the tokens `where` selects: `out` holds per-token losses (tiled) or logits."""
    return out[where].sum() if tiled else token_loss_sum(out[where], labels[where])


@torch.no_grad()
def evaluate_model(
    engine: EvalModel,
    inputs,
    eval_ds,
    collator,
    tokenizer,
    *,
    batch_size: int,
    generate: bool,
    max_new_tokens: int,
    num_beams: int,
    zero3: bool,
    groups: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Eval loss over all ranks and, if `generate`, predictions in row order (on every rank).

    `zero3`: the parameters are sharded (Engine.sharded), so every forward is collective. `inputs` is the
    model's ModelInputs; encoder-decoders generate from the source, causal LMs from each
    row's `prompt_ids` (left-padded), and only the continuation is decoded. With `groups` (a name per eval
    row: a mixture's sources), also "group_loss": {name: (summed token loss, target tokens)} over all ranks.
    """
    model = engine.module
    was_training = model.training
    model.eval()
    device = engine.device
    loss_sum = tokens = 0.0
    names = sorted(set(groups)) if groups is not None else []
    group_sums = [0.0] * (2 * len(names))  # loss sum, tokens per name: one all_reduce for all of them
    predictions: list[tuple[int, str]] = []
    # Sequence parallelism: the N ranks of a group take the same rows, packed into one row and split as in
    # training (each rank's loss is its shard's); the sums over all ranks count every row once.
    sp = getattr(inputs, "sp_world", 1) if getattr(inputs, "sp_group", None) is not None else 1
    sp_rank = dist.rank() % sp
    for rows, real in eval_plan(len(eval_ds), batch_size, dist.world_size() // sp, dist.rank() // sp):
        examples = [eval_ds[i] for i in rows]
        if sp > 1:
            batch = split_eval_rows(examples, sp_rank, sp, tokenizer.pad_token_id or 0)
        else:
            batch = collator(examples)
        labels = batch["labels"].to(device)
        # model.tiled_loss: per-token losses from the tiled head, no logits of the whole row.
        tiled = getattr(inputs, "loss_head", None) is not None
        out = inputs.token_losses(engine, batch, device) if tiled else inputs.logits(engine, batch, device)
        if real:
            loss_sum += float(_loss(out, labels, slice(None), tiled))
            tokens += batch["num_target_tokens"]
            for i, row in enumerate(rows[:real] if groups is not None else ()):
                # Padded eval batches: row i's loss is its own logits against its own labels; a shard of
                # packed rows: the tokens of row i it holds.
                where = (0, batch[EXAMPLE_INDEX][0].to(device) == i) if sp > 1 else i
                k = 2 * names.index(groups[row])
                group_sums[k] += float(_loss(out, labels, where, tiled))
                group_sums[k + 1] += float((labels[where] != IGNORE_INDEX).sum())
        if generate:
            causal = "prompt_ids" in examples[0]
            if causal:
                prompt = left_pad_prompts([e["prompt_ids"] for e in examples], tokenizer.pad_token_id)
            else:
                prompt = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
            with engine.generation_weights() as whole:
                texts = generate_texts(
                    model,
                    tokenizer,
                    prompt,
                    device,
                    causal=causal,
                    max_new_tokens=max_new_tokens,
                    num_beams=num_beams,
                    # Weights gathered layer by layer: a rank that finishes early keeps gathering for the others.
                    synced_gpus=zero3 and not whole and dist.world_size() > 1,
                )
            if sp_rank == 0:  # the other ranks of a sequence-parallel group generated the same rows
                predictions.extend(zip(rows[:real], texts[:real], strict=True))
    loss_sum, tokens, *group_sums = dist.all_reduce([loss_sum, tokens, *group_sums])
    result: dict[str, Any] = {"loss": loss_sum / max(tokens, 1.0), "tokens": int(tokens)}
    if groups is not None:
        result["group_loss"] = {n: (group_sums[2 * k], group_sums[2 * k + 1]) for k, n in enumerate(names)}
    if generate:
        merged = sorted(p for part in dist.all_gather_objects(predictions) for p in part)
        result["predictions"] = [text for _, text in merged]
    model.train(was_training)
    return result
