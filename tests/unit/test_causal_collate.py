import pytest
import torch

from lorakit.data.collate import IGNORE_INDEX, CausalCollator, PackedCausalCollator, left_pad_prompts
from lorakit.meter import TokenMeter
from lorakit.model.inputs import ModelInputs, example_ids, packed_attention_mask

ROWS = [
    {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
    {"input_ids": [9, 10, 11], "labels": [9, 10, 11]},
]


def test_padded_causal_shifts_labels_per_example():
    b = CausalCollator(pad_token_id=0)(ROWS)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 11, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    # Position t predicts token t+1; the last token of each example predicts nothing.
    assert b["labels"].tolist() == [[-100, 7, 8, -100], [10, 11, -100, -100]]
    assert b["num_target_tokens"] == 4 and b["num_real_tokens"] == 7 and b["num_token_slots"] == 8
    assert b["num_examples"] == 2


def test_packed_row_restarts_positions_and_never_predicts_across_examples():
    b = PackedCausalCollator(max_tokens=10)(ROWS)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    # Position 3 (last of example 1) must not be trained to predict 9 (first of example 2).
    assert b["labels"].tolist() == [[-100, 7, 8, IGNORE_INDEX, 10, 11, IGNORE_INDEX]]
    assert "attention_mask" not in b
    assert b["num_target_tokens"] == 4 and b["num_real_tokens"] == 7 and b["num_token_slots"] == 10
    meter = TokenMeter()
    meter.add(b)
    assert meter.samples == 2 and meter.efficiency() == pytest.approx(0.7)
    with pytest.raises(ValueError, match="exceeds max_tokens=6"):
        PackedCausalCollator(max_tokens=6)(ROWS)


def test_packed_mask_is_block_diagonal_causal_with_window():
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    assert example_ids(pos).tolist() == [[1, 1, 1, 1, 2, 2, 2]]
    m = packed_attention_mask(pos, attention="sdpa", dtype=torch.float32)
    assert m.shape == (1, 1, 7, 7) and m.dtype == torch.bool
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for s, e in ((0, 4), (4, 7)):
        expected[s:e, s:e] = torch.tril(torch.ones(e - s, e - s, dtype=torch.bool))
    assert torch.equal(m[0, 0], expected)
    w = packed_attention_mask(pos, attention="sdpa", dtype=torch.float32, sliding_window=2)
    assert w[0, 0, 3].tolist() == [False, False, True, True, False, False, False]
    e = packed_attention_mask(pos, attention="eager", dtype=torch.bfloat16)
    assert (
        e.dtype == torch.bfloat16 and e[0, 0, 4, 3] == torch.finfo(torch.bfloat16).min and e[0, 0, 4, 4] == 0
    )


def test_model_inputs_per_backend():
    from transformers import LlamaConfig, Qwen2Config

    b = PackedCausalCollator(max_tokens=10)(ROWS)
    varlen = ModelInputs(LlamaConfig(), "lorakit_varlen_sdpa", torch.float32)(b, "cpu")
    assert varlen["lorakit_segments"] == (0, 4, 7) and varlen["attention_mask"].tolist() == [[1] * 7]
    flash = ModelInputs(LlamaConfig(), "flash_attention_2", torch.bfloat16)(b, "cpu")
    assert "attention_mask" not in flash and flash["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    sdpa = ModelInputs(LlamaConfig(), "sdpa", torch.float32)(b, "cpu")
    assert sdpa["attention_mask"].shape == (1, 1, 7, 7)
    # Models with per-layer attention types take one mask per type.
    qwen = ModelInputs(Qwen2Config(), "sdpa", torch.float32)(b, "cpu")
    assert set(qwen["attention_mask"]) == {"full_attention"}
    padded = ModelInputs(LlamaConfig(), "lorakit_varlen_sdpa", torch.float32)(CausalCollator(0)(ROWS), "cpu")
    assert "lorakit_segments" not in padded and padded["attention_mask"].shape == (2, 4)


def test_left_pad_prompts():
    out = left_pad_prompts([[5, 6, 7], [8]], pad_token_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
