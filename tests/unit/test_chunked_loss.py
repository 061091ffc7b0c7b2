"""The token loss in chunks: the same loss and gradients as one fp32 cross-entropy over the whole row, and a
lower peak memory (issue: fp32 logits of a whole packed row)."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from lorakit.engine.loss import token_loss_sum


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


_PEAK = """
import json, resource, sys, torch, torch.nn.functional as F
from lorakit.engine.loss import token_loss_sum
torch.manual_seed(0)
tokens, vocab = 4096, 32768
logits = torch.randn(tokens, vocab, dtype=torch.bfloat16).requires_grad_()
labels = torch.randint(0, vocab, (tokens,))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if sys.argv[1] == "chunked":
    loss = token_loss_sum(logits, labels)
else:
    loss = F.cross_entropy(logits.float(), labels, reduction="sum")
loss.backward()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_kib": after - before}))
"""


def _peak(kind: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PEAK, kind], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_kib"]


def test_peak_memory_is_lower_than_one_fp32_cross_entropy():
    """A 4096-token row of a 32k vocabulary in bf16 (256 MiB of logits): one fp32 cross-entropy adds the
    fp32 copy, its log-softmax and an fp32 gradient (about 1.5 GiB); the chunks add one chunk (128 MiB)
    and the bf16 gradient (256 MiB)."""
    whole, chunked = _peak("whole"), _peak("chunked")
    assert whole > 1_000_000  # KiB: the fp32 copies are really there to save
    assert chunked < 0.5 * whole, (chunked, whole)
