"""What GRPO's rollouts add to a plan (train.objective grpo): the memory of generating G completions per
prompt from the weights being trained, and how a step's time splits between generating and training.

Memory while generating (per rank, one micro-batch of prompts, on top of the resident states and the weights
a forward holds: ZeRO-3's gathered layer, FSDP2's unsharded block; or the whole model, gathered for
generation):
    KV cache      micro_batch_size x G sequences, every decoder layer's keys and values for the prompt and
                  max_new_tokens (encoder-decoders: the decoder's own and the cross-attention's over the
                  prompt, and the encoder's output)
    logits        generate's float32 logits of the last position (and the processed copy it samples from)
The old log-probabilities (only with grpo.passes > 1: with one pass the old policy is the current one) and,
with grpo.beta > 0, the reference's (the adapter switched off) are no-grad forwards of the same rows, one
after the other, so they add time, not a peak.

Time is a stated model, not a measurement (docs/grpo.md says what was measured): generating is
max_new_tokens decoding steps, each reading the weights and the KV cache from memory (ZeRO-3 and FSDP2 also
gather the weights over the interconnect: the whole model once per generate call when they gather it for
generation, lorakit.planner.generation, else every layer again at each decoding step); training is compute
at a model-FLOPs utilisation, for each pass over the rollouts plus the no-grad forwards. Rates are those of
an H100-class GPU (ASSUMED_GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lorakit.planner.activations import Kernels, Shape
from lorakit.planner.states import counts

# The time model's GPU: dense bf16 peak, HBM bandwidth, and the share of each that training and decoding
# reach (typical of torch eager training and of transformers' generate; not measured here).
ASSUMED_GPU = "H100-class (989 TFLOP/s bf16, 3.35 TB/s HBM, 200 GB/s per GPU between GPUs)"
PEAK_FLOPS = 989e12
TRAIN_MFU = 0.4
HBM_BYTES_PER_S = 3.35e12
DECODE_BANDWIDTH_SHARE = 0.6
LINK_BYTES_PER_S = 200e9
# generate keeps the last position's logits in float32 and a processed copy (temperature, top-p) to sample.
LOGITS_COPIES = 2


@dataclass(frozen=True)
class RolloutPlan:
    """One micro-batch of rollouts on one rank: its sizes, the memory generation adds, and the time model."""

    sequences: int  # completions generated: micro_batch_size x num_generations
    prompt_len: int
    new_tokens: int
    kv_cache: int  # bytes
    logits: int  # bytes
    encoder_output: int  # bytes (encoder-decoders)
    # Per rollout batch: the old log-probabilities' (passes > 1), the reference's (beta > 0).
    no_grad: tuple[str, ...]
    generate_seconds: float
    train_seconds: float
    # How sharded weights reach the decoding steps: "none" (whole on every rank), "per_call" (the whole model
    # gathered once per generate call), "per_step" (every layer gathered again at each decoding step).
    gathers: str = "none"

    @property
    def no_grad_forwards(self) -> int:
        """The no-grad forwards of a rollout batch."""
        return len(self.no_grad)

    @property
    def generation_bytes(self) -> int:
        """What generating holds beyond a forward's weights: KV cache, logits, encoder output."""
        return self.kv_cache + self.logits + self.encoder_output

    @property
    def generate_share(self) -> float:
        """The share of a step's time spent generating (the time model's)."""
        return self.generate_seconds / max(self.generate_seconds + self.train_seconds, 1e-12)

    def note(self) -> str:
        """The plan's line on the rollouts."""
        return (
            f"train.objective grpo: {self.sequences} completions per micro-batch (micro_batch_size x "
            f"grpo.num_generations) of up to {self.new_tokens} tokens after {self.prompt_len}-token prompts; "
            f"generating holds {_gib(self.kv_cache)} of KV cache and {_gib(self.logits + self.encoder_output)} "
            f"more; {self.no_grad_forwards} no-grad forward(s) per rollout batch"
            f"{' (' + ', '.join(self.no_grad) + ')' if self.no_grad else ''}; time model ({ASSUMED_GPU}): "
            f"~{self.generate_share:.0%} of a step generating, {self.generate_seconds:.2f} s against "
            f"{self.train_seconds:.2f} s training per micro-batch of prompts (all grpo.passes)"
            + _GATHERS[self.gathers]
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (the plan's `rollouts`)."""
        return {
            "sequences": self.sequences,
            "prompt_len": self.prompt_len,
            "new_tokens": self.new_tokens,
            "kv_cache_bytes": self.kv_cache,
            "logits_bytes": self.logits,
            "encoder_output_bytes": self.encoder_output,
            "generation_bytes": self.generation_bytes,
            "no_grad_forwards": self.no_grad_forwards,
            "generate_seconds": round(self.generate_seconds, 4),
            "train_seconds": round(self.train_seconds, 4),
            "generate_share": round(self.generate_share, 4),
            "gathers": self.gathers,
            "assumed_gpu": ASSUMED_GPU,
        }


_GATHERS = {
    "none": "",
    "per_call": ", the sharded weights gathered once per generate call",
    "per_step": ", the sharded weights gathered again at every decoding step",
}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def rollout_plan(
    arch,
    *,
    micro_batch_size: int,
    num_generations: int,
    prompt_len: int,
    max_new_tokens: int,
    beta: float,
    passes: int,
    dtype_bytes: int,
    weight_bytes: int,
    adapter: bool,
    gradient_checkpointing: bool,
    gathered_over: int = 1,
    gathered_whole: bool = False,
) -> RolloutPlan:
    """The rollouts of one micro-batch of `micro_batch_size` prompts of `prompt_len` tokens for a model of
    shape `arch` (lorakit.planner.arch.Arch): `weight_bytes` the base weights as stored on the GPU (what each
    decoding step reads), `gathered_over` the ranks the weights are sharded over (ZeRO-3, FSDP2: the other
    ranks' shares come over the interconnect; 1: whole on every rank), `gathered_whole` whether generate
    gathers them whole once per call (distributed.gather_for_generation) instead of at each decoding step."""
    n = micro_batch_size * num_generations
    a = dtype_bytes
    kv = arch.kv_width
    if arch.is_encoder_decoder:
        dec = arch.decoder_layers
        # The decoder's own keys and values, the cross-attention's over the prompt, the encoder's output.
        kv_bytes = n * dec * 2 * kv * a * (max_new_tokens + prompt_len)
        encoder = n * prompt_len * arch.hidden * a
        decoding = arch.decoder_layers / (arch.layers + arch.decoder_layers)
        completion_tokens, prompt_tokens = n * max_new_tokens, n * prompt_len
    else:
        kv_bytes = n * arch.layers * 2 * kv * a * (prompt_len + max_new_tokens)
        encoder, decoding = 0, 1.0
        completion_tokens, prompt_tokens = n * max_new_tokens, n * prompt_len
    logits = LOGITS_COPIES * n * arch.vocab * 4
    params = arch.total_params
    # Decoding: each step reads the (decoder's) weights and on average half the final KV cache, or is
    # bound by its FLOPs for a large batch; the prefill is compute; sharded weights are gathered each step.
    step_read = decoding * weight_bytes + kv_bytes / 2
    per_step = max(
        step_read / (HBM_BYTES_PER_S * DECODE_BANDWIDTH_SHARE),
        2 * decoding * params * n / (PEAK_FLOPS * TRAIN_MFU),
    )
    # The other ranks' shares of the weights, over the interconnect.
    link = weight_bytes * (gathered_over - 1) / gathered_over / LINK_BYTES_PER_S
    once = link if gathered_whole else 0.0
    if not gathered_whole:
        per_step += decoding * link
    prefill = 2 * params * prompt_tokens / (PEAK_FLOPS * TRAIN_MFU)
    generate = max_new_tokens * per_step + prefill + once
    # Training: forward 2N per token, backward 2N (activation gradients; full fine-tuning 4N with the
    # weights'), the recomputed forward under gradient checkpointing; and the no-grad forwards.
    tokens = prompt_tokens + completion_tokens
    per_pass = (2 + (2 if adapter else 4) + (2 if gradient_checkpointing else 0)) * params * tokens
    # The old log-probabilities only with several passes (one pass: the old policy is the current one).
    no_grad = ("old log-probabilities",) * (passes > 1) + ("reference",) * (beta > 0)
    flops = passes * per_pass + len(no_grad) * 2 * params * tokens
    return RolloutPlan(
        sequences=n,
        prompt_len=prompt_len,
        new_tokens=max_new_tokens,
        kv_cache=kv_bytes,
        logits=logits,
        encoder_output=encoder,
        no_grad=no_grad,
        generate_seconds=generate,
        train_seconds=flops / (PEAK_FLOPS * TRAIN_MFU),
        gathers="none" if gathered_over <= 1 else ("per_call" if gathered_whole else "per_step"),
    )


def _section(recipe):
    return getattr(recipe, "grpo", None) if recipe.train.objective == "grpo" else None


def completions_per_prompt(recipe) -> int:
    """Rows of a training micro-batch per prompt: grpo.num_generations for GRPO, else 1."""
    section = _section(recipe)
    return section.num_generations if section is not None else 1


def rollout_shape(
    recipe, arch, seq_len, target_len, device: str, notes: list
) -> tuple[Shape, Kernels, None] | None:
    """GRPO's training micro-batch as the rollout source makes it (lorakit.objectives.grpo_rollouts), None
    unless train.objective is grpo: each prompt's grpo.num_generations completions as rows, padded (a
    causal LM's packed rollouts, data.packing auto, hold at most as many tokens), a causal LM's rows its
    prompt (data.max_length) then grpo.max_new_tokens, an encoder-decoder's prompt the encoder's input and
    grpo.max_new_tokens the decoder's."""
    from lorakit.planner.shapes import micro_batch_shape

    section = _section(recipe)
    if section is None:
        return None
    # The prompts as GRPO's batching makes them (padded, whatever data.packing says); their targets are the
    # completions. Packed rollouts are planned as their padded upper bound.
    data = recipe.data.model_copy(update={"packing": False, "max_target_length": section.max_new_tokens})
    prompts, kernels, _ = micro_batch_shape(
        recipe.model_copy(update={"data": data}), arch, seq_len, target_len, device, notes
    )
    rows = prompts.rows * section.num_generations
    if arch.is_encoder_decoder:
        return replace(prompts, rows=rows), kernels, None
    return replace(prompts, rows=rows, seq_len=prompts.seq_len + section.max_new_tokens), kernels, None


def planned_rollouts(
    recipe, arch, dtype_bytes: int, setup, shape: Shape, world: int, generation=None
) -> RolloutPlan | None:
    """The rollouts of `recipe` under `setup` (lorakit.planner.states.Setup) on `world` ranks, the training
    micro-batch's `shape` that rollout_shape gave, generating as `generation` says (a
    lorakit.planner.generation.Generation; None: sharded weights gathered at each decoding step); None
    unless train.objective is grpo."""
    section = _section(recipe)
    if section is None:
        return None
    # A causal LM's rows are the prompt then the completion; an encoder-decoder's seq_len is the prompt's.
    prompt_len = shape.seq_len - (0 if arch.is_encoder_decoder else section.max_new_tokens)
    method = recipe.method
    weights = arch.total_params * dtype_bytes
    if method.kind == "qlora":
        # The base as the model states store it (lorakit.planner.states.counts): 4-bit linears and fused
        # experts with their constants, the rest in model.dtype.
        c = counts(arch, method, dtype_bytes, None)
        weights = c.frozen_bytes + c.quant_constants
    return rollout_plan(
        arch,
        micro_batch_size=setup.micro_batch_size,
        num_generations=section.num_generations,
        prompt_len=prompt_len,
        max_new_tokens=section.max_new_tokens,
        beta=section.beta,
        passes=section.passes,
        dtype_bytes=dtype_bytes,
        weight_bytes=weights,
        adapter=method.adapter(),
        gradient_checkpointing=setup.gradient_checkpointing,
        # ZeRO-3 (and FSDP2, planned as it): the weights gathered whole per generate call, or per step.
        gathered_over=world if setup.zero_stage == 3 else 1,
        gathered_whole=bool(generation and generation.gathers and "GRPO rollouts" in generation.moments),
    )
