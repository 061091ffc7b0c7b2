"""The planner's FSDP2 byte model (lorakit/planner/fsdp.py) at FLAN-T5-XL's shape, checked against parameter
counts worked out by hand from T5 v1.1 XL's config (d_model 2048, d_ff 5120, 32 heads of 64, vocabulary
32128, untied head, 24 + 24 blocks), not from the planner's own census. The measured side is
benchmarks/rehearsal.py's FSDP2 runs (benchmarks/results/rehearsal_flan-t5-xl*_fsdp.json)."""

import pytest

from lorakit.planner import plan
from lorakit.planner.arch import arch_from_config, known_config
from lorakit.recipe import load_recipe
from tests.conftest import RECIPES

D, FF, V = 2048, 5120, 32128
ATTENTION = 4 * D * D
ENCODER_BLOCK = ATTENTION + 3 * D * FF + 2 * D  # self-attention, gated-GELU feedforward, two norms
DECODER_BLOCK = 2 * ATTENTION + 3 * D * FF + 3 * D  # + cross-attention and its norm
ROOT = 2 * V * D + 2 * D  # shared embedding, head, the two stacks' final norms
BIAS = 32 * 32  # relative_attention_bias: first block of each stack
FSDP = ["distributed.strategy=fsdp", "distributed.zero_stage=3", "distributed.num_processes=2"]


def items(*overrides: str) -> dict:
    p = plan(load_recipe(RECIPES / "flan_t5_xl_lora.yaml", [*FSDP, *overrides]), device="cpu")
    return {i.name: i for i in p.estimate.items}, p


def test_the_census_matches_the_hand_count():
    arch = arch_from_config(known_config("google/flan-t5-xl"))
    assert arch.total_params == ROOT + 24 * (ENCODER_BLOCK + DECODER_BLOCK) + 2 * BIAS
    assert len(arch.blocks) == 48 and arch.blocks[0] == "encoder.block.0"
    assert arch.stored_dtype_bytes == 4  # no dtype in the config: transformers' float32


def test_lora_on_fsdp2_gathers_the_root_whole_and_two_blocks_not_zero3s_layer():
    f, p = items()
    assert "ZeRO-3 gathered weights" not in f and "ZeRO-3 reduce bucket" not in f
    # FSDP2 shards every parameter (no persistence threshold): exactly half the bf16 base per rank.
    assert f["frozen base weights"].bytes == (ROOT + 24 * (ENCODER_BLOCK + DECODER_BLOCK) + 2 * BIAS)
    # The root is never resharded after forward: embeddings and head whole in bf16 through the step.
    assert f["FSDP2 root unit, gathered"].bytes == 2 * ROOT
    assert f["FSDP2 root unit, gathered"].when == "forward"
    # In the backward two blocks at once: the one computing and the one before it, prefetched (two decoder
    # blocks, the first with its relative_attention_bias, LoRA r 16 on every linear, in bf16), + the largest
    # unit's fp32 LoRA shard (half of it per rank) cast to bf16 for the all-gather.
    lora = 16 * (4 * (D + D) + 2 * (D + FF) + (FF + D))  # encoder block: attention, wi_0, wi_1, wo
    decoder_lora = lora + 16 * 4 * (D + D)  # + cross-attention
    blocks = f["FSDP2 gathered blocks"]
    assert blocks.bytes == 2 * 2 * (DECODER_BLOCK + BIAS + decoder_lora) + 2 * decoder_lora // 2
    assert blocks.when == "backward"
    # At the forward's start the root's all-gather output is kept until the first block's copy-out.
    first = f["FSDP2 root's all-gather output, first block"]
    assert first.bytes == 2 * (ROOT + ENCODER_BLOCK + BIAS + lora) + 2 * decoder_lora // 2
    assert first.when == "start"
    # That moment counts among the step's (here the recipe's 4096-token rows' activations outweigh it).
    at_start = sum(
        i.bytes for i in f.values() if i.where == "gpu" and i.when in ("resident", "forward", "start")
    )
    assert p.estimate.gpu_allocated >= at_start
    # The plan moved up by what FSDP2 gathers beyond ZeRO-3's limits: a few tenths of a GiB here (with the
    # eval predictions generated layer by layer on both: gathered, the whole model is both plans' peak).
    off = "distributed.gather_for_generation=false"
    _, layered = items(off)
    zero3 = plan(load_recipe(RECIPES / "flan_t5_xl_lora.yaml", [*FSDP[1:], off]), device="cpu").estimate
    assert 0.2 * 2**30 < layered.estimate.gpu_allocated - zero3.gpu_allocated < 0.6 * 2**30


def test_full_fine_tuning_keeps_fp32_masters_as_the_parameters_and_fp32_gradients():
    f, _ = items("method.kind=full")
    n = ROOT + 24 * (ENCODER_BLOCK + DECODER_BLOCK) + 2 * BIAS
    assert f["trainable weights"].bytes == 4 * n // 2  # no bf16 copy beside the fp32 masters
    assert "fp32 master weights" not in f and "fp32 gradients" not in f
    assert f["gradients"].bytes == 4 * n // 2 and f["gradients"].when == "gradients"
    assert f["Adam states (fp32)"].bytes == 8 * n // 2
    # The root's gradients (head and embeddings, bf16) and a block's bf16 gradients with their fp32
    # reduce-scatter input.
    reduce = f["FSDP2 unsharded gradients, reduce-scatter input (fp32)"]
    assert reduce.bytes == max(2 * ROOT + 6 * (DECODER_BLOCK + BIAS), 6 * ROOT) and reduce.kind == "buffer"
    # Sharded loading of an fp32 checkpoint: a rank's half of the embedding read in fp32, cast to bf16 and
    # to the fp32 master.
    assert f["one tensor's rows per rank while loading"].bytes == V * D // 2 * (4 + 2 + 4)


@pytest.mark.parametrize("steps,extra", [(1, 0), (4, 1)])
def test_accumulation_holds_every_unsharded_gradient_in_fp32_on_fsdp2_only(steps, extra):
    f, _ = items("method.kind=full", f"train.gradient_accumulation_steps={steps}")
    n = ROOT + 24 * (ENCODER_BLOCK + DECODER_BLOCK) + 2 * BIAS
    window = [i for name, i in f.items() if "accumulation window" in name]
    assert [i.bytes for i in window] == [4 * n] * extra  # whole on every rank: no reduce until the boundary
    zero3 = plan(load_recipe(RECIPES / "flan_t5_xl_lora.yaml", [*FSDP[1:], "method.kind=full",
                                                                   f"train.gradient_accumulation_steps={steps}"]))  # fmt: skip
    assert not any("accumulation window" in i.name for i in zero3.estimate.items)


def test_the_fsdp2_plan_prints_its_start_item():
    # lorakit.plan with distributed.strategy=fsdp raised KeyError 'start' in planner/report.py: the table
    # had no words for the items FSDP2 keeps at the forward's start (the root's all-gather output).
    f, p = items()
    starts = [i for i in p.estimate.items if i.when == "start" and i.bytes]
    assert starts, "no FSDP2 start item to describe"
    text = p.describe()
    assert any(i.name in text and "at the forward's start" in text for i in starts)
