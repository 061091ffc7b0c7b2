"""The built-in check: a fixed probe batch through the adapter model and the merged model.

The merge fails when the largest logit difference exceeds RELATIVE_TOLERANCE[dtype] x the largest logit
magnitude (at least 1). Merging changes how a layer rounds: the adapter model computes
round(W x) + round(B A x), the merged one round((W + B A) x) with W + B A rounded to the dtype, so the two
differ by rounding noise that grows with depth. Measured (docs/merge.md) as max |diff| / max |logit|:

    dtype     tiny:t5 / tiny:llama, trained      random 24-32 layer Llama, hidden 256     tolerance
    float32   4e-7 .. 7e-7                       7e-7 .. 4e-6                             1e-4
    float16   9e-4 .. 1.3e-3                     2.7e-3 .. 6.7e-3                         2e-2
    bfloat16  7.5e-3 .. 1.6e-2                   2.1e-2 .. 5.6e-2                         1e-1

bf16 keeps 8 bits of mantissa against fp16's 11, so its noise is ~8x fp16's.

That tolerance alone cannot tell a merge that did nothing from a correct one when the adapter moves the
logits by less than it (an adapter's effect is often a few percent of the largest logit, under bf16's 10%).
So a merge is also measured against the adapter's own effect, |adapter model - base| on the same probe: the
merged model must be within EFFECT_SHARE of it from the adapter model. An export of the unmerged base (a
merge that did not apply the delta) differs by the whole effect and fails in every dtype; a correct merge
differs by rounding noise: in bf16 a tenth of a trained adapter's effect, and up to about a third for a
short CPU run's small adapter (docs/flan-t5.md's merge: 0.055 of 0.188), so the bound is half: a merge must
bring the model at least twice as close to the adapter model as the base is.

Routed models (Mixtral, Qwen3-MoE, OLMoE) are probed with the routing fixed: the adapter model's top-k
choices of experts are forced on the merged model's (and the base's) forward. Without that, bf16 rounding of
the merged weights flips routing at near-ties and a correct merge differs by a whole expert's output (12% of
the largest logit on a tiny Mixtral); with it, the difference is rounding again, and a wrong merge (a scaled
delta) still differs by its share of the adapter's effect.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch

from lorakit.model.families.start import decoder_start_token_id

RELATIVE_TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}
# The most the merged model may differ from the adapter model, as a share of how far the adapter moves the base
# (a no-op merge is at 1.0; bf16 rounding of a correct one stays near or below a third).
EFFECT_SHARE = 0.5
PROBE_ROWS, PROBE_LENGTH, PROBE_SEED = 4, 32, 0


def probe_batch(config, vocab_size: int) -> dict[str, torch.Tensor]:
    """A few fixed token sequences (seeded, no padding); for encoder-decoders with decoder inputs that start
    with the decoder start token."""
    gen = torch.Generator().manual_seed(PROBE_SEED)
    ids = torch.randint(0, vocab_size, (PROBE_ROWS, PROBE_LENGTH), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(config, "is_encoder_decoder", False):
        dec = torch.randint(0, vocab_size, (PROBE_ROWS, PROBE_LENGTH // 2), generator=gen)
        dec[:, 0] = decoder_start_token_id(config)
        batch["decoder_input_ids"] = dec
    return batch


@torch.no_grad()
def probe_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], routing=None) -> torch.Tensor:
    """The model's logits on the probe batch, in float32 (eval mode, no KV cache). `routing`
    (lorakit.model.router.FixedRouting, for routed families): its first probe records the top-k experts of
    every router call, later probes are forced to them (module docstring)."""
    model.eval()
    with routing.applied(model) if routing is not None else nullcontext():
        return model(**batch, use_cache=False).logits.float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference between two logit tensors."""
    return float((a - b).abs().max())


@dataclass(frozen=True)
class Check:
    """One comparison of logits against the reference."""

    name: str
    max_logit_diff: float
    scale: float  # the reference's largest |logit|, at least 1
    tolerance: float  # relative
    # The adapter's own effect on the probe (|adapter model - base|), when there is an adapter.
    adapter_effect: float | None = None

    @property
    def relative(self) -> float:
        """max_logit_diff / scale."""
        return self.max_logit_diff / self.scale

    @property
    def within_tolerance(self) -> bool:
        """Whether the difference is within the dtype's tolerance of the largest logit."""
        return self.max_logit_diff <= self.tolerance * self.scale

    @property
    def closer_than_base(self) -> bool:
        """Whether the merged model is within EFFECT_SHARE of the adapter's effect from the adapter model
        (True when there is no adapter to measure)."""
        return self.adapter_effect is None or self.max_logit_diff <= EFFECT_SHARE * self.adapter_effect

    @property
    def passed(self) -> bool:
        """Whether the difference is within the tolerance and small against the adapter's effect."""
        return self.within_tolerance and self.closer_than_base

    @property
    def effect_visible(self) -> bool:
        """Whether the adapter moves the logits by more than the tolerance, so an unmerged export would fail."""
        return self.adapter_effect is None or self.adapter_effect > self.tolerance * self.scale

    def describe(self) -> str:
        """One line for the terminal and the model card."""
        line = (
            f"{self.name}: max |logit diff| {self.max_logit_diff:.3g} (relative {self.relative:.2e}, "
            f"tolerance {self.tolerance:.0e} x max |logit| {self.scale:.3g})"
        )
        if self.adapter_effect is not None:
            line += (
                f"; the adapter itself moves them by up to {self.adapter_effect:.3g} (the difference must be "
                f"at most {EFFECT_SHARE:g} of that)"
            )
            if not self.closer_than_base:
                line += ": the merged model is hardly closer to the adapter model than the base is"
        return line

    def to_dict(self) -> dict:
        """For the merge record."""
        return {
            **asdict(self),
            "relative": self.relative,
            "effect_share": EFFECT_SHARE if self.adapter_effect is not None else None,
            "passed": self.passed,
        }


def compare(
    name: str,
    got: torch.Tensor,
    reference: torch.Tensor,
    tolerance: float,
    base: torch.Tensor | None = None,
) -> Check:
    """Compare logits `got` against `reference` (and measure the adapter's effect against `base`)."""
    scale = max(float(reference.abs().max()), 1.0)
    effect = max_diff(reference, base) if base is not None else None
    return Check(name, max_diff(got, reference), scale, tolerance, effect)
