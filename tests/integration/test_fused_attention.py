"""The CUDA kernels for packed rows (lorakit.model.fused_attention), checked on the CPU: which kernel a call
takes, the cu_seqlens and bias table they get, and the packing contract through each path.

varlen_attn is CUDA-only: here PyTorch's function is replaced by a reference written from its documented
semantics (cu_seqlens, window_size, enable_gqa, scale), so what lorakit hands it (layouts, offsets, windows,
grouped heads) is what is tested; tests/gpu runs the real kernel. FlexAttention runs forward on the CPU
(backward is CUDA-only), so the T5 self-attention path is checked for real, in eval without gradients.
"""

from __future__ import annotations

import pytest
import torch

from lorakit.model import fused_attention as fa
from lorakit.model import varlen
from tests.integration.test_packed_attention import CAUSAL_KINDS, _per_example, _rows
from tests.integration.test_packed_attention import _model as causal_model
from tests.integration.test_packed_seq2seq import _alone_and_packed
from tests.integration.test_packed_seq2seq import _model as seq2seq_model
from tests.integration.test_packed_seq2seq import _rows as seq2seq_rows

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
TOL = 1e-4


@pytest.mark.parametrize(
    "kind, device, dtype, dropout, bias, expected",
    [
        ("causal", CUDA, torch.bfloat16, 0.0, False, fa.VARLEN),
        ("causal", CUDA, torch.float16, 0.0, False, fa.VARLEN),
        ("causal", CUDA, torch.float32, 0.0, False, fa.LOOP),  # flash kernels: half precision only
        ("causal", CUDA, torch.bfloat16, 0.1, False, fa.LOOP),  # no attention dropout in varlen
        ("causal", CPU, torch.bfloat16, 0.0, False, fa.LOOP),
        ("cross", CUDA, torch.bfloat16, 0.0, False, fa.VARLEN),
        ("encoder", CUDA, torch.bfloat16, 0.0, True, fa.FLEX),
        ("decoder", CUDA, torch.float32, 0.0, True, fa.FLEX),
        ("decoder", CUDA, torch.bfloat16, 0.1, True, fa.LOOP),  # FLAN-T5's dropout_rate in training
        ("encoder", CPU, torch.float32, 0.0, True, fa.LOOP),
    ],
)
def test_kernel_choice(kind, device, dtype, dropout, bias, expected):
    assert fa.choose_kernel(kind, device, dtype, dropout, bias=bias) == expected


def test_cu_seqlens_and_example_index():
    cu, longest = fa.cu_seqlens((0, 3, 10, 11), "cpu")
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 10, 11] and longest == 7
    assert fa.example_index((0, 3, 10, 11), "cpu").tolist() == [0] * 3 + [1] * 7 + [2]
    for bad in ((1, 4), (0, 3, 3), (0,)):
        with pytest.raises(ValueError, match="boundaries"):
            fa.cu_seqlens(bad, "cpu")


def test_bias_table_reads_t5_bias_by_distance():
    m, heads = 9, 3
    distance = torch.arange(m)[None, :] - torch.arange(m)[:, None]  # k - q
    per_head = torch.randn(heads, 2 * m - 1)
    bias = per_head[:, distance + m - 1].unsqueeze(0)  # (1, H, m, m), a function of k - q only
    table = fa.bias_table(bias)
    assert torch.equal(table, per_head)


def _reference_varlen(
    q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    """varlen_attn's documented semantics, spelled out: (T, H, D) tokens, sequence i is cu[i]:cu[i+1]."""
    assert q.dim() == 3 and cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
    if enable_gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    assert k.shape[1] == q.shape[1], "grouped KV heads without enable_gqa"
    out = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = (t[c[i] : c[i + 1]].transpose(0, 1) for t, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        n, m = qs.shape[1], ks.shape[1]
        qi, ki = torch.arange(n)[:, None] + (m - n), torch.arange(m)[None, :]  # bottom-right aligned
        left, right = window_size
        allowed = torch.ones(n, m, dtype=torch.bool)
        if left >= 0:
            allowed &= ki >= qi - left
        if right >= 0:
            allowed &= ki <= qi + right
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale)
        out.append(o.transpose(0, 1))
    return torch.cat(out)


@pytest.fixture
def forced(monkeypatch):
    """Make packed attention take the given kernel for each call kind ({kind: kernel}) on this CPU."""
    import torch.nn.attention.varlen as torch_varlen

    monkeypatch.setattr(torch_varlen, "varlen_attn", _reference_varlen)
    fa.KERNELS_USED.clear()

    def force(kernels: dict[str, str]):
        real = fa.choose_kernel

        def choose(kind, device, dtype, dropout, *, bias):
            return kernels[kind] if kind in kernels else real(kind, device, dtype, dropout, bias=bias)

        monkeypatch.setattr(varlen, "choose_kernel", choose)

    return force


@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_varlen_causal_path_keeps_examples_apart(cache_dir, tmp_path, forced, kind):
    """llama, mistral (sliding window 64, shorter than an example here) and qwen2 (grouped KV heads)."""
    forced({"causal": fa.VARLEN})
    built = causal_model(cache_dir, tmp_path, kind, "varlen_sdpa")
    alone, sliced, _, _ = _per_example(built, _rows(built.model.config.vocab_size))
    layers = built.model.config.num_hidden_layers
    assert fa.KERNELS_USED["causal", fa.VARLEN] >= layers and fa.KERNELS_USED["causal", fa.LOOP] == 0
    for (la, sa), (lp, sp) in zip(alone, sliced, strict=True):
        assert (la - lp).abs().max().item() < TOL
        assert abs(sa.item() - sp.item()) < TOL * max(1.0, abs(sa.item()))


def test_varlen_cross_and_flex_self_attention_keep_t5_pairs_apart(cache_dir, tmp_path, forced):
    """T5 cross-attention through varlen, encoder and decoder self-attention (relative position bias through
    the table, causal decoder) through FlexAttention: packed pairs equal pairs alone."""
    forced({"encoder": fa.FLEX, "decoder": fa.FLEX, "cross": fa.VARLEN})
    built = seq2seq_model(cache_dir, tmp_path, "varlen_sdpa")
    built.model.eval()
    with torch.no_grad():  # FlexAttention's backward is CUDA-only
        alone, sliced, _ = _alone_and_packed(built, seq2seq_rows())
    for kind, kernel in (("encoder", fa.FLEX), ("decoder", fa.FLEX), ("cross", fa.VARLEN)):
        assert fa.KERNELS_USED[kind, kernel] > 0 and fa.KERNELS_USED[kind, fa.LOOP] == 0, fa.KERNELS_USED
    for (la, sa), (lp, sp) in zip(alone, sliced, strict=True):
        assert (la - lp).abs().max().item() < TOL
        assert abs(sa.item() - sp.item()) < TOL * max(1.0, abs(sa.item()))


def test_the_contract_catches_a_wrong_offset(cache_dir, tmp_path, forced, monkeypatch):
    """Negative control: cu_seqlens off by one token lets an example see its neighbour; the check fails."""
    forced({"causal": fa.VARLEN})
    real = fa.cu_seqlens

    def shifted(bounds, device):
        cu, _ = real(bounds, device)
        cu[1:-1] += 1
        return cu, int((cu[1:] - cu[:-1]).max())

    monkeypatch.setattr(fa, "cu_seqlens", shifted)
    built = causal_model(cache_dir, tmp_path, "llama", "varlen_sdpa")
    alone, sliced, _, _ = _per_example(built, _rows(built.model.config.vocab_size))
    assert (
        max((la - lp).abs().max().item() for (la, _), (lp, _) in zip(alone, sliced, strict=True)) > 100 * TOL
    )
