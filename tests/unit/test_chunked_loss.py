"""The token loss in chunks: the same loss and gradients as one fp32 cross-entropy over the whole row, and a
lower peak memory (issue: fp32 logits of a whole packed row)."""

import pytest
import torch
import torch.nn.functional as F

from lorakit.meter import TensorMemoryTracker
from lorakit.model.loss import token_loss_sum


def _reference(logits, labels):
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="sum")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 150, 10_000])
def test_same_loss_and_gradients_as_one_cross_entropy(dtype, chunk_tokens):
    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    logits = (3 * torch.randn(3, 50, vocab, generator=gen)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (3, 50), generator=gen)
    labels[0, :9] = -100  # prompt tokens: no loss
    labels[2, 40:] = -100  # padding
    ref = _reference(logits, labels)
    (ref_grad,) = torch.autograd.grad(ref * 0.37, logits)
    out = token_loss_sum(logits, labels, chunk_elements=chunk_tokens * vocab)
    (grad,) = torch.autograd.grad(out * 0.37, logits)
    assert out.dtype == torch.float32 and out.item() == pytest.approx(ref.item(), rel=1e-6)
    # The same fp32 math (softmax - onehot), rounded to the logits' dtype: equal to within that rounding.
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=rtol, atol=1e-6)
    assert (grad[0, :9] == 0).all() and (grad[2, 40:] == 0).all()
    with torch.no_grad():  # evaluation
        assert token_loss_sum(logits, labels, chunk_elements=chunk_tokens * vocab).item() == out.item()


def test_a_row_with_no_target_tokens_has_zero_loss_and_gradient():
    logits = torch.randn(1, 8, 50, requires_grad=True)
    out = token_loss_sum(logits, torch.full((1, 8), -100), chunk_elements=100)
    out.backward()
    assert out.item() == 0 and (logits.grad == 0).all()


def test_peak_memory_is_lower_than_one_fp32_cross_entropy():
    """A 4096-token row of a 32k vocabulary in bf16 (256 MiB of logits): one fp32 cross-entropy adds the
    fp32 copy, its log-softmax and an fp32 gradient (1.5 GiB); the chunks add one chunk's fp32 work and the
    bf16 gradient. Measured as the peak of live tensor storages (TensorMemoryTracker), not the process's
    RSS, which the allocator and the machine's load made vary by half a GiB."""
    torch.manual_seed(0)
    tokens, vocab = 4096, 32768
    logits = torch.randn(tokens, vocab, dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    peak = {}
    for kind in ("whole", "chunked"):
        logits.grad = None
        with TensorMemoryTracker("cpu") as t:
            if kind == "chunked":
                loss = token_loss_sum(logits, labels)
            else:
                loss = F.cross_entropy(logits.float(), labels, reduction="sum")
            loss.backward()
        peak[kind] = t.peak - t.baseline
    assert peak["whole"] >= 1.5 * 2**30  # the fp32 copies are really there to save
    assert peak["chunked"] < 0.5 * peak["whole"], peak
