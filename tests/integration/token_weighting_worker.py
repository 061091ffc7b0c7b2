"""Runs one optimizer step on fixed micro-batches of the tiny T5 and the tiny Llama; writes loss, grad norm
and the updated (gathered) LoRA weights of each.

    python token_weighting_worker.py CACHE OUT MODE

Before the step of the one-process batch and of the two ranks' split rows (not hybrid's four), each engine
generates from its rank's prompts (Engine.generate: greedy, and sampled from a seeded RNG; GENERATE), written
as NAME-generate-rankR.json with whether its weights were whole (Engine.generation_weights), which the test
compares with the unsharded model's generate (`reference_generations`); ZeRO-3 and FSDP2 on two ranks
generate with their weights gathered whole, then layer by layer (NAME-layered-generate-rankR.json).

MODE: single (one process: the 6 rows as one batch, and as 2 accumulated micro-batches) | two_ranks (2
processes: DeepSpeed ZeRO-3, then FSDP2 full sharding, written as "fsdp"; then FSDP2 with 4 accumulated
micro-batches of 8 rows, reduced once at the window's boundary ("fsdp-window4") and, as before, after
every micro-batch ("fsdp-each4"), the gradient reduce-scatters counted) | hybrid (FSDP2 hybrid sharding, 4
processes: a 2 x 2 mesh). The ranks hold different numbers of rows (1 and 5; 1, 2, 1 and 2).
Launched by test_token_weighting.py, under torchrun for the multi-process modes (two_ranks through
two_ranks_worker.py).
"""

import json
import sys
from functools import partial
from pathlib import Path

import torch

MODELS = {
    "t5": {},
    "llama": {
        "model": {"name_or_path": "tiny:llama"},
        "data": {"format": "instruction", "max_length": "auto"},
    },
}
# Each rank's rows of the 6 (the single process holds them all).
SPLITS = {"two_ranks": [(0, 1), (1, 6)], "fsdp": [(0, 1), (1, 6)], "hybrid": [(0, 1), (1, 3), (3, 4), (4, 6)]}

# Engine.generate's check: each rank's prompts (train rows) and new tokens, different on each rank, so under
# sharding the rank done first keeps taking part in the other's forwards; one process generates both.
GENERATE = [((0,), 3), ((1, 2), 6)]

# What each launch runs, as (mode, layout): one launch of 2 processes takes both 2-process backends.
LAUNCHES = {
    "single": [("single", "one_batch"), ("single", "accumulate")],
    "two_ranks": [("two_ranks", "split"), ("fsdp", "split"), ("fsdp", "window4"), ("fsdp", "each4")],
    "hybrid": [("hybrid", "split")],
}


def _recipe(cache: str, out: str, kind: str, mode: str, gas: int):
    from tests.conftest import tiny_recipe

    sections = {k: dict(v) for k, v in MODELS[kind].items()}
    distributed = {"zero_stage": 3, "num_processes": len(SPLITS.get(mode, [0]))}
    if mode in ("fsdp", "hybrid"):
        distributed["strategy"] = "fsdp"
    if mode == "hybrid":
        distributed["fsdp"] = {"sharding": "hybrid", "shard_size": 2}
    return tiny_recipe(
        Path(cache),
        Path(out) / "run",
        **sections,
        method={"dropout": 0.0},
        train={"gradient_accumulation_steps": gas, "max_grad_norm": 0.0, "lr": 1e-2},
        distributed=distributed,
    )


def _same_start(model) -> None:
    """Every trainable weight (LoRA A and B) drawn from one fixed generator, on every backend: loading
    under ZeRO-3 draws from the global RNG differently than a plain load, so peft's own init would differ;
    B non-zero gives every LoRA weight a non-zero gradient."""
    import contextlib

    trainable = [p for _, p in sorted(model.named_parameters()) if p.requires_grad]
    gathered = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in trainable):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(trainable, modifier_rank=0)
    g = torch.Generator().manual_seed(0)
    with gathered, torch.no_grad():
        for p in trainable:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _prompts(data, tok, kind: str, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s prompts as generation takes them: left-padded prompts (causal), sources (T5)."""
    from lorakit.data.collate import left_pad_prompts, right_pad_sources

    rows = [data.train[i] for i in GENERATE[rank][0]]
    if kind == "llama":
        return left_pad_prompts([r["prompt_ids"] for r in rows], tok.pad_token_id)
    return right_pad_sources([r["input_ids"] for r in rows], tok.pad_token_id)


def generations(generate, data, tok, kind: str, rank: int) -> dict[str, list]:
    """`generate(input_ids, attention_mask, **sampling)` on rank `rank`'s prompts: greedy, and sampled with
    the torch RNG seeded per rank; exactly GENERATE's new tokens (no early end)."""
    prompt, new = _prompts(data, tok, kind, rank), GENERATE[rank][1]
    fixed = {"max_new_tokens": new, "min_new_tokens": new, "pad_token_id": tok.pad_token_id}
    greedy = generate(prompt["input_ids"], prompt["attention_mask"], do_sample=False, **fixed)
    torch.manual_seed(100 + rank)
    sampled = generate(prompt["input_ids"], prompt["attention_mask"], do_sample=True, top_p=0.9, **fixed)
    return {"greedy": greedy.tolist(), "sampled": sampled.tolist()}


def reference_generations(cache: str, out: str, kind: str) -> list[dict[str, list]]:
    """Per rank of GENERATE, the generations of the unsharded model (loaded whole, with _same_start's
    adapter) through transformers' own generate."""
    from lorakit.data import prepare_data
    from lorakit.model import build_model, load_config, load_tokenizer

    recipe = _recipe(cache, out, kind, "single", 1)
    source, config = load_config(recipe)
    tok = load_tokenizer(recipe, source)
    data = prepare_data(recipe, tok, config)
    model = build_model(recipe).model
    _same_start(model)
    model.eval()

    def plain(input_ids, attention_mask, **sampling):
        with torch.no_grad():
            return model.generate(input_ids=input_ids, attention_mask=attention_mask, **sampling)

    return [generations(plain, data, tok, kind, r) for r in range(len(GENERATE))]


def _engine(recipe, built, ds_config):
    # Plain SGD at lr 1 makes the update exactly -gradient, so the weights compare gradients; Adam's
    # g / (|g| + eps) would amplify float-order noise wherever g is near eps.
    if recipe.distributed.strategy == "fsdp":
        from lorakit.backends.fsdp import FsdpEngine
        from lorakit.backends.fsdp_shard import device_mesh, shard_model

        f = recipe.distributed.fsdp
        model = shard_model(
            built.model, device_mesh(f.sharding, f.shard_size, "cpu"), dtype="float32", cpu_offload=False
        )
        sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        constant = torch.optim.lr_scheduler.LambdaLR(sgd, lambda _: 1.0)
        return FsdpEngine(model, sgd, constant, torch.device("cpu"), 0.0)
    import deepspeed

    from lorakit.backends.deepspeed import DeepSpeedEngine

    ds_config["optimizer"] = {"type": "SGD", "params": {"lr": 1.0}}
    # As DeepSpeedBackend.wrap does (every recipe here is ZeRO-3): each LoRA layer gathered whole. Without
    # checkpointing, as here, the first block's layers read inputs that need no grad (zero3_leaves.py's hook).
    from lorakit.backends.zero3_leaves import before_initialize

    assert before_initialize(built.model, ds_config) > 0
    engine, *_ = deepspeed.initialize(
        model=built.model,
        config=ds_config,
        model_parameters=[p for p in built.model.parameters() if p.requires_grad],
    )
    return DeepSpeedEngine(engine, built)


class _ReduceEachMicroBatch:
    """An engine whose every micro-batch is a boundary to the backend: gradients reduced after each one,
    what FSDP2 did before accumulating them unreduced (composition: the engine itself is unchanged)."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def backward(self, loss, *, boundary: bool) -> None:
        self.engine.backward(loss, boundary=True)


def _counting_reduce_scatters():
    """A dispatch mode counting the reduce-scatter collectives (c10d ops) run inside it (`.count`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += "reduce_scatter" in str(func)
            return func(*args, **(kwargs or {}))

    return Count()


def step_name(kind: str, mode: str, layout: str) -> str:
    """The stem of a step's outputs (and of its check): KIND-MODE, KIND-LAYOUT on one process."""
    name = f"{kind}-{layout if mode == 'single' else mode}"
    return name + (f"-{layout}" if layout in ("window4", "each4") else "")


def _step(cache: str, out: str, kind: str, mode: str, layout: str) -> None:
    from lorakit import dist
    from lorakit.backends.deepspeed import DeepSpeedBackend
    from lorakit.backends.deepspeed_config import build_ds_config
    from lorakit.data import prepare_data
    from lorakit.data.collate import padded_collator
    from lorakit.engine.loop import train_window
    from lorakit.engine.save import gather_adapter_state
    from lorakit.meter import TokenMeter
    from lorakit.model import build_model, load_config, load_tokenizer
    from lorakit.model.load_plan import WHOLE

    gas = {"accumulate": 2, "window4": 4, "each4": 4}.get(layout, 1)
    recipe = _recipe(cache, out, kind, mode, gas)
    source, config = load_config(recipe)
    tok = load_tokenizer(recipe, source)
    data = prepare_data(recipe, tok, config)
    ds_config = build_ds_config(recipe, dist.world_size(), accelerator="cpu")
    # FSDP2 here loads whole in each process (then shards), as its engine below is built by hand.
    deepspeed = recipe.distributed.strategy == "deepspeed"
    built = build_model(recipe, DeepSpeedBackend(recipe).load_plan(ds_config) if deepspeed else WHOLE)
    _same_start(built.model)
    engine = _engine(recipe, built, ds_config)
    collate = padded_collator(tok, config)
    rows = [data.train[i] for i in range(6)]
    if layout in ("window4", "each4"):
        # 8 rows, 4 on each rank, one per micro-batch.
        window = [collate([data.train[4 * dist.rank() + i]]) for i in range(4)]
        if layout == "each4":
            engine = _ReduceEachMicroBatch(engine)
    elif layout == "one_batch":
        window = [collate(rows)]
    elif layout == "accumulate":
        window = [collate(rows[:1]), collate(rows[1:])]
    else:
        start, end = SPLITS[mode][dist.rank()]
        window = [collate(rows[start:end])]
    if layout in ("one_batch", "split") and mode != "hybrid":
        # Before the step, from the weights _same_start gave every backend: the engine's own generation.
        name = f"{kind}-{layout if mode == 'single' else mode}"
        ranks = range(len(GENERATE)) if mode == "single" else [dist.rank()]
        # ZeRO-3 and FSDP2 on two ranks: with the whole model gathered once per generate (what auto does
        # here), then layer by layer, the ranks synced (distributed.gather_for_generation false); the step
        # comes after.
        settings = {"": "auto", "-layered": False} if mode in ("two_ranks", "fsdp") else {"": "auto"}
        for suffix, setting in settings.items():
            if hasattr(engine, "gather_for_generation"):
                engine.gather_for_generation = setting
            # Engine.generate inside the engine's own context: nested, it takes the weights as they are.
            with engine.generation_weights() as whole:
                for r in ranks:
                    made = {**generations(engine.generate, data, tok, kind, r), "whole": whole}
                    (Path(out) / f"{name}{suffix}-generate-rank{r}.json").write_text(json.dumps(made))
    if mode == "fsdp":
        with _counting_reduce_scatters() as comms:  # FSDP2's gradient reductions
            stats = train_window(engine, built.inputs, window, TokenMeter())
        stats["reduce_scatters"] = comms.count
    else:
        stats = train_window(engine, built.inputs, window, TokenMeter())
    weights = gather_adapter_state(engine)
    if dist.is_main():
        name = step_name(kind, mode, layout)
        torch.save(weights, Path(out) / f"{name}.pt")
        (Path(out) / f"{name}.json").write_text(json.dumps(stats))
    engine.close()


def main(cache: str, out: str, mode: str) -> None:
    from lorakit.engine.launch import process_group
    from tests.integration.worker_checks import run_checks

    with process_group():
        steps = [(kind, *step) for kind in MODELS for step in LAUNCHES[mode]]
        run_checks(out, {step_name(*s): partial(_step, cache, out, *s) for s in steps})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(*sys.argv[1:])
