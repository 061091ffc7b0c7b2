"""Shared-prompt DPO rows on a CUDA GPU in bf16 through torch's varlen flash kernel (lorakit.model.
shared_prompt): the rejected response's queries are shorter than their keys (prompt + rejected), which the
kernel must align to the bottom right. tests/unit/test_dpo_variants.py checks the same layout on the CPU
against a reference of the kernel's documented semantics; this runs the kernel itself.

As in test_packed_bf16.py, the bound is measured, not fixed: the shared row's error against the float32
padded reference may be at most BF16_FACTOR times the padded bf16 batch's own error, plus one bf16 rounding
of the largest log-probability. A misaligned mask (the rejected tokens cut off from most of the prompt)
changes the log-probabilities by far more than rounding.
"""

from __future__ import annotations

import pytest
import torch

from lorakit.data.pair_collate import CausalPairCollator, SharedPromptCollator
from lorakit.model import fused_attention as fa
from lorakit.model.inputs import ModelInputs
from lorakit.objectives.dpo import DpoObjective
from tests.conftest import training_config_model
from tests.unit.test_dpo_variants import _rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF16_FACTOR = 3.0


def test_shared_prompt_rows_through_varlen_attn_match_padded_pairs(cache_dir, tmp_path):
    built = training_config_model(cache_dir, tmp_path / "run", "varlen_sdpa", name_or_path="tiny:llama")
    model = built.model.to("cuda")
    rows = _rows(model.config.vocab_size)
    objective = DpoObjective(0.5, encoder_decoder=False)

    def log_probs(collator, inputs):
        with torch.no_grad():
            return objective.log_probs(model, inputs, collator(rows), "cuda").double()

    reference = log_probs(CausalPairCollator(0), built.inputs)  # float32: the loop, not the kernel
    model.to(torch.bfloat16)
    bf16 = ModelInputs(model.config, built.attention, torch.bfloat16)
    shared = log_probs(SharedPromptCollator(max_tokens=512), bf16)
    assert bf16.kernels.calls["causal", fa.VARLEN] > 0 and bf16.kernels.calls["causal", fa.LOOP] == 0
    padded = log_probs(CausalPairCollator(0), bf16)
    e_padded = (padded - reference).abs().max().item()
    e_shared = (shared - reference).abs().max().item()
    bound = BF16_FACTOR * e_padded + 2.0**-9 * reference.abs().max().item()
    assert e_shared <= bound, (e_shared, e_padded, bound)
