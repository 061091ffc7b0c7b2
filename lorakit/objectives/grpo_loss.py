"""GRPO's loss as pure functions of tensors (the objective, lorakit.objectives.grpo, feeds them).

For G completions o_1..o_G of one prompt with rewards r_i, the advantage of every token of o_i is
A_i = (r_i - mean(r)) / (std(r) + eps) (grpo.scale_rewards; without it r_i - mean(r)); a group whose rewards
are all equal has no signal (all A_i = 0) and is counted. With the ratio rho = exp(logp - logp_old) of a
token under the policy and under the policy that sampled it (rho = 1 on the first pass over a batch of
rollouts, not after), the per-token loss is

    -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon) A) + beta (exp(ref - logp) - (ref - logp) - 1)

(the second term: the k3 estimator of KL(policy || reference), the reference being the base with the adapter
switched off), aggregated (grpo.loss) as
- grpo: the mean over each completion's tokens, then over the completions (Shao et al. 2024);
- dapo: the sum over every completion token of the batch / their count (Yu et al. 2025: long completions
  weigh as many tokens, not as one sequence);
- dr_grpo: the sum over every token / (completions x max_new_tokens), a constant (Liu et al. 2025: no
  length bias).
Denominators may be given for a whole optimiser step when its rollouts are split over micro-batches.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from lorakit.objectives.grpo_settings import AGGREGATIONS

# Added to the group's std (as TRL and the paper's code do): a near-constant group does not explode.
STD_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, group: int, scale: bool) -> tuple[torch.Tensor, int]:
    """(advantages, zero-variance groups) of `rewards` (prompts x group,) laid out group after group."""
    r = rewards.view(-1, group).to(torch.float32)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True) if group > 1 else torch.zeros_like(mean)
    centred = r - mean
    adv = centred / (std + STD_EPS) if scale else centred
    flat = (r.max(dim=1).values - r.min(dim=1).values) == 0
    return adv.reshape(-1), int(flat.sum())


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N, T) log-probability of each target token under `logits` (N, T, V), computed in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True)
class LossParts:
    """The loss and what a step reports of it: the mean k3 KL and the share of clipped tokens."""

    loss: torch.Tensor
    kl: float
    clip_fraction: float


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregation: str,
    epsilon: float,
    beta: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    max_new_tokens: int | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> LossParts:
    """GRPO's clipped loss of completion tokens (N, T) under `mask` (1: a completion token), see the module
    docstring. num_tokens (dapo), num_sequences (grpo, dr_grpo): the step's totals when the batch is one of
    several micro-batches of it (default: this batch's)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"grpo.loss {aggregation!r}: one of {', '.join(AGGREGATIONS)}")
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    ratio = torch.exp(logp - old_logp.detach())
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl_mean = 0.0
    if beta:
        if ref_logp is None:
            raise ValueError("grpo.beta > 0 needs the reference log-probabilities")
        delta = ref_logp.detach() - logp
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
        kl_mean = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
    cut = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + epsilon) & (adv > 0))
    clip_fraction = float((cut.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1))
    masked = per_token * mask
    n = num_sequences if num_sequences is not None else logp.shape[0]
    if aggregation == "grpo":
        loss = (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / n
    elif aggregation == "dapo":
        loss = masked.sum() / (num_tokens if num_tokens is not None else mask.sum().clamp(min=1))
    else:
        if max_new_tokens is None:
            raise ValueError("grpo.loss dr_grpo divides by completions x max_new_tokens: give max_new_tokens")
        loss = masked.sum() / (n * max_new_tokens)
    return LossParts(loss, kl_mean, clip_fraction)


def _module(model):
    return getattr(model, "module", model)  # a DeepSpeed engine wraps the (peft) model


@contextlib.contextmanager
def adapter_off(model):
    """`model` as GRPO's reference: its base (peft's disable_adapter()), without gradients."""
    disable = getattr(_module(model), "disable_adapter", None)
    if disable is None:
        raise ValueError(
            "grpo.beta > 0: the reference is the base with the adapter switched off; train an adapter"
        )
    with torch.no_grad(), disable():
        yield


def completion_log_probs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int
) -> torch.Tensor:
    """(N, T - start) log-probabilities of a causal LM's tokens from column `start` on (the completions
    after left-padded prompts of width `start`), each from the logits of the position before it."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return token_log_probs(logits[:, start - 1 : -1], input_ids[:, start:])


def seq2seq_log_probs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, decoder_input_ids: torch.Tensor, targets
) -> torch.Tensor:
    """(N, T) log-probabilities of an encoder-decoder's `targets` under teacher forcing: the prompt is the
    encoder's input, `decoder_input_ids` the decoder start token followed by the targets shifted right."""
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        decoder_input_ids=decoder_input_ids,
        use_cache=False,
    ).logits
    return token_log_probs(logits, targets)


# A packed causal rollout batch's keys (pack_rollouts): the row, and where each completion token's logits are.
PACKED = ("packed_input_ids", "packed_position_ids", "packed_at", "packed_sequence", "packed_column")


def pack_rollouts(batch: dict) -> dict[str, torch.Tensor]:
    """A causal rollout batch (left-padded prompts of width `prompt_width`, then completions masked after
    their EOS) as ONE packed row, as SFT packs examples: each sequence's real prompt tokens then its
    completion tokens, position_ids restarting at 0, no padding; `packed_at` the row position whose logits
    predict each completion token, `packed_sequence` / `packed_column` where it sits in `completion_mask`."""
    width = int(batch["prompt_width"])
    ids, positions, at, sequence, column = [], [], [], [], []
    for i, (row, mask, done) in enumerate(zip(batch["input_ids"], batch["attention_mask"], batch["completion_mask"],
                                              strict=True)):  # fmt: skip
        prompt = row[:width][mask[:width].bool()].tolist()
        n = int(done.sum())
        start = len(ids) + len(prompt)
        ids += prompt + row[width : width + n].tolist()
        positions += range(len(prompt) + n)
        at += range(start - 1, start + n - 1)
        sequence += [i] * n
        column += range(n)
    return {
        "packed_input_ids": torch.tensor([ids]),
        "packed_position_ids": torch.tensor([positions]),
        **{
            k: torch.tensor(v, dtype=torch.long)
            for k, v in zip(PACKED[2:], (at, sequence, column), strict=True)
        },
    }


def packed_log_probs(model, inputs, batch: dict, device) -> torch.Tensor:
    """rollout_log_probs of a packed batch (pack_rollouts): one forward of the row with per-example attention
    (lorakit.model.inputs.ModelInputs, as SFT's packed rows), scattered back to the (N, T) completion layout
    (0 off `completion_mask`)."""
    row = {"input_ids": batch["packed_input_ids"], "position_ids": batch["packed_position_ids"]}
    logits = inputs.logits(model, row, device)[0]
    at = batch["packed_at"].to(logits.device)
    logp = token_log_probs(logits[at][None], row["input_ids"][0].to(logits.device)[at + 1][None])[0]
    out = torch.zeros(batch["completion_mask"].shape, dtype=logp.dtype, device=logp.device)
    where = (batch["packed_sequence"].to(out.device), batch["packed_column"].to(out.device))
    return out.index_put(where, logp)


def rollout_log_probs(model, batch: dict, device: torch.device | None = None, inputs=None) -> torch.Tensor:
    """(N, T) log-probabilities of a rollout batch's completion tokens (lorakit.objectives.grpo_rollouts),
    aligned with its `completion_mask`: a causal LM's from the tokens after `prompt_width` (a packed batch's
    from its row, through `inputs`: packed_log_probs), an encoder-decoder's (the batch has
    `decoder_input_ids`) from its decoder over `completions`."""
    if PACKED[0] in batch:
        if inputs is None:
            raise ValueError(
                "a packed rollout batch needs the model's inputs (ModelInputs) for its attention"
            )
        return packed_log_probs(model, inputs, batch, device if device is not None else "cpu")

    def on(name: str) -> torch.Tensor:
        return batch[name].to(device) if device is not None else batch[name]

    if "decoder_input_ids" in batch:
        return seq2seq_log_probs(
            model, on("input_ids"), on("attention_mask"), on("decoder_input_ids"), on("completions")
        )
    return completion_log_probs(model, on("input_ids"), on("attention_mask"), int(batch["prompt_width"]))
