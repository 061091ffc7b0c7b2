"""Sequence parallelism's pieces that need no process group: row splitting, the checks on N, the grid."""

from __future__ import annotations

import pytest
import torch

from lorakit.data.collate import IGNORE_INDEX, PackedCausalCollator
from lorakit.data.sequence_split import EXAMPLE_INDEX, SEGMENTS, row_bounds, split_eval_rows, split_row
from lorakit.engine.mesh import ParallelDims, check_world
from lorakit.errors import RecipeError
from lorakit.model.sequence_parallel import check_sequence_parallel
from lorakit.testing import tiny_config
from tests.conftest import tiny_recipe_dict


def _batch(lengths=(5, 3, 6)):
    rows = [{"input_ids": list(range(10 + i, 10 + i + n)), "labels": list(range(10 + i, 10 + i + n))}
            for i, n in enumerate(lengths)]  # fmt: skip
    return PackedCausalCollator(16)(rows)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_put_back_together_are_the_padded_row_and_share_its_counts(world):
    batch = _batch()
    shards = [split_row(batch, r, world) for r in range(world)]
    length = batch["input_ids"].shape[1]
    ids = torch.cat([s["input_ids"][0] for s in shards])
    assert ids.numel() % world == 0 and torch.equal(ids[:length], batch["input_ids"][0])
    positions = torch.cat([s["position_ids"][0] for s in shards])
    labels = torch.cat([s["labels"][0] for s in shards])
    assert torch.equal(positions[:length], batch["position_ids"][0])
    # Filler: its own example from position 0, no loss.
    assert positions[length:].tolist() == list(range(ids.numel() - length))
    assert (labels[length:] == IGNORE_INDEX).all() and torch.equal(labels[:length], batch["labels"][0])
    assert all(s[SEGMENTS] == row_bounds(positions) for s in shards)
    for key in ("num_target_tokens", "num_real_tokens", "num_token_slots", "num_examples"):
        assert sum(s[key] for s in shards) == batch[key], key


@pytest.mark.parametrize("world", [2, 3])
def test_eval_rows_are_packed_then_split_and_say_which_row_each_token_is(world):
    rows = [{"input_ids": [7] * n, "labels": [-100, *([8] * (n - 1))]} for n in (4, 5, 2)]
    shards = [split_eval_rows(rows, r, world) for r in range(world)]
    index = torch.cat([s[EXAMPLE_INDEX][0] for s in shards])
    assert index.tolist()[:11] == [0] * 4 + [1] * 5 + [2] * 2 and set(index.tolist()[11:]) <= {-1}
    whole = PackedCausalCollator(11)(rows)
    assert sum(s["num_target_tokens"] for s in shards) == whole["num_target_tokens"]
    labels = torch.cat([s["labels"][0] for s in shards])[:11]
    assert torch.equal(labels, whole["labels"][0])


def test_row_bounds_are_the_example_starts():
    assert row_bounds(torch.tensor([0, 1, 2, 0, 1, 0])) == (0, 3, 5, 6)


def test_the_grid_splits_ranks_into_consecutive_sequence_groups():
    dims = ParallelDims(world=8, rank=6, sp_world=4)
    assert (dims.sp_rank, dims.dp_rank, dims.dp_world) == (2, 1, 2)
    alone = ParallelDims.build(1)
    assert (alone.world, alone.dp_world, alone.sp_world, alone.sequence_parallel) == (1, 1, 1, False)
    with pytest.raises(RecipeError, match="must divide the number of processes"):
        check_world(2, 3)


def test_n_must_divide_the_heads_and_encoder_decoders_are_refused():
    llama = tiny_config("llama")  # 4 heads, 2 key/value heads
    check_sequence_parallel(2, llama)
    with pytest.raises(
        RecipeError, match=r"sequence_parallel 4: must divide .* key/value heads \(2\).*\[1, 2\]"
    ):
        check_sequence_parallel(4, llama)
    with pytest.raises(RecipeError, match="encoder-decoder"):
        check_sequence_parallel(2, tiny_config("t5"))


def test_the_schema_refuses_what_sequence_parallelism_cannot_split(tmp_path):
    from lorakit.recipe import recipe_from_dict

    def recipe(**sections):
        model = {"name_or_path": "tiny:llama", **sections.pop("model", {})}
        return recipe_from_dict(tiny_recipe_dict(tmp_path, tmp_path / "run", model=model, **sections))

    ok = recipe(distributed={"num_processes": 4, "sequence_parallel": 2})
    assert ok.distributed.sequence_parallel == 2 and recipe().distributed.sequence_parallel == 1
    for sections, message in [
        (
            dict(distributed={"num_processes": 3, "sequence_parallel": 2}),
            "must divide the processes per node",
        ),
        (
            dict(distributed={"num_processes": 2, "sequence_parallel": 2}, data={"packing": False}),
            "packed rows",
        ),
        (
            dict(distributed={"num_processes": 2, "sequence_parallel": 2}, model={"attention": "eager"}),
            "eager",
        ),
        (
            dict(distributed={"num_processes": 2, "sequence_parallel": 2}, train={"objective": "dpo"}),
            "dpo keeps each preference pair",
        ),
    ]:
        with pytest.raises(RecipeError, match=message):
            recipe(**sections)
