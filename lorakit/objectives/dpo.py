"""Direct preference optimization with an adapter: the reference model is the policy with its adapter off.

For every pair the objective takes the summed log-probability of the chosen and of the rejected response
under the policy (with grad) and under the reference (the same module inside peft's `disable_adapter()`, in
eval mode and under no_grad: no second copy of the model, no dropout noise), and the loss of the recipe's dpo.loss over the log-ratio
difference h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected):

    sigmoid: -(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h)      (ls: dpo.label_smoothing)
    ipo:     (h - 1 / (2 beta))^2
    simpo:   reference-free, over mean token log-probabilities (lorakit.objectives.simpo)

Rewards are beta x (policy - reference) per response; accuracy counts a pair whose chosen reward is the
larger one (a tie, as at the start when the adapter's B is zero, counts half: 50% before training). Every
rank runs the same forwards in the same order for every micro-batch, as ZeRO-3's collective parameter
gathers require. Encoder-decoders run the encoder once per pair and the decoder twice; packed causal rows
hold a pair's prompt once (lorakit.data.pair_collate).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from lorakit import dist
from lorakit.data.pair_collate import BATCH_KEY, PAIR_SPANS, SIDES
from lorakit.errors import InferenceError
from lorakit.model.loss import sequence_log_probs
from lorakit.objectives.base import Objective, Passes
from lorakit.objectives.dpo_settings import DPO, DPO_METRICS


def preference_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses, chosen rewards, rejected rewards) from summed sequence log-probabilities."""
    chosen, rejected = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    h = chosen - rejected
    if loss == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    return losses, beta * chosen.detach(), beta * rejected.detach()


def metric_sums(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over pairs of the rewards, margin and accuracy (percent; a tie counts half)."""
    wins = (chosen > rejected).float() + 0.5 * (chosen == rejected).float()
    values = (chosen.sum(), rejected.sum(), (chosen - rejected).sum(), 100.0 * wins.sum())
    return dict(zip(DPO_METRICS, values, strict=True))


def sides(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) of values laid out chosen and rejected of each pair in turn."""
    return values[0::2], values[1::2]


def model_kind(recipe, config) -> dict[str, bool]:
    """A pair objective's `encoder_decoder` (the model's) and `cached_reference` (full fine-tuning: the
    reference log-probabilities ride in the batch) for `recipe` on a model of `config`."""
    return {
        "encoder_decoder": bool(getattr(config, "is_encoder_decoder", False)),
        "cached_reference": not recipe.method.adapter(),
    }


def _module(engine):
    return getattr(engine, "module", engine)  # a DeepSpeed engine wraps the (peft) model


@contextlib.contextmanager
def reference_model(engine):
    """`engine`'s model as the reference: its base (peft's disable_adapter()) in eval mode, so the reference
    log-probabilities carry no dropout noise; train mode is restored after."""
    module = _module(engine)
    disable = getattr(module, "disable_adapter", None)
    if disable is None:
        raise InferenceError(
            "train.objective dpo: the reference model is the base with the adapter turned off, so a DPO run "
            "is trained and evaluated with its adapter (a run or adapter directory), not a merged model"
        )
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), disable():
            yield
    finally:
        module.train(was_training)


def shared_prompt_log_probs(engine, inputs, batch: dict[str, Any], device) -> torch.Tensor:
    """(2 x pairs,) summed response log-probabilities of a shared-prompt packed row (lorakit.data.
    pair_collate): each response token scored from the logits at its batch's `target_index`."""
    from lorakit.model.shared_prompt import shared_prompt_kwargs

    logits = engine(**shared_prompt_kwargs(inputs, batch, device), use_cache=False).logits
    picked = logits[0].index_select(0, batch["target_index"].to(device))
    return sequence_log_probs(picked, batch["target_ids"], batch["target_sequence"], 2 * batch["num_pairs"])


def cached_reference(batch: dict[str, Any], device) -> torch.Tensor:
    """The batch's precomputed reference log-probabilities (full fine-tuning), as log_probs lays them out."""
    if BATCH_KEY not in batch:
        raise InferenceError(
            "train.objective dpo with method.kind full scores pairs against the initial model's "
            "log-probabilities, computed before training for its train and eval pairs; these pairs have none "
            "(evaluate a full fine-tuning DPO run on the data it was trained with, or train with an adapter)"
        )
    return batch[BATCH_KEY].to(device)


class DpoObjective(Objective):
    """The DPO loss over a batch of pairs (lorakit.data.pair_collate's batches); divisor: pairs.
    Its rows are in the `pairs` layout (lorakit.data.pairs), a pair never leaves its micro-batch, and its
    evaluation scores the eval pairs (evaluate_preferences), never generations."""

    spec = DPO
    layout = "pairs"

    def __init__(
        self,
        beta: float,
        loss: str = "sigmoid",
        label_smoothing: float = 0.0,
        *,
        encoder_decoder: bool,
        simpo_gamma: float = 0.5,
        cached_reference: bool = False,
    ):
        self.beta, self.kind, self.label_smoothing = beta, loss, label_smoothing
        self.encoder_decoder = encoder_decoder
        self.simpo_gamma = simpo_gamma
        # Full fine-tuning: the reference log-probs ride in the batch (lorakit.objectives.dpo_reference).
        self.cached_reference = cached_reference

    @classmethod
    def from_recipe(cls, recipe, config) -> DpoObjective:
        d = recipe.dpo
        return cls(d.beta, d.loss, d.label_smoothing, simpo_gamma=d.simpo_gamma, **model_kind(recipe, config))

    def prepare_training(self, recipe, engine, inputs, source: str, data, collator):
        """Full fine-tuning: `data` with the initial model's log-probabilities of every pair, before any
        step or checkpoint load (lorakit.objectives.dpo_reference); with an adapter, `data` itself."""
        if not self.cached_reference:
            return data
        from lorakit.objectives.dpo_reference import attach_reference

        return attach_reference(recipe, engine, inputs, self, source, data, collator)

    @classmethod
    def evaluation_data(cls, recipe, source: str, data):
        """Full fine-tuning: `data` with the reference log-probabilities training cached for it."""
        if recipe.method.adapter():
            return data
        from lorakit.objectives.dpo_reference import reference_from_cache

        return reference_from_cache(recipe, source, data)

    def evaluate(self, engine, inputs, recipe, data, tokenizer, collator, *, zero3: bool, generate=None):
        """The DPO loss, rewards, margin and accuracy of the eval pairs, no generation. Pairs are always
        scored padded (pair_collator), whatever collator the caller made for training rows."""
        from lorakit.data.pair_collate import pair_collators
        from lorakit.evaluation.runner import EvalOutcome

        config = _module(engine).config
        batch_size = recipe.eval.micro_batch_size or recipe.train.micro_batch_size
        padded = pair_collators(tokenizer, config)
        pairs = padded.wrap(padded.padded)
        return EvalOutcome(evaluate_preferences(engine, inputs, self, data.eval, pairs, batch_size))

    @classmethod
    def method_options(cls, recipe) -> list[str]:
        """`dpo beta=0.1`: a DPO run reads `lora (dpo beta=0.1)` beside its SFT twin in lorakit.compare."""
        return [recipe.dpo.label()]

    @classmethod
    def plan_notes(cls, recipe) -> list[str]:
        reference = (
            "the initial model's log-probabilities of every pair, computed by a no-grad pass before training "
            "and cached with the data (about 32 bytes of CPU RAM a pair per process: not counted here)"
            if not recipe.method.adapter()
            else "the reference pass: a no-grad forward with the adapter turned off before each policy forward"
        )
        return [f"train.objective dpo: two sequences per pair in every micro-batch; {reference}"]

    @classmethod
    def passes(cls, recipe) -> Passes:
        """Chosen and rejected; the reference with the adapter off before each forward, or (full fine-tuning)
        once before training; SimPO has none."""
        if recipe.dpo.loss == "simpo":
            reference = None
        else:
            reference = "live" if recipe.method.adapter() else "before training"
        return Passes(2, reference)

    @classmethod
    def describe_plan(cls, no_grad_forward: str) -> str | None:
        return f"DPO: two sequences per pair; the no-grad reference forward {no_grad_forward}"

    def units(self, batch: dict[str, Any]) -> int:
        return batch["num_pairs"]

    def log_probs(self, engine, inputs, batch: dict[str, Any], device) -> torch.Tensor:
        """(2 x pairs,) summed response log-probabilities, chosen and rejected of each pair in turn."""
        if self.encoder_decoder:
            return self._seq2seq_log_probs(engine, inputs, batch, device)
        if PAIR_SPANS in batch:
            return shared_prompt_log_probs(engine, inputs, batch, device)
        logits = inputs.logits(engine, batch, device)
        return sequence_log_probs(logits, batch["labels"], batch["sequence_ids"], 2 * batch["num_pairs"])

    def _seq2seq_log_probs(self, engine, inputs, batch: dict[str, Any], device) -> torch.Tensor:
        if "source_segments" in batch:  # packed pairs
            from lorakit.objectives.dpo_seq2seq import packed_seq2seq_log_probs

            return packed_seq2seq_log_probs(engine, inputs, batch, device)
        kwargs = inputs({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, device)
        encoder_outputs = _module(engine).get_encoder()(**kwargs)
        per_side = []
        for side in SIDES:
            labels = batch[f"{side}_labels"]
            logits = engine(
                encoder_outputs=encoder_outputs,
                attention_mask=kwargs["attention_mask"],
                decoder_input_ids=batch[f"{side}_decoder_input_ids"].to(device),
                decoder_attention_mask=batch[f"{side}_decoder_attention_mask"].to(device),
                use_cache=False,
            ).logits
            rows = torch.arange(labels.size(0))[:, None].expand_as(labels)
            per_side.append(sequence_log_probs(logits, labels, rows, labels.size(0)))
        return torch.stack(per_side, dim=1).reshape(-1)

    def pair_terms(self, engine, inputs, batch: dict[str, Any], device):
        """(per-pair losses, chosen rewards, rejected rewards) of one batch."""
        if self.kind == "simpo":
            return self._simpo_terms(engine, inputs, batch, device)
        if self.cached_reference:
            ref = cached_reference(batch, device)
        else:
            # The reference pass first, every rank alike: the same collective gathers in the same order.
            with reference_model(engine):
                ref = self.log_probs(engine, inputs, batch, device)
        policy = self.log_probs(engine, inputs, batch, device)
        return preference_loss(
            *sides(policy),
            *sides(ref),
            beta=self.beta,
            loss=self.kind,
            label_smoothing=self.label_smoothing,
        )

    def _simpo_terms(self, engine, inputs, batch: dict[str, Any], device):
        """SimPO's terms (lorakit.objectives.simpo): reference-free, so the adapter is never turned off."""
        from lorakit.objectives.simpo import response_tokens, simpo_loss

        policy = self.log_probs(engine, inputs, batch, device)
        tokens = response_tokens(batch, self.encoder_decoder).to(policy.device)
        return simpo_loss(
            *sides(policy),
            *sides(tokens),
            beta=self.beta,
            gamma=self.simpo_gamma,
            label_smoothing=self.label_smoothing,
        )

    def loss(self, engine, inputs, batch: dict[str, Any], device) -> tuple[torch.Tensor, dict[str, Any]]:
        losses, chosen, rejected = self.pair_terms(engine, inputs, batch, device)
        return losses.sum(), metric_sums(chosen, rejected)


@torch.no_grad()
def evaluate_preferences(engine, inputs, objective: DpoObjective, eval_ds, collator, batch_size: int) -> dict:
    """The DPO loss, rewards, margin and accuracy over every eval pair (means), the same on every rank;
    every rank runs the same number of batches (lorakit.evaluation.generate.eval_plan)."""
    from lorakit.evaluation.generate import eval_plan

    model = _module(engine)
    was_training = model.training
    model.eval()
    sums = torch.zeros(1 + len(DPO_METRICS), dtype=torch.float64)
    pairs = 0
    for rows, real in eval_plan(len(eval_ds), batch_size, dist.world_size(), dist.rank()):
        batch = collator([eval_ds[i] for i in rows])
        losses, chosen, rejected = objective.pair_terms(engine, inputs, batch, engine.device)
        if real:
            found = metric_sums(chosen[:real], rejected[:real])
            values = [losses[:real].sum(), *(found[k] for k in DPO_METRICS)]
            sums += torch.tensor([float(v) for v in values], dtype=torch.float64)
            pairs += real
    total, *rest = dist.all_reduce([pairs, *sums.tolist()])
    model.train(was_training)
    names = ("loss", *DPO_METRICS)
    return {name: value / max(total, 1.0) for name, value in zip(names, rest, strict=True)}
