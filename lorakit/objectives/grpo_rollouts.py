"""GRPO's step source (a lorakit.engine.steps.StepSource): rollouts made from the weights being trained.

Each window of `accumulation` prompt micro-batches (the `prompts` layout, left-padded) becomes rollouts when
the loop asks for it: every prompt repeated grpo.num_generations times, completions sampled by
Engine.generate from the current weights with this source's own generator (so sampling does not depend on,
or disturb, anything else's random state), scored by the rewards, normalised within each group into
advantages, and scored by the sampling policy (the old log-probabilities, only when grpo.passes > 1: with
one pass the old policy is the current one; with grpo.beta > 0 the reference's, the adapter switched off).
The same rollouts are trained grpo.passes times, one optimiser step each.

Position: {DONE: prompt micro-batches whose rollouts are fully trained, PASS: passes of the next window's
rollouts already trained}. rank_state holds the generator and, mid-window, the rollouts not trained on their
last pass yet, so a resumed run trains exactly what the interrupted one would have.

Causal LMs: prompts left-padded, a batch is prompt + completion in one row (`prompt_width` says where the
completion starts); with `packed_inputs` (data.packing auto) the batch also holds its packed row
(grpo_loss.pack_rollouts: real tokens only, per-example attention), which every forward of it uses. Encoder-decoders (FLAN-T5, T5Gemma): the prompt is the encoder's input (right-padded),
generate returns the decoder's rows from its start token, and a batch keeps `completions` (the sampled
tokens) and `decoder_input_ids` (the start token, then the completions shifted right) for teacher forcing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from lorakit.engine.steps import DONE, StepPlan, Window, accumulation_windows
from lorakit.objectives.grpo_loss import (
    PACKED,
    adapter_off,
    group_advantages,
    pack_rollouts,
    rollout_log_probs,
)
from lorakit.objectives.rewards import score

PASS = "passes_done"
# rank_state's prefix of a pending rollout's per-function rewards.
PART = "reward_parts."
# Rollout tensors a checkpoint keeps of a window trained on some but not all of its passes.
KEPT = (
    "input_ids",
    "attention_mask",
    "completion_mask",
    "old_logp",
    "ref_logp",
    "advantages",
    "rewards",
    "prompt_width",
    "decoder_input_ids",
    "completions",
    *PACKED,
)


def completion_mask(completions: torch.Tensor, eos: int) -> torch.Tensor:
    """1 on each completion's tokens up to and including its first EOS, 0 after (generate's padding)."""
    is_eos = completions == eos
    before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # EOS seen strictly before each token
    return (before == 0).long()


class RolloutSteps:
    """GRPO's windows, made from the current weights (see the module docstring)."""

    def __init__(
        self,
        loader,
        engine,
        settings,
        rewards,
        tokenizer,
        *,
        accumulation: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        generation=None,
        packed_inputs=None,
    ):
        self.loader, self.engine, self.settings = loader, engine, settings
        # data.packing (causal LMs): the model's ModelInputs, through which each rollout batch's packed row
        # is forwarded with per-example attention; None: padded rollout batches.
        self.packed_inputs = packed_inputs
        # What samples the completions: the Engine (its generate), or one with begin()/end() around each
        # window and the same generate (lorakit.objectives.grpo_vllm.VllmRollouts).
        self.generation = engine if generation is None else generation
        self.rewards, self.tokenizer, self.accumulation = rewards, tokenizer, accumulation
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
        self.seed, self.rank, self.world = seed, rank, world
        self.generation_seconds = 0.0  # the last micro-batch's generate
        self.pending: list[dict[str, Any]] | None = None  # rollouts of a window mid-passes
        config = getattr(getattr(engine, "module", None), "config", None)
        self.encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))

    @property
    def micro_batches_per_epoch(self) -> int:
        """Prompt micro-batches of one epoch, repeated once per pass."""
        return len(self.loader.batch_sampler) * self.settings.passes

    def plan(self, epochs: int, max_steps: int | None) -> StepPlan:
        """Every window of prompts is passes steps."""
        windows = math.ceil(len(self.loader.batch_sampler) / self.accumulation)
        per_epoch = windows * self.settings.passes
        total = max_steps if max_steps is not None else epochs * per_epoch
        return StepPlan(self.micro_batches_per_epoch, per_epoch, total, math.ceil(total / per_epoch))

    def windows(self, epoch: int, position: dict[str, Any]) -> Iterator[Window]:
        """The epoch's windows from `position`: each window's rollouts, trained grpo.passes times."""
        sampler = self.loader.batch_sampler
        sampler.set_epoch(epoch)
        done, first = int(position.get(DONE, 0)), int(position.get(PASS, 0))
        if done:
            sampler.skip_next(done)
        total, passes = len(sampler), self.settings.passes
        for prompts in accumulation_windows(self.loader, self.accumulation):
            if first and self.pending is not None:
                rollouts = self.pending
            else:
                first, rollouts = 0, self._rollouts(prompts, epoch, done)
            for k in range(first, passes):
                self.pending = rollouts if k + 1 < passes else None
                end = k + 1 == passes
                at = {DONE: done + len(prompts), PASS: 0} if end else {DONE: done, PASS: k + 1}
                yield Window(rollouts, at, last=end and done + len(prompts) >= total)
            first, done = 0, done + len(prompts)

    def rank_state(self) -> dict[str, torch.Tensor]:
        """The sampling generator, and the rollouts of a window some of whose passes remain."""
        state = {"generator": self.generator.get_state()}
        for i, batch in enumerate(self.pending or []):
            state |= {f"pending.{i}.{k}": batch[k] for k in KEPT if k in batch}
            state |= {f"pending.{i}.{PART}{k}": v for k, v in batch.get("reward_parts", {}).items()}
        return state

    def load_rank_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what rank_state saved."""
        if "generator" in state:
            self.generator.set_state(state["generator"])
        pending: dict[int, dict[str, Any]] = {}
        for key, value in state.items():
            if key.startswith("pending."):
                _, i, name = key.split(".", 2)
                pending.setdefault(int(i), {})[name] = value
        for batch in pending.values():
            parts = [k for k in batch if k.startswith(PART)]
            batch["reward_parts"] = {k.removeprefix(PART): batch.pop(k) for k in parts}
        self.pending = [_finish(pending[i]) for i in sorted(pending)] or None

    @property
    def generated_by(self) -> str:
        """Which engine generates the rollouts, as the run reports it: `engine`, or the generation's own."""
        describe = getattr(self.generation, "describe", None)
        return describe() if describe is not None and self.generation is not self.engine else "engine"

    def _rollouts(self, prompts: list[dict[str, Any]], epoch: int, done: int) -> list[dict[str, Any]]:
        if self.generation is self.engine:
            return self._made(prompts, epoch, done)
        self.generation.begin()
        try:
            return self._made(prompts, epoch, done)
        finally:
            self.generation.end()

    def _made(self, prompts: list[dict[str, Any]], epoch: int, done: int) -> list[dict[str, Any]]:
        rollouts = []
        for i, b in enumerate(prompts):
            # Sampling seeded by the micro-batch's place among every rank's in the epoch: the same
            # completions on 1 process or N (micro-batch j of a window here is rank j's there).
            index = (done + i) * self.world + self.rank
            self.generator.manual_seed(((self.seed * 1_000_003 + epoch) * 1_000_033 + index) % 2**63)
            made = self.rollout(b)
            rollouts.append(made | {"generation_seconds": self.generation_seconds})
        return rollouts

    # One micro-batch of rollouts ------------------------------------------------------------------------

    def _sample(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s, tok = self.settings, self.tokenizer
        device = self.engine.device
        # generate draws from the global generators: run it on a fork seeded from this source's own.
        seed = int(torch.randint(0, 2**62, (), generator=self.generator))
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            start = time.perf_counter()
            out = self.generation.generate(
                ids.to(device),
                mask.to(device),
                do_sample=True,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=0,
                max_new_tokens=s.max_new_tokens,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
            self.generation_seconds = time.perf_counter() - start
            return out

    def rollout(self, prompts: dict[str, Any]) -> dict[str, Any]:
        """G completions of every prompt of one micro-batch, scored: the batch the loss trains on."""
        s, g = self.settings, self.settings.num_generations
        ids = prompts["input_ids"].repeat_interleave(g, dim=0)
        mask = prompts["attention_mask"].repeat_interleave(g, dim=0)
        width = ids.shape[1]
        out = self._sample(ids, mask).cpu()
        # An encoder-decoder's rows are its decoder's: the start token, then the completion.
        completions = out[:, 1:] if self.encoder_decoder else out[:, width:]
        cmask = completion_mask(completions, self.tokenizer.eos_token_id)
        texts = self.tokenizer.batch_decode(
            [c[: int(n)] for c, n in zip(completions, cmask.sum(1), strict=True)], skip_special_tokens=True
        )
        rows = [
            {
                "prompt": prompts["prompt"][i // g],
                "answer": prompts["answer"][i // g],
                "completion_tokens": int(n),
            }
            for i, n in enumerate(cmask.sum(1).tolist())
        ]
        wheres = [f"prompt {i // g} of the batch, completion {i % g}" for i in range(len(rows))]
        total, per = score(self.rewards, texts, rows, wheres)
        rewards = torch.tensor(total, dtype=torch.float32)
        advantages, flat = group_advantages(rewards, g, s.scale_rewards)
        if self.encoder_decoder:
            tokens = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": out[:, :-1]}
            tokens["completions"] = completions
        else:
            tokens = {
                "input_ids": torch.cat([ids, completions], dim=1),
                "attention_mask": torch.cat([mask, cmask], dim=1),
                "prompt_width": torch.tensor(width),
            }
        batch = tokens | {
            "completion_mask": cmask,
            "advantages": advantages,
            "rewards": rewards,
            "reward_parts": {k: torch.tensor(v) for k, v in per.items()},
            "zero_variance_groups": flat,
        }
        if self.packed_inputs is not None:
            batch |= pack_rollouts(batch)
        device, inputs = self.engine.device, self.packed_inputs
        if s.passes > 1:
            # One pass: the old policy is the current one (the loss detaches the live log-probabilities, as
            # TRL does with one iteration), so this forward would only repeat the training forward's values.
            with torch.no_grad():
                batch["old_logp"] = rollout_log_probs(self.engine, batch, device, inputs).cpu()
        if s.beta:
            with adapter_off(self.engine):
                batch["ref_logp"] = rollout_log_probs(self.engine, batch, device, inputs).cpu()
        return _finish(batch)


def _finish(batch: dict[str, Any]) -> dict[str, Any]:
    """The loop's counts of a rollout batch (what its meters read)."""
    cmask, mask = batch["completion_mask"], batch["attention_mask"]
    if PACKED[0] in batch:  # one row of real tokens, no padding
        tokens = batch[PACKED[0]].numel()
        counts = {"num_real_tokens": tokens, "num_token_slots": tokens}
        return batch | counts | {"num_target_tokens": int(cmask.sum()), "num_examples": mask.shape[0]}
    # An encoder-decoder's rows are the prompt (encoder) plus the completion (decoder).
    decoder = "decoder_input_ids" in batch
    return batch | {
        "num_target_tokens": int(cmask.sum()),
        "num_real_tokens": int(mask.sum()) + (int(cmask.sum()) if decoder else 0),
        "num_token_slots": mask.numel() + (cmask.numel() if decoder else 0),
        "num_examples": mask.shape[0],
    }
