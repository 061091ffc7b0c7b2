"""Measures tensor memory of real lorakit training steps and plans the same setups; one JSON per setup.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.integration.plan_worker OUT RECIPE.yaml ...

Launched by test_plan_measured.py (FSDP2 recipes go to plan_fsdp_worker.py's measure, in the same launch).
For each recipe: the model is built as lorakit.engine.job.run_job builds it (build_ds_config, build_model,
deepspeed.initialize, make_batching), then two optimizer steps
run on the micro-batch with the most token slots, inside a TensorMemoryTracker (CPU has no allocator
statistics). Written per rank: the tensor bytes alive after the second step (model states) and the peak
during it, both above what was alive before the model was built, and rank 0 adds the plan.
"""

import gc
import json
import sys
from pathlib import Path


def measure(path: str, out: Path) -> None:
    import deepspeed
    from torch.utils.data import DataLoader

    import lorakit
    from lorakit import dist
    from lorakit.backends.deepspeed import DeepSpeedBackend, DeepSpeedEngine, accelerator_name
    from lorakit.backends.deepspeed_config import build_ds_config
    from lorakit.data import prepare_data
    from lorakit.data.batching import make_batching
    from lorakit.engine.loop import train_window
    from lorakit.meter import TensorMemoryTracker, TokenMeter
    from lorakit.model import build_model, load_config, load_tokenizer

    recipe = lorakit.load_recipe(path)
    source, config = load_config(recipe)
    tokenizer = load_tokenizer(recipe, source)
    data = prepare_data(recipe, tokenizer, config)  # the test prepared the cache: this only reads it
    hidden = getattr(config, "d_model", None) or config.hidden_size
    ds_config = build_ds_config(recipe, dist.world_size(), accelerator=accelerator_name(), hidden_size=hidden)
    gc.collect()
    with TensorMemoryTracker("cpu") as tracker:
        built = build_model(recipe, DeepSpeedBackend(recipe).load_plan(ds_config))
        tracker.rescan()  # weights read from safetensors files are made outside torch operators
        batching = make_batching(
            recipe, data, tokenizer, config, packing=built.packing, world=dist.world_size(), rank=dist.rank()
        )
        loader = DataLoader(data.train, batch_sampler=batching.sampler, collate_fn=batching.collator)
        # The same, fullest micro-batch on every rank: the plan is a worst case over micro-batches.
        batch = max(loader, key=lambda b: (int(b["num_token_slots"]), len(b["input_ids"])))
        engine, *_ = deepspeed.initialize(
            model=built.model,
            model_parameters=[p for p in built.model.parameters() if p.requires_grad],
            config=ds_config,
        )
        engine = DeepSpeedEngine(engine, built)
        engine.train()  # as the training loop does: dropout on
        for _ in range(2):
            gc.collect()
            tracker.rescan()
            tracker.reset_peak()
            train_window(engine, built.inputs, [batch], TokenMeter())
        gc.collect()
        rest, peak = tracker.current - tracker.baseline, tracker.peak - tracker.baseline
    write_result(out, path, recipe, config, built, batching, batch, rest, peak)
    dist.barrier()
    engine.close()


def write_result(out: Path, path: str, recipe, config, built, batching, batch, rest: int, peak: int) -> None:
    """This rank's JSON: the bytes measured and the micro-batch's shape; rank 0 adds the plan of that shape."""
    import lorakit
    from lorakit import dist

    shape = {"rows": len(batch["input_ids"]), "seq_len": int(batch["input_ids"].shape[1])}
    if built.is_encoder_decoder:
        shape["target_len"] = int(batch["labels"].shape[1])
    result = {"rank": dist.rank(), "rest": rest, "peak": peak, "shape": shape}
    if dist.is_main():
        if batching.packing:
            # A packed row holds what fitted, up to train.max_tokens (and, for encoder-decoders, the decoder
            # row up to train.max_target_tokens): plan the rows that were measured.
            overrides = [f"train.max_tokens={shape['seq_len']}"]
            if built.is_encoder_decoder:
                overrides.append(f"train.max_target_tokens={shape['target_len']}")
            recipe = lorakit.load_recipe(path, overrides)
        planned = lorakit.plan(
            recipe, gpus=dist.world_size(), config=config, device="cpu",
            seq_len=shape["seq_len"], target_len=shape.get("target_len"),
        )  # fmt: skip
        result["plan"] = planned.to_dict()
    (out / f"{Path(path).stem}.rank{dist.rank()}.json").write_text(json.dumps(result))


def main(out: str, paths: list[str]) -> None:
    """Measure each recipe in order in one process group: FSDP2 recipes (distributed.strategy fsdp) with
    plan_fsdp_worker.py's allocator profile, the others here (one launch for both saves its start-up). A
    setup that raises is written as {"error": traceback}, so one failure hides no other setup."""
    import lorakit
    from lorakit import dist
    from lorakit.engine.launch import process_group
    from tests.integration import plan_fsdp_worker
    from tests.integration.worker_checks import failure

    with process_group("gloo"):
        for path in paths:
            fsdp = lorakit.load_recipe(path).distributed.strategy == "fsdp"
            # A setup that raises (on every rank) is recorded, and the next one is measured all the same.
            if error := failure(
                lambda p=path, f=fsdp: (plan_fsdp_worker.measure if f else measure)(p, Path(out))
            ):
                error = {"error": error[-3000:]}
                (Path(out) / f"{Path(path).stem}.rank{dist.rank()}.json").write_text(json.dumps(error))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
