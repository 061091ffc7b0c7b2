"""Sequence parallelism 2 against 1 on a fixed packed row, for each tiny causal kind given:

    python -m torch.distributed.run --nproc_per_node=2 -m tests.integration.sequence_parallel_worker \
        CACHE_DIR OUT_JSON llama qwen2 mistral llama-full llama-qlora [--train RECIPE.yaml ...]

Each rank builds the same LoRA model twice (same seed, so the same adapter init): once as a plain packed
model (sequence_parallel 1, the whole row on every rank) and once with sequence_parallel 2 (gradient
checkpointing on, MLPs and the head with its loss in tiles of TILE tokens), which sees only its half of the
row. The split model's
loss and its gradients (LoRA's, or every weight's for `llama-full`), summed over the two ranks, must equal
the whole row's (`llama-qlora`: both on the same 4-bit base). Then isolation: changing one example of the
row leaves the other examples' logits (gathered from both ranks) unchanged. Last, the split LoRA Llama in
a ZeRO-2 engine, the split QLoRA Llama and the split fully fine-tuned Llama (its head trains through the
tiled loss) in ZeRO-3 engines: DeepSpeed's averaged gradients are half the whole row's. Rank 0 writes what it measured to OUT_JSON; the test asserts on it.
With --train, the same launch then trains each recipe given, in order (lorakit.train, as on a worker of
`python -m lorakit.run`).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tests.integration.worker_checks import failure

# Examples of a packed row: the total is odd (one filler token pads it to a multiple of 2) and the second
# example straddles the split. tiny:mistral's second example is longer than its 64-token sliding window.
LENGTHS = {"mistral": (23, 81, 17)}
DEFAULT_LENGTHS = (23, 17, 31)
# The split model's MLP and loss tiles (model.mlp_tile_tokens, loss_tile_tokens): several per shard, the
# last one shorter.
TILE = 8


def _rows(seed: int, vocab: int, lengths: tuple[int, ...]) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(5, vocab, (n,), generator=g).tolist()
        # A prompt part without loss, as the templates make.
        labels = [-100] * 4 + ids[4:]
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _recipe(kind: str, cache_dir: str, sp: int, method: str = "lora", zero_stage: int = 0):
    from lorakit.recipe import recipe_from_dict

    return recipe_from_dict(
        {
            "model": {
                "name_or_path": f"tiny:{kind}",
                "dtype": "float32",
                "attention": "sdpa",
                "gradient_checkpointing": sp > 1,
                # The split model computes its MLPs, head and loss in tiles (model.tiled_mlp and
                # model.tiled_loss auto are on with sp > 1).
                **({"mlp_tile_tokens": TILE, "loss_tile_tokens": TILE} if sp > 1 else {}),
            },
            "method": {"kind": method, "r": 4, "alpha": 8, "dropout": 0.0},
            "data": {"source": "builtin:news_summaries", "format": "instruction", "cache_dir": cache_dir},
            "distributed": {"num_processes": 2, "zero_stage": zero_stage, "sequence_parallel": sp},
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


# The whole row's gradients of each kind checked, for check_zero2.
WHOLE_GRADS: dict[str, dict[str, torch.Tensor]] = {}


def check(name: str, cache_dir: str, mesh) -> dict:
    """Loss, gradient and isolation differences between sequence_parallel 2 and 1 for one tiny kind
    (`llama`, `qwen2`: LoRA; `llama-full`: full fine-tuning)."""
    kind, _, method = name.partition("-")
    method = method or "lora"
    from lorakit.data.collate import PackedCausalCollator
    from lorakit.data.sequence_split import split_row
    from lorakit.model import build_model
    from lorakit.model.loss import token_loss_sum
    from lorakit.model.tiled_loss import TiledLossHead
    from lorakit.objectives.sft import causal_loss_sum

    whole = build_model(_recipe(kind, cache_dir, 1, method))
    split = build_model(_recipe(kind, cache_dir, 2, method), sp_group=mesh.sp_group)
    for b in (whole, split):
        b.model.train()
    vocab = whole.model.config.vocab_size
    lengths = LENGTHS.get(kind, DEFAULT_LENGTHS)
    collate = PackedCausalCollator(128)
    batch = collate(_rows(0, vocab, lengths))
    from lorakit.model.tiled_mlp import TiledMLP

    tiled = sum(isinstance(m, TiledMLP) for m in split.model.modules())
    # The lm_head's input on each rank covers its shard only: no logits of the whole row anywhere (and with
    # the tiled loss, only a tile's).
    head_tokens = []
    hook = split.model.get_output_embeddings().register_forward_hook(
        lambda _m, args, _out: head_tokens.append(args[0].shape[-2])
    )

    ref = token_loss_sum(whole.inputs.logits(whole.model, batch, "cpu"), batch["labels"])
    ref.backward()
    shard = split_row(batch, mesh.sp_rank, mesh.sp_world)
    # The training objective's loss: through the tiled head (model.tiled_loss), no logits.
    loss = causal_loss_sum(split.model, split.inputs, shard, "cpu")
    loss.backward()
    hook.remove()
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.sp_group)
    tokens = torch.tensor(float(shard["num_target_tokens"]))
    dist.all_reduce(tokens, group=mesh.sp_group)

    want, got = _lora_grads(whole.model), _lora_grads(split.model)
    WHOLE_GRADS[name] = want
    worst = 0.0
    for name, g in got.items():
        dist.all_reduce(g, group=mesh.sp_group)
        scale = want[name].abs().max().item() + 1e-12
        worst = max(worst, (g - want[name]).abs().max().item() / scale)

    # Isolation: change one example, the others' logits stay as they were.
    split.model.eval()
    before = _whole_logits(split, batch, mesh)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    isolation = {}
    for changed in range(len(lengths)):
        rows = _rows(0, vocab, lengths)
        rows[changed] = _rows(100 + changed, vocab, lengths)[changed]
        after = _whole_logits(split, collate(rows), mesh)
        others = [i for i in range(len(lengths)) if i != changed]
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
        "tiled_mlps": tiled,
        "tiled_loss": isinstance(split.inputs.loss_head, TiledLossHead) and whole.inputs.loss_head is None,
        "shard_tokens": shard["input_ids"].shape[1],
        "head_tokens": head_tokens,
    }


def check_engine(name: str, zero_stage: int, cache_dir: str, mesh) -> dict:
    """The split model of kind `name` (tiled MLPs) in a DeepSpeed engine of `zero_stage`: DeepSpeed averages
    its gradients over the two ranks, which must give half the whole row's (the training loop's token
    weighting scales by the world). Run after check(name), whose whole-row gradients it reuses."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from lorakit.backends.deepspeed import DeepSpeedBackend
    from lorakit.backends.deepspeed_config import build_ds_config
    from lorakit.data.collate import PackedCausalCollator
    from lorakit.data.sequence_split import split_row
    from lorakit.model import build_model
    from lorakit.objectives.sft import causal_loss_sum
    from lorakit.testing import tiny_config

    kind, _, method = name.partition("-")
    recipe = _recipe(kind, cache_dir, 2, method or "lora", zero_stage=zero_stage)
    config = tiny_config(kind)
    ds_config = build_ds_config(recipe, mesh.world, accelerator="cpu", hidden_size=config.hidden_size)
    split = build_model(recipe, DeepSpeedBackend(recipe).load_plan(ds_config), sp_group=mesh.sp_group)
    batch = PackedCausalCollator(128)(_rows(0, config.vocab_size, LENGTHS.get(kind, DEFAULT_LENGTHS)))
    want = WHOLE_GRADS[name]
    trainable = [p for p in split.model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=split.model, model_parameters=trainable, config=ds_config)
    engine.train()
    shard = split_row(batch, mesh.sp_rank, mesh.sp_world)
    # The tiled head and loss (model.tiled_loss auto): under ZeRO-3 its head weight is partitioned.
    assert split.inputs.loss_head is not None
    engine.backward(causal_loss_sum(engine, split.inputs, shard, engine.device))
    worst = 0.0
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            g = 2 * safe_get_full_grad(p)
            worst = max(worst, (g - want[n]).abs().max().item() / (want[n].abs().max().item() + 1e-12))
    engine.destroy()
    split.hf_ds_config = None
    unset_hf_deepspeed_config()
    return {"grad_rel_diff": worst, "grad_count": len(want)}


def _recorded(fn, *args) -> dict:
    """fn(*args), or {"error": its traceback} when it raises (on every rank, as these checks do), so that
    the launch goes on to the next check and one failure hides no other."""
    out = {}
    error = failure(lambda: out.update(fn(*args) or {}))
    return {"error": error[-3000:]} if error else out


def main(cache_dir: str, out: str, kinds: list[str], recipes: list[str] = ()) -> None:
    """The checks of `kinds`, then lorakit.train of each recipe in order, in one process group (as
    qlora_worker.py trains them: one launch for both saves its start-up)."""
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
        results = {kind: _recorded(check, kind, cache_dir, mesh) for kind in kinds}
        # ZeRO-2 with LoRA; ZeRO-3 with QLoRA (its 4-bit base loaded whole, then partitioned).
        results["zero2"] = _recorded(check_engine, "llama", 2, cache_dir, mesh)
        results["zero3-qlora"] = _recorded(check_engine, "llama-qlora", 3, cache_dir, mesh)
        # ZeRO-3 with full fine-tuning: the tiled loss's head weight trains and is partitioned.
        results["zero3-full"] = _recorded(check_engine, "llama-full", 3, cache_dir, mesh)
        if mesh.rank == 0:
            with open(out, "w") as f:
                json.dump(results, f, indent=1)
        if recipes:
            import deepspeed

            import lorakit

            # DeepSpeed's view of this group, as lorakit joins it.
            deepspeed.init_distributed(dist_backend="gloo")
            for path in recipes:  # a run that fails leaves no summary.json: the tests of that run say so
                failure(lambda p=path: lorakit.train(lorakit.load_recipe(p)))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[3:]
    cut = args.index("--train") if "--train" in args else len(args)
    main(sys.argv[1], sys.argv[2], args[:cut], args[cut + 1 :])
