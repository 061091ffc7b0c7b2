"""The CUDA kernels for packed rows (lorakit.model.fused_attention), checked on the CPU: which kernel a call
takes, the cu_seqlens and bias table they get, and the packing contract through each path.

varlen_attn is CUDA-only: here PyTorch's function is replaced by a reference written from its documented
semantics (cu_seqlens, window_size, enable_gqa, scale), so what lorakit hands it (layouts, offsets, windows,
grouped heads) is what is tested; tests/gpu runs the real kernel. Compiled FlexAttention runs forward on the
CPU (its backward is CUDA-only), so the T5 self-attention path is checked for real, compiled as on CUDA, in
eval without gradients; so is its memory, which must grow linearly with the row, not as T x T. Every test
here uses T5's heads (4 x 16) and max_distance (128), so the process compiles FlexAttention once.
"""

from __future__ import annotations

import types

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
def test_kernel_choice(monkeypatch, kind, device, dtype, dropout, bias, expected):
    monkeypatch.setattr(fa, "flex_compile_problem", lambda device: None)  # as on a CUDA machine with Triton
    assert fa.choose_kernel(kind, device, dtype, dropout, bias=bias) == expected


def test_flex_needs_the_compiler(monkeypatch):
    """Where torch.compile cannot run, T5 self-attention takes the loop (never eager FlexAttention), and the
    console says why, once."""
    monkeypatch.setattr(fa, "flex_compile_problem", lambda device: "no Triton here")
    said = []
    monkeypatch.setattr(fa, "_say", said.append)
    log = fa.KernelLog()
    for _ in range(3):
        assert fa.choose_kernel("encoder", CUDA, torch.bfloat16, 0.0, bias=True, log=log) == fa.LOOP
        log.used("encoder", fa.LOOP, CUDA, torch.bfloat16, 0.0)
    assert said == [
        "packed attention: T5 encoder self-attention -> per-example SDPA (lorakit.model.varlen) "
        "(no Triton here)"
    ]


def test_attention_dropout_is_a_visible_decision(monkeypatch):
    said = []
    monkeypatch.setattr(fa, "_say", said.append)
    log = fa.KernelLog()
    log.used("decoder", fa.LOOP, CUDA, torch.bfloat16, 0.1)
    log.used("decoder", fa.LOOP, CUDA, torch.bfloat16, 0.1)
    log.used("cross", fa.VARLEN, CUDA, torch.bfloat16, 0.0)
    assert len(said) == 2
    assert "attention dropout 0.1" in said[0] and "model.attention_dropout: 0" in said[0]
    assert said[1] == "packed attention: T5 cross-attention -> torch varlen_attn (flash, cu_seqlens)"


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

    def force(kernels: dict[str, str]):
        real = fa.choose_kernel

        def choose(kind, device, dtype, dropout, *, bias, log=None, **family):
            if kind in kernels:
                return kernels[kind]
            return real(kind, device, dtype, dropout, bias=bias, log=log, **family)

        monkeypatch.setattr(varlen, "choose_kernel", choose)

    return force


@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_varlen_causal_path_keeps_examples_apart(cache_dir, tmp_path, forced, monkeypatch, kind):
    """llama, mistral (sliding window 64, shorter than an example here) and qwen2 (grouped KV heads)."""
    forced({"causal": fa.VARLEN})
    built = causal_model(cache_dir, tmp_path, kind, "varlen_sdpa")
    offsets = []
    real = fa.cu_seqlens
    monkeypatch.setattr(fa, "cu_seqlens", lambda *a: offsets.append(a) or real(*a))
    alone, sliced, _, _ = _per_example(built, _rows(built.model.config.vocab_size))
    layers = built.model.config.num_hidden_layers
    calls = built.inputs.kernels.calls
    assert calls["causal", fa.VARLEN] >= layers and calls["causal", fa.LOOP] == 0
    # Built once for the packed batch (and copied to the device once), not once per layer or recompute.
    assert len(offsets) == 1, offsets
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
        calls = built.inputs.kernels.calls
        assert calls[kind, kernel] > 0 and calls[kind, fa.LOOP] == 0, calls
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


# T5's own attention module (the tiny T5's heads, head size and max_distance) as the attention function sees it.
HEADS, HEAD_DIM, MAX_DISTANCE = 4, 16, 128


def _t5_attention(decoder: bool):
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    config = T5Config(
        d_model=HEADS * HEAD_DIM,
        d_kv=HEAD_DIM,
        num_heads=HEADS,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=MAX_DISTANCE,
        is_decoder=decoder,
    )
    torch.manual_seed(1)
    module = T5Attention(config, has_relative_attention_bias=True, layer_idx=0, is_causal=decoder)
    with torch.no_grad():  # T5's bias starts near zero; a visible one makes a wrong distance visible
        module.relative_attention_bias.weight.normal_(0, 2.0)
    return module.eval()


def _self_attention(module, bounds, kernel, monkeypatch, layers: int = 2, kernels=None):
    """`layers` calls of the packed self-attention of one row (as the layers of a stack make them) through
    `kernel`, with T5's bias of the row's longest example (as the position-bias hook supplies it)."""
    monkeypatch.setattr(varlen, "choose_kernel", lambda *a, **k: kernel)
    n, longest = bounds[-1], max(e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=gen) for _ in range(3))
    segments = varlen.Seq2SeqSegments(bounds, bounds, kernels)  # the model's log, else its own
    bias = module.compute_bias(longest, longest)
    if module.is_decoder:
        bias = segments.cache["causal_bias"] = varlen._causal(bias)
    with torch.no_grad():
        return [
            varlen.varlen_sdpa_attention(
                module, q, k, v, None, lorakit_seq2seq_segments=segments, position_bias=bias, scaling=1.0
            )[0]
            for _ in range(layers)
        ], segments


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_compiled_flex_equals_per_example_attention(monkeypatch, decoder):
    """Examples longer than max_distance (T5's bias read at clamped distances) and shorter ones, in one row:
    compiled FlexAttention gives what per-example SDPA gives, and its block mask is built once per batch."""
    module = _t5_attention(decoder)
    bounds = (0, 300, 340, 341, 1024)  # the memory test's length: one CPU compilation for both
    kind = "decoder" if decoder else "encoder"
    flex, segments = _self_attention(module, bounds, fa.FLEX, monkeypatch)
    assert segments.kernels.calls[kind, fa.FLEX] == 2  # compiled, not fallen back to the loop
    loop, _ = _self_attention(module, bounds, fa.LOOP, monkeypatch)
    assert [key for key in segments.cache if key[0] == "flex"] == [
        ("flex", "decoder" if decoder else "encoder")
    ]
    for a, b in zip(flex, loop, strict=True):
        assert a.shape == b.shape == (1, bounds[-1], HEADS, HEAD_DIM)
        assert (a - b).abs().max().item() < TOL


def test_bias_table_clamps_at_max_distance():
    """T5's bucket is the same for every distance >= max_distance: the fixed-size table reproduces T5's bias
    for an example longer than that, and pads a shorter one."""
    module = _t5_attention(decoder=False)
    with torch.no_grad():
        for m in (MAX_DISTANCE + 70, 9):
            bias = module.compute_bias(m, m)
            table = fa.bias_table(bias, MAX_DISTANCE)
            assert table.shape == (HEADS, 2 * MAX_DISTANCE + 1)
            distance = (torch.arange(m)[None, :] - torch.arange(m)[:, None]).clamp(
                -MAX_DISTANCE, MAX_DISTANCE
            )
            assert torch.equal(table[:, distance + MAX_DISTANCE], bias[0])


def _peak_bytes(fn) -> int:
    """The most CPU tensor memory alive at once while fn() runs, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    alive = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        alive += e.nbytes()
        peak = max(peak, alive)
    return peak


def test_compiled_flex_memory_grows_linearly_with_the_row():
    """One packed T5 row of 1024 and of 4096 tokens (block mask and attention): the peak memory grows about 4x
    (linear), not 16x, and stays far below the H x T x T fp32 scores eager FlexAttention builds."""
    module = _t5_attention(decoder=False)
    with torch.no_grad():
        bias = module.compute_bias(600, 600)
    peaks = {}
    for n in (1024, 4096):
        bounds = tuple(range(0, n - 600, 400)) + (n - 600, n)
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=gen) for _ in range(3))

        def attend(bounds=bounds, q=q, k=k, v=v):
            with torch.no_grad():
                log = fa.KernelLog()
                layout = fa.flex_layout(bounds, causal=False, device="cpu", log=log)
                out = fa.flex_self_attention(
                    q, k, v, layout, bias, max_distance=MAX_DISTANCE, scaling=1.0, log=log
                )
            assert out is not None and out.shape == (1, bounds[-1], HEADS, HEAD_DIM)

        attend()  # compiled (once per process) outside the measurement
        peaks[n] = _peak_bytes(attend)
    scores = HEADS * 4096 * 4096 * 4
    assert peaks[4096] < 6 * peaks[1024], peaks
    assert peaks[4096] < scores / 20, (peaks, scores)


def test_eager_flex_attention_is_unreachable(monkeypatch):
    """On CUDA (device faked through the kernel choice) the T5 self-attention path calls only what
    torch.compile made of FlexAttention and its block-mask builder (automatic dynamic shapes), never the eager
    functions, and builds one block mask per batch and attention kind, shared by every layer."""
    import torch.nn.attention.flex_attention as torch_flex

    def eager_flex(*args, **kwargs):
        raise AssertionError("eager FlexAttention called")

    def eager_mask(*args, **kwargs):
        raise AssertionError("eager create_block_mask called")

    compiled, calls = [], []

    def fake_compile(fn, **options):
        compiled.append((fn, options))

        def run(*args, **kwargs):  # a compiled kernel: never runs the eager Python function
            calls.append("flex" if fn is eager_flex else "mask")
            return torch.zeros_like(args[0]) if fn is eager_flex else types.SimpleNamespace(mask_mod=args[0])

        return run

    monkeypatch.setattr(torch_flex, "flex_attention", eager_flex)
    monkeypatch.setattr(torch_flex, "create_block_mask", eager_mask)
    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(fa, "flex_compile_problem", lambda device: None)  # a CUDA machine with Triton
    real_choose = fa.choose_kernel
    fa._compiled.cache_clear()
    try:
        for decoder in (False, True):
            kernel = real_choose("decoder" if decoder else "encoder", CUDA, torch.bfloat16, 0.0, bias=True)
            assert kernel == fa.FLEX
            _self_attention(_t5_attention(decoder), (0, 30, 31, 64), kernel, monkeypatch, layers=3)
        fa._compiled("cuda")
    finally:
        fa._compiled.cache_clear()  # later tests compile the real functions
    # The tensors here are on the CPU (static shapes, see fused_attention._compiled); CUDA's take automatic
    # dynamic shapes (dynamic=True broke inductor's FlexAttention lowering in torch 2.11 on an H200).
    assert compiled == [
        (eager_flex, {"dynamic": False}),
        (eager_mask, {"dynamic": False}),
        (eager_flex, {"dynamic": None}),
        (eager_mask, {"dynamic": None}),
    ]
    # One block mask per batch and kind, one attention call per layer.
    assert calls == (["mask"] + ["flex"] * 3) * 2


@pytest.mark.parametrize("setting, kernel", [(None, fa.FLEX), (0.1, fa.LOOP)])
def test_flan_t5_dropout_reaches_the_fused_kernels_by_default(
    cache_dir, tmp_path, monkeypatch, setting, kernel
):
    """tiny:t5 has FLAN-T5's dropout_rate 0.1. By default (model.attention_dropout 0) its attention modules
    drop no attention weights, so training on CUDA reaches FlexAttention, while hidden states are still
    dropped at 0.1; model.attention_dropout 0.1 keeps the per-example loop. What is decided is what
    transformers' T5Attention passes the attention function in training: its `dropout` float."""
    from lorakit.model import build_model
    from lorakit.recipe import recipe_from_dict
    from tests.conftest import tiny_recipe_dict

    monkeypatch.setattr(fa, "flex_compile_problem", lambda device: None)  # a CUDA machine with Triton
    model = {} if setting is None else {"attention_dropout": setting}
    built = build_model(recipe_from_dict(tiny_recipe_dict(cache_dir, tmp_path, model=model)))
    assert built.model.config.dropout_rate == 0.1
    attention = [m for m in built.model.modules() if hasattr(m, "compute_bias")]
    hidden = [m for m in built.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert attention and hidden and all(m.p == 0.1 for m in hidden)
    assert {m.dropout for m in attention} == {setting or 0.0}
    for m in attention:
        kind = "cross" if m.is_decoder and not m.is_causal else ("decoder" if m.is_decoder else "encoder")
        expected = fa.VARLEN if kind == "cross" and kernel == fa.FLEX else kernel
        assert fa.choose_kernel(kind, CUDA, torch.bfloat16, m.dropout, bias=kind != "cross") == expected


def test_a_failed_compilation_falls_back_to_the_loop_once(monkeypatch):
    """A first compiled call that fails (no C++ compiler, a Triton build error): said once, that call and
    every later one take per-example SDPA, with the same result."""

    def broken_compile(fn, **options):
        def run(*args, **kwargs):
            raise RuntimeError("C++ compile error\nmore detail")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    said = []
    monkeypatch.setattr(fa, "_say", said.append)
    fa._compiled.cache_clear()
    module, bounds = _t5_attention(decoder=False), (0, 30, 31, 64)
    try:
        flex, segments = _self_attention(module, bounds, fa.FLEX, monkeypatch, layers=2)
    finally:
        fa._compiled.cache_clear()
    assert segments.kernels.calls["encoder", fa.LOOP] == 2
    # The same model's next batch: its log already said why it takes the loop.
    loop, _ = _self_attention(module, bounds, fa.LOOP, monkeypatch, layers=1, kernels=segments.kernels)
    assert torch.equal(flex[0], loop[0])
    assert said[0] == (
        "packed attention: compiling FlexAttention failed: RuntimeError: C++ compile error; "
        "T5 self-attention takes per-example SDPA instead"
    )
    assert len(said) == 2 and "per-example SDPA" in said[1]  # the loop named once, with the reason
    # This model's later calls take the loop; a new model (its own log) tries compiling again.
    log = segments.kernels
    assert fa.choose_kernel("encoder", CUDA, torch.bfloat16, 0.0, bias=True, log=log) == fa.LOOP
    assert fa.KernelLog().flex_broken is None


def test_grouped_kv_heads_on_a_varlen_without_enable_gqa(monkeypatch):
    """torch 2.11's varlen_attn has no `enable_gqa` (seen on the lent H200): the grouped KV heads are repeated
    before the call, and the output equals the one through a varlen that groups them itself."""
    import torch.nn.attention.varlen as torch_varlen

    def varlen_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 30, 16, generator=g)
    k, v = torch.randn(2, 1, 2, 30, 16, generator=g)
    layout = fa.varlen_layout([0, 7, 19, 30], "cpu")
    outs = []
    for impl in (_reference_varlen, varlen_2_11):
        monkeypatch.setattr(torch_varlen, "varlen_attn", impl)
        fa._varlen_takes_gqa.cache_clear()
        outs.append(fa.varlen_causal(q, k, v, layout, 0.25, None))
    fa._varlen_takes_gqa.cache_clear()
    assert outs[0].shape == (1, 30, 8, 16)
    assert torch.equal(outs[0], outs[1])
