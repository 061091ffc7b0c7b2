"""Sequence parallelism 2 against 1 on a fixed packed row, for each tiny causal kind given:

    python -m torch.distributed.run --nproc_per_node=2 -m tests.integration.sequence_parallel_worker \
        CACHE_DIR OUT_JSON llama qwen2 llama-full

Each rank builds the same LoRA model twice (same seed, so the same adapter init): once as a plain packed
model (sequence_parallel 1, the whole row on every rank) and once with sequence_parallel 2 (gradient
checkpointing on), which sees only its half of the row. The split model's loss summed over the two ranks and
its gradients (LoRA's, or every weight's for `llama-full`) summed over the two ranks must equal the whole
row's. Then isolation: changing one
example of the row leaves the other examples' logits (gathered from both ranks) unchanged. Rank 0 writes
what it measured to OUT_JSON; the test asserts on it.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

# Examples of a packed row: the total is odd (one filler token pads it to a multiple of 2) and the second
# example straddles the split.
LENGTHS = (23, 17, 31)


def _rows(seed: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in LENGTHS:
        ids = torch.randint(5, vocab, (n,), generator=g).tolist()
        # A prompt part without loss, as the templates make.
        labels = [-100] * 4 + ids[4:]
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _recipe(kind: str, cache_dir: str, sp: int, method: str = "lora"):
    from lorakit.recipe import recipe_from_dict

    return recipe_from_dict(
        {
            "model": {
                "name_or_path": f"tiny:{kind}",
                "dtype": "float32",
                "attention": "sdpa",
                "gradient_checkpointing": sp > 1,
            },
            "method": {"kind": method, "r": 4, "alpha": 8, "dropout": 0.0},
            "data": {"source": "builtin:news_summaries", "format": "instruction", "cache_dir": cache_dir},
            "distributed": {"num_processes": 2, "zero_stage": 0, "sequence_parallel": sp},
            "output": {"dir": f"{cache_dir}/unused"},
        }
    )


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _whole_logits(built, batch, mesh) -> torch.Tensor:
    from lorakit.data.sequence_split import split_row

    shard = split_row(batch, mesh.sp_rank, mesh.sp_world)
    with torch.no_grad():
        local = built.inputs.logits(built.model, shard, "cpu")[0]
    parts = [torch.empty_like(local) for _ in range(mesh.sp_world)]
    dist.all_gather(parts, local.contiguous(), group=mesh.sp_group)
    return torch.cat(parts)[: batch["input_ids"].shape[1]]


def check(name: str, cache_dir: str, mesh) -> dict:
    """Loss, gradient and isolation differences between sequence_parallel 2 and 1 for one tiny kind
    (`llama`, `qwen2`: LoRA; `llama-full`: full fine-tuning)."""
    kind, _, method = name.partition("-")
    method = method or "lora"
    from lorakit.data.collate import PackedCausalCollator
    from lorakit.data.sequence_split import split_row
    from lorakit.engine.loss import token_loss_sum
    from lorakit.model import build_model

    whole = build_model(_recipe(kind, cache_dir, 1, method))
    split = build_model(_recipe(kind, cache_dir, 2, method), sp_group=mesh.sp_group)
    for b in (whole, split):
        b.model.train()
    vocab = whole.model.config.vocab_size
    collate = PackedCausalCollator(128)
    batch = collate(_rows(0, vocab))

    ref = token_loss_sum(whole.inputs.logits(whole.model, batch, "cpu"), batch["labels"])
    ref.backward()
    shard = split_row(batch, mesh.sp_rank, mesh.sp_world)
    loss = token_loss_sum(split.inputs.logits(split.model, shard, "cpu"), shard["labels"])
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.sp_group)
    tokens = torch.tensor(float(shard["num_target_tokens"]))
    dist.all_reduce(tokens, group=mesh.sp_group)

    want, got = _lora_grads(whole.model), _lora_grads(split.model)
    worst = 0.0
    for name, g in got.items():
        dist.all_reduce(g, group=mesh.sp_group)
        scale = want[name].abs().max().item() + 1e-12
        worst = max(worst, (g - want[name]).abs().max().item() / scale)

    # Isolation: change one example, the others' logits stay as they were.
    split.model.eval()
    before = _whole_logits(split, batch, mesh)
    bounds = [0]
    for n in LENGTHS:
        bounds.append(bounds[-1] + n)
    isolation = {}
    for changed in range(len(LENGTHS)):
        rows = _rows(0, vocab)
        rows[changed] = _rows(100 + changed, vocab)[changed]
        after = _whole_logits(split, collate(rows), mesh)
        others = [i for i in range(len(LENGTHS)) if i != changed]
        isolation[changed] = {
            "others": max(
                (after[bounds[i] : bounds[i + 1]] - before[bounds[i] : bounds[i + 1]]).abs().max().item()
                for i in others
            ),
            "itself": (
                after[bounds[changed] : bounds[changed + 1]] - before[bounds[changed] : bounds[changed + 1]]
            )
            .abs()
            .max()
            .item(),
        }
    return {
        "loss_whole": ref.item(),
        "loss_split": total.item(),
        "target_tokens_whole": batch["num_target_tokens"],
        "target_tokens_split": tokens.item(),
        "grad_rel_diff": worst,
        "grad_count": len(got),
        "grad_norm": sum(g.norm().item() for g in want.values()),
        "isolation": isolation,
    }


def main(cache_dir: str, out: str, kinds: list[str]) -> None:
    from lorakit.engine.mesh import ParallelDims

    dist.init_process_group("gloo")
    try:
        if dist.get_rank() == 0:
            # One process builds the tiny models: transformers' save_pretrained writes the weights on
            # rank 0 only once torch.distributed is up, so a build on rank 1 would lack them.
            from lorakit.testing import resolve_model_source

            for kind in {k.partition("-")[0] for k in kinds}:
                resolve_model_source(f"tiny:{kind}", cache_dir)
        dist.barrier()
        mesh = ParallelDims.build(2)
        results = {kind: check(kind, cache_dir, mesh) for kind in kinds}
        if mesh.rank == 0:
            with open(out, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
