"""T5Gemma: its shapes for the planner (no `d_model`), and packed rows exact in the encoder, the decoder
and across (rotary positions restarting per example, the sliding window inside each example)."""

from __future__ import annotations

import pytest
import torch

from lorakit.data.collate import PackedSeq2SeqCollator
from lorakit.model.families import family_named, family_of
from lorakit.model.families.start import decoder_start_token_id
from lorakit.model.inputs import ModelInputs, _as_mask
from lorakit.model.stacked_masks import segment_positions, stacked_packed_kwargs
from lorakit.testing import SPECIAL_TOKENS, TINY_VOCAB_SIZE, tiny_config
from tests.conftest import tiny_recipe


def _tiny():
    family = family_named("t5gemma")
    config = family.tiny.config(TINY_VOCAB_SIZE, bos=SPECIAL_TOKENS.index("<s>"))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return family.tiny.model(config).eval()


def _rows():
    g = torch.Generator().manual_seed(1)
    # Sources longer than the tiny window (8): the sliding layers' window matters inside each example.
    return [
        {"input_ids": torch.randint(4, 1000, (n,), generator=g).tolist(),
         "labels": torch.randint(4, 1000, (m,), generator=g).tolist()}
        for n, m in ((13, 11), (9, 6), (17, 4))
    ]  # fmt: skip


def test_positions_restart_per_example():
    segments = torch.tensor([[1, 1, 1, 2, 2, 3]])
    assert segment_positions(segments).tolist() == [[0, 1, 2, 0, 1, 0]]


def test_packed_equals_alone_in_encoder_decoder_and_cross_attention():
    model = _tiny()
    collate = PackedSeq2SeqCollator(None, None, decoder_start_token_id(model.config))
    inputs = ModelInputs(model.config, "eager", torch.float32)
    rows = _rows()
    batch = collate(rows)
    with torch.no_grad():
        packed = inputs.logits(model, batch, "cpu")
        alone = torch.cat([model(input_ids=torch.tensor([r["input_ids"]]),
                                 decoder_input_ids=collate([r])["decoder_input_ids"]).logits for r in rows], 1)  # fmt: skip
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)

    # Each of the three attentions is checked: letting any one of them see across examples changes the
    # logits. (Positions restart per example, though rotary attention depends on distances only: they stay
    # within the example's own range.)
    def eager(m):
        return _as_mask(m, "eager", torch.float32)

    base = stacked_packed_kwargs(model.config, batch["source_segments"], batch["target_segments"], eager)
    one = torch.ones_like(batch["source_segments"])
    leaky = stacked_packed_kwargs(model.config, one, torch.ones_like(batch["target_segments"]), eager)
    for kind in ("attention_mask", "decoder_attention_mask", "cross"):
        kw = {**base, kind: leaky[kind]}
        with torch.no_grad():
            enc = model.get_encoder()(input_ids=batch["input_ids"], attention_mask=kw["attention_mask"],
                                      position_ids=kw["position_ids"])  # fmt: skip
            got = model(encoder_outputs=enc, attention_mask=kw["cross"],
                        decoder_input_ids=batch["decoder_input_ids"],
                        decoder_attention_mask=kw["decoder_attention_mask"],
                        decoder_position_ids=kw["decoder_position_ids"]).logits  # fmt: skip
        assert (got - alone).abs().max() > 1e-3, kind


def test_the_plan_reads_t5gemma_and_packs_it_on_eager_only(tmp_path):
    from lorakit.model.attention import packing_enabled
    from lorakit.planner import plan
    from lorakit.planner.arch import arch_from_config

    config = tiny_config("t5gemma")
    assert family_of(config).name == "t5gemma"
    arch = arch_from_config(config)
    assert (arch.hidden, arch.layers, arch.decoder_layers, arch.kv_heads, arch.head_dim) == (64, 2, 2, 2, 16)
    assert packing_enabled("auto", "eager", True, "t5gemma")
    assert not packing_enabled("auto", "sdpa", True, "t5gemma")
    recipe = tiny_recipe(
        tmp_path, tmp_path / "run", model={"name_or_path": "tiny:t5gemma", "attention": "eager"}
    )
    result = plan(recipe, gpus=1, gpu_memory="16GB", device="cpu")
    assert result.trainable_params > 0 and result.fits


@pytest.mark.parametrize("attention", ["eager"])
def test_a_packed_t5gemma_step_trains(tmp_path, attention):
    from lorakit.model import build_model
    from lorakit.model.loss import token_loss_sum

    built = build_model(tiny_recipe(tmp_path, tmp_path / "run",
                                    model={"name_or_path": "tiny:t5gemma", "attention": attention}))  # fmt: skip
    assert built.packing and built.is_encoder_decoder
    model = built.model.train()
    batch = PackedSeq2SeqCollator(None, None, 0)(_rows())
    trainable = [p for p in model.parameters() if p.requires_grad]
    loss = token_loss_sum(built.inputs.logits(model, batch, "cpu"), batch["labels"])
    loss.backward()
    assert all(p.grad is not None for p in trainable) and torch.isfinite(loss)
