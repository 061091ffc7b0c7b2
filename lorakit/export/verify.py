"""The built-in check: a fixed probe batch through the adapter model and the merged model.

The merge fails when the largest logit difference exceeds RELATIVE_TOLERANCE[dtype] x the largest logit
magnitude (at least 1). Merging changes how a layer rounds: the adapter model computes
round(W x) + round(B A x), the merged one round((W + B A) x) with W + B A rounded to the dtype, so the two
differ by rounding noise that grows with depth. Measured (docs/merge.md) as max |diff| / max |logit|:

    dtype     tiny:t5 / tiny:llama, trained      random 24-32 layer Llama, hidden 256     tolerance
    float32   4e-7 .. 7e-7                       7e-7 .. 4e-6                             1e-4
    float16   9e-4 .. 1.3e-3                     2.7e-3 .. 6.7e-3                         2e-2
    bfloat16  7.5e-3 .. 1.6e-2                   2.1e-2 .. 5.6e-2                         1e-1

bf16 keeps 8 bits of mantissa against fp16's 11, so its noise is ~8x fp16's. An export of the unmerged
base differs from the adapter model by the adapter's whole effect, which the check reports next to it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

RELATIVE_TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}
PROBE_ROWS, PROBE_LENGTH, PROBE_SEED = 4, 32, 0


def probe_batch(config, vocab_size: int) -> dict[str, torch.Tensor]:
    """A few fixed token sequences (seeded, no padding); for encoder-decoders with decoder inputs that start
    with the decoder start token."""
    gen = torch.Generator().manual_seed(PROBE_SEED)
    ids = torch.randint(0, vocab_size, (PROBE_ROWS, PROBE_LENGTH), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(config, "is_encoder_decoder", False):
        dec = torch.randint(0, vocab_size, (PROBE_ROWS, PROBE_LENGTH // 2), generator=gen)
        dec[:, 0] = config.decoder_start_token_id
        batch["decoder_input_ids"] = dec
    return batch


@torch.no_grad()
def probe_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's logits on the probe batch, in float32 (eval mode, no KV cache)."""
    model.eval()
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
    def passed(self) -> bool:
        """Whether the difference is within the tolerance."""
        return self.max_logit_diff <= self.tolerance * self.scale

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
            line += f"; the adapter itself moves them by up to {self.adapter_effect:.3g}"
        return line

    def to_dict(self) -> dict:
        """For the merge record."""
        return {**asdict(self), "relative": self.relative, "passed": self.passed}


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
