"""The packing contract on a CUDA GPU in bf16: a packed row computes what each of its examples computes alone.

The CPU contract (tests/integration/test_packed_attention.py, test_packed_seq2seq.py) runs in float32 with an
absolute tolerance of 1e-4. Here the same models, rows and training configuration (train mode, gradient
checkpointing, LoRA with a non-zero update, through ModelInputs.logits as the loop calls it) run in bf16 on
the GPU's own kernels (flash / memory-efficient SDPA, cuBLAS), plus a wider Llama with rows of up to 1100
tokens, so that the kernels tile and split work as they do at real sizes.

The bf16 tolerance, and why. bf16 keeps 8 significant bits (unit roundoff 2^-9, about 2e-3). A packed row
and an example alone go through different kernels (different matrix shapes, tiles and accumulation orders),
so their bf16 results differ by rounding even when no attention leaks, and rounding compounds over layers: on
these models the logits of the examples alone in bf16 are 4e-3 to 8e-3 (relative Frobenius norm) away from
the same model upcast to float32 (measured with CPU bf16 kernels; a single bf16 matmul is 1e-3 to 1e-2). So a
fixed tolerance would be either loose or flaky. The test measures the rounding on the model at hand instead:
`e_alone`, the error of the examples alone in bf16 against the float32 twin, and requires the packed row's
error against that reference, `e_packed`, to be at most BF16_FACTOR * e_alone + BF16_ROUNDOFF (the packed row
may be as unlucky in its rounding as the examples alone, with margin, plus one rounding step), and at most
SANITY_TOL = 5e-2 whatever e_alone is. Per-example loss sums (computed in float32 from the logits) must agree
with the reference within LOSS_TOL = 1e-2 (measured: below 1e-3). A leak is not rounding: the negative
controls show that a row packed without isolation misses these bounds many times over (on CPU bf16: 0.72
against a bound of 0.018 for Llama, 0.37 against 0.026 for T5), so the test can fail.
"""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch

from lorakit.data.collate import CausalCollator, PackedCausalCollator, PackedSeq2SeqCollator, Seq2SeqCollator
from lorakit.model.inputs import ModelInputs
from lorakit.model.loss import token_loss_sum
from tests.conftest import PACKING_BACKENDS, ready_for_contract, tiny_recipe_dict, training_config_model
from tests.integration.test_packed_attention import CAUSAL_KINDS, LENGTHS
from tests.integration.test_packed_attention import _rows as causal_rows
from tests.integration.test_packed_seq2seq import _rows as seq2seq_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"
SANITY_TOL = 5e-2
LOSS_TOL = 1e-2
BF16_FACTOR = 3.0
BF16_ROUNDOFF = 2.0**-9
# A leak must miss the tolerance by far more than rounding could (see the negative controls).
LEAK_MARGIN = 5.0
# The wider Llama's rows: long enough for multi-tile attention and large matmuls, one very short.
LONG_LENGTHS = (300, 1100, 17, 650)
FLASH = importlib.util.find_spec("flash_attn") is not None
BACKENDS = [
    *PACKING_BACKENDS,
    pytest.param("flash", marks=pytest.mark.skipif(not FLASH, reason="no flash-attn")),
]


def _flash_model(cache_dir, out_dir, **model):
    """training_config_model for flash_attention_2 (varlen from position_ids), which conftest does not list."""
    from lorakit.model import build_model
    from lorakit.recipe import recipe_from_dict

    raw = tiny_recipe_dict(
        cache_dir,
        out_dir,
        model={"attention": "flash_attention_2", "gradient_checkpointing": True, **model},
        method={"dropout": 0.0},
        data={"packing": True},
    )
    built = build_model(recipe_from_dict(raw))
    assert built.attention == "flash_attention_2"
    return ready_for_contract(built)


def _bf16_model(cache_dir, tmp_path, backend: str, **model):
    """The model in bf16 on the GPU, as training builds it, and its float32 twin (same weights, upcast)."""
    model = {"dtype": "bfloat16", **model}
    if backend == "flash":
        built = _flash_model(cache_dir, tmp_path / "run", **model)
    else:
        built = training_config_model(cache_dir, tmp_path / "run", backend, **model)
    built.model.to(DEVICE)
    reference = copy.deepcopy(built.model).float()
    return built, (reference, ModelInputs(built.inputs.config, built.attention, torch.float32))


def _rel(values, refs) -> float:
    """Relative Frobenius error of a list of tensors against a list of references."""
    num = sum(float(((v.double() - r.double()) ** 2).sum()) for v, r in zip(values, refs, strict=True))
    return math.sqrt(num / sum(float((r.double() ** 2).sum()) for r in refs))


def _causal_alone(model, inputs, rows):
    out = []
    for r in rows:
        batch = CausalCollator(0)([r])
        logits = inputs.logits(model, batch, DEVICE)
        out.append((logits[0].float().detach(), float(token_loss_sum(logits, batch["labels"].to(DEVICE)))))
    return out


def _slices(logits, labels, lengths):
    out, start = [], 0
    for n in lengths:
        seg = logits[:, start : start + n]
        out.append((seg[0].float().detach(), float(token_loss_sum(seg, labels[:, start : start + n]))))
        start += n
    return out


def _causal_packed(model, inputs, rows, leaky: bool = False):
    batch = PackedCausalCollator(max_tokens=sum(len(r["input_ids"]) for r in rows))(rows)
    labels = batch["labels"].to(DEVICE)
    if leaky:  # one long causal sequence: positions do not restart, so nothing isolates the examples
        batch = {"input_ids": batch["input_ids"]}
    logits = inputs.logits(model, batch, DEVICE)
    return _slices(logits, labels, [len(r["input_ids"]) for r in rows])


def _errors(alone, packed, reference):
    """(e_alone, e_packed) of the logits, and the worst relative loss-sum difference packed vs reference."""
    for logits, loss in alone + packed:
        assert torch.isfinite(logits).all() and math.isfinite(loss)
    e_alone = _rel([a for a, _ in alone], [r for r, _ in reference])
    e_packed = _rel([p for p, _ in packed], [r for r, _ in reference])
    loss = max(abs(p - r) / max(abs(r), 1.0) for (_, p), (_, r) in zip(packed, reference, strict=True))
    return e_alone, e_packed, loss


def _assert_contract(alone, packed, reference):
    e_alone, e_packed, loss = _errors(alone, packed, reference)
    bound = min(SANITY_TOL, BF16_FACTOR * e_alone + BF16_ROUNDOFF)
    detail = f"e_packed {e_packed:.2e}, e_alone {e_alone:.2e}, bound {bound:.2e}, loss {loss:.2e}"
    assert e_packed <= bound, detail
    assert loss <= LOSS_TOL, detail
    return e_alone, e_packed


def _check_causal(built, reference, rows):
    alone = _causal_alone(built.model, built.inputs, rows)
    packed = _causal_packed(built.model, built.inputs, rows)
    return _assert_contract(alone, packed, _causal_alone(*reference, rows))


# Real head sizes (16 query and 4 KV heads of 64) and rows longer than the tiny models allow.
WIDE_LLAMA = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
}


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> str:
    """A random Llama of hidden 1024 (16 query, 4 KV heads of 64) with lorakit's tiny tokenizer."""
    from lorakit.testing import build_tiny_model

    path = tmp_path_factory.mktemp("wide-llama")
    build_tiny_model("llama", path, **WIDE_LLAMA)
    return str(path)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_packed_equals_alone_bf16(cache_dir, tmp_path, kind, backend):
    built, reference = _bf16_model(cache_dir, tmp_path, backend, name_or_path=f"tiny:{kind}")
    _check_causal(built, reference, causal_rows(built.model.config.vocab_size))


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_rows_on_a_wider_llama_bf16(cache_dir, tmp_path, wide_llama, backend):
    built, reference = _bf16_model(cache_dir, tmp_path, backend, name_or_path=wide_llama)
    gen = torch.Generator().manual_seed(3)
    rows = []
    for n in LONG_LENGTHS:
        ids = torch.randint(4, built.model.config.vocab_size, (n,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * (n // 2) + ids[n // 2 :]})
    _check_causal(built, reference, rows)


def test_bf16_contract_detects_leaks(cache_dir, tmp_path):
    """Negative control: a row packed without isolation misses the bf16 bounds by a wide margin."""
    built, reference = _bf16_model(cache_dir, tmp_path, "sdpa_mask", name_or_path="tiny:llama")
    rows = causal_rows(built.model.config.vocab_size)
    alone = _causal_alone(built.model, built.inputs, rows)
    ref = _causal_alone(*reference, rows)
    leaky = _causal_packed(built.model, built.inputs, rows, leaky=True)
    # The first example has nothing before it; every later one sees the examples before it.
    e_alone, e_leak, _ = _errors(alone[1:], leaky[1:], ref[1:])
    assert e_leak > LEAK_MARGIN * (BF16_FACTOR * e_alone + BF16_ROUNDOFF), (e_leak, e_alone)


def _seq2seq_alone(model, inputs, rows, start_id):
    out = []
    for r in rows:
        batch = Seq2SeqCollator(0, start_id)([r])
        logits = inputs.logits(model, batch, DEVICE)
        out.append((logits[0].float().detach(), float(token_loss_sum(logits, batch["labels"].to(DEVICE)))))
    return out


def _seq2seq_packed(model, inputs, rows, start_id, leaky: bool = False):
    batch = PackedSeq2SeqCollator(512, 128, start_id)(rows)
    if leaky:  # every source token in one segment: decoder tokens see every example's source
        batch = dict(batch, source_segments=torch.ones_like(batch["source_segments"]))
    logits = inputs.logits(model, batch, DEVICE)
    return _slices(logits, batch["labels"].to(DEVICE), [len(r["labels"]) for r in rows])


@pytest.mark.parametrize("backend", list(PACKING_BACKENDS))
def test_packed_pairs_equal_pairs_alone_bf16(cache_dir, tmp_path, backend):
    built, reference = _bf16_model(cache_dir, tmp_path, backend)
    start_id = built.model.config.decoder_start_token_id
    rows = seq2seq_rows()
    alone = _seq2seq_alone(built.model, built.inputs, rows, start_id)
    packed = _seq2seq_packed(built.model, built.inputs, rows, start_id)
    _assert_contract(alone, packed, _seq2seq_alone(*reference, rows, start_id))


def test_seq2seq_bf16_contract_detects_leaks(cache_dir, tmp_path):
    built, reference = _bf16_model(cache_dir, tmp_path, "sdpa_mask")
    start_id = built.model.config.decoder_start_token_id
    rows = seq2seq_rows()
    alone = _seq2seq_alone(built.model, built.inputs, rows, start_id)
    leaky = _seq2seq_packed(built.model, built.inputs, rows, start_id, leaky=True)
    e_alone, e_leak, _ = _errors(alone, leaky, _seq2seq_alone(*reference, rows, start_id))
    assert e_leak > LEAK_MARGIN * (BF16_FACTOR * e_alone + BF16_ROUNDOFF), (e_leak, e_alone)


def _loss_and_grads(model, inputs, batch):
    model.zero_grad()
    logits = inputs.logits(model, batch, DEVICE)
    loss = token_loss_sum(logits, batch["labels"].to(DEVICE)) / batch["num_target_tokens"]
    loss.backward()
    names = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    grads = dict(model.named_parameters())
    return float(loss), [grads[n].grad.float().clone() for n in names]


@pytest.mark.parametrize(("kind", "backend"), [("llama", "varlen_sdpa"), ("qwen2", "sdpa_mask")])
def test_packed_step_loss_and_grads_bf16(cache_dir, tmp_path, kind, backend):
    """The token-weighted loss and LoRA gradients of a packed batch match the padded batch's, within bf16."""
    built, (ref_model, ref_inputs) = _bf16_model(cache_dir, tmp_path, backend, name_or_path=f"tiny:{kind}")
    rows = causal_rows(built.model.config.vocab_size, seed=2)
    padded, packed = CausalCollator(0)(rows), PackedCausalCollator(max_tokens=512)(rows)
    assert padded["num_target_tokens"] == packed["num_target_tokens"] == sum(n - n // 2 for n in LENGTHS)
    _check_step(built, (ref_model, ref_inputs), padded, packed)


def _check_step(built, reference, padded, packed):
    """The packed batch's loss and LoRA gradients against the float32 reference's, within bf16 rounding."""
    ref_loss, ref_grads = _loss_and_grads(*reference, padded)
    padded_loss, padded_grads = _loss_and_grads(built.model, built.inputs, padded)
    packed_loss, packed_grads = _loss_and_grads(built.model, built.inputs, packed)
    assert abs(packed_loss - ref_loss) <= LOSS_TOL * abs(ref_loss)
    e_padded, e_packed = _rel(padded_grads, ref_grads), _rel(packed_grads, ref_grads)
    # Gradients go through twice the rounding (forward and backward): bounded relative to bf16's own error.
    assert e_packed <= BF16_FACTOR * e_padded + BF16_ROUNDOFF, (e_packed, e_padded)


def test_fused_kernels_run_on_cuda(cache_dir, tmp_path):
    """On CUDA in bf16 the packed paths run PyTorch's fused kernels (lorakit.model.fused_attention): varlen
    for causal rows and T5 cross-attention, compiled FlexAttention for T5 self-attention (model.attention_dropout
    defaults to 0, with tiny:t5's dropout_rate 0.1 left for hidden states), never the per-example SDPA loop;
    and they keep the contract."""
    from lorakit.model import fused_attention as fa

    built, reference = _bf16_model(cache_dir, tmp_path, "varlen_sdpa", name_or_path="tiny:llama")
    _check_causal(built, reference, causal_rows(built.model.config.vocab_size))
    assert (
        built.inputs.kernels.calls["causal", fa.VARLEN] > 0
        and built.inputs.kernels.calls["causal", fa.LOOP] == 0
    )
    built, reference = _bf16_model(cache_dir, tmp_path / "t5", "varlen_sdpa")
    start_id = built.model.config.decoder_start_token_id
    rows = seq2seq_rows()
    packed = _seq2seq_packed(built.model, built.inputs, rows, start_id)
    alone = _seq2seq_alone(built.model, built.inputs, rows, start_id)
    _assert_contract(alone, packed, _seq2seq_alone(*reference, rows, start_id))
    for kind, kernel in (("encoder", fa.FLEX), ("decoder", fa.FLEX), ("cross", fa.VARLEN)):
        assert (
            built.inputs.kernels.calls[kind, kernel] > 0 and built.inputs.kernels.calls[kind, fa.LOOP] == 0
        ), built.inputs.kernels.calls


def _full_finetuning_t5(cache_dir, out_dir):
    """tiny:t5 built for full fine-tuning (every weight trains, T5's relative_attention_bias included) in bf16
    on the GPU, as training builds it, and its float32 twin."""
    from lorakit.model import build_model
    from lorakit.recipe import recipe_from_dict

    raw = tiny_recipe_dict(
        cache_dir,
        out_dir,
        model={"attention": "sdpa", "gradient_checkpointing": True, "dtype": "bfloat16"},
        method={"kind": "full"},
        data={"packing": True},
    )
    built = ready_for_contract(build_model(recipe_from_dict(raw)))
    assert built.attention == "lorakit_varlen_sdpa"
    built.model.to(DEVICE)
    reference = copy.deepcopy(built.model).float()
    return built, (reference, ModelInputs(built.inputs.config, built.attention, torch.float32))


def test_packed_seq2seq_step_grads_bf16_through_fused_kernels(cache_dir, tmp_path):
    """T5's packed step with full fine-tuning: FlexAttention's backward reaches the position-bias table and
    through it T5's relative_attention_bias weights; varlen runs the cross-attention. Loss and every
    gradient (the bias weights' included) match the padded step's within bf16 rounding."""
    from lorakit.model import fused_attention as fa

    built, reference = _full_finetuning_t5(cache_dir, tmp_path / "run")
    bias_weights = [n for n, p in built.model.named_parameters() if "relative_attention_bias" in n]
    assert len(bias_weights) == 2 and all(built.model.get_parameter(n).requires_grad for n in bias_weights)
    start_id = built.model.config.decoder_start_token_id
    rows = seq2seq_rows(seed=1)
    padded = Seq2SeqCollator(0, start_id)(rows)
    packed = PackedSeq2SeqCollator(512, 128, start_id)(rows)
    _check_step(built, reference, padded, packed)
    for kind, kernel in (("encoder", fa.FLEX), ("decoder", fa.FLEX), ("cross", fa.VARLEN)):
        assert (
            built.inputs.kernels.calls[kind, kernel] > 0 and built.inputs.kernels.calls[kind, fa.LOOP] == 0
        ), built.inputs.kernels.calls
    # The bias weights' own gradients, packed against the float32 reference's padded ones.
    _, ref_grads = _named_grads(*reference, padded)
    _, packed_grads = _named_grads(built.model, built.inputs, packed)
    _, padded_grads = _named_grads(built.model, built.inputs, padded)
    for name in bias_weights:
        assert packed_grads[name].abs().max() > 0, name
        e_packed = _rel([packed_grads[name]], [ref_grads[name]])
        e_padded = _rel([padded_grads[name]], [ref_grads[name]])
        assert e_packed <= BF16_FACTOR * e_padded + BF16_ROUNDOFF, (name, e_packed, e_padded)


def _named_grads(model, inputs, batch):
    loss, grads = _loss_and_grads(model, inputs, batch)
    names = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return loss, dict(zip(names, grads, strict=True))


def test_flex_attention_compiles_once_for_rows_of_any_length(cache_dir, tmp_path):
    """Compiled FlexAttention takes automatic dynamic shapes and a bias table of fixed size: the first row
    compiles static, the first row of a new length recompiles with the length symbolic, and later rows of
    new lengths reuse that kernel."""
    from torch._dynamo.utils import counters

    from lorakit.model import fused_attention as fa

    built, _ = _bf16_model(cache_dir, tmp_path, "varlen_sdpa")
    built.model.eval()
    start_id = built.model.config.decoder_start_token_id
    rows = seq2seq_rows(seed=4) + seq2seq_rows(seed=5)
    graphs = []
    with torch.no_grad():
        for n in range(len(rows), len(rows) - 4, -1):  # four rows of different lengths
            batch = PackedSeq2SeqCollator(4096, 1024, start_id)(rows[:n])
            built.inputs.logits(built.model, batch, DEVICE)
            graphs.append(counters["stats"]["unique_graphs"])
    assert (
        built.inputs.kernels.calls["encoder", fa.FLEX] > 0
        and built.inputs.kernels.calls["encoder", fa.LOOP] == 0
    )
    assert graphs[1] == graphs[2] == graphs[3], graphs
