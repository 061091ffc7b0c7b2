"""Loads one recipe's model on 2 processes with FSDP2, sharded (the backend's choice) and then whole in each
process, and measures each rank's private memory while each loads:

    python -m torch.distributed.run --nproc_per_node=2 -m tests.integration.fsdp_memory_worker RECIPE OUT_JSON

Private memory is the process's anonymous resident memory (RssAnon: what it allocated itself, not the page
cache of the memory-mapped checkpoint, which every process of a node shares), sampled every 2 ms from just
before build_model (the libraries already imported: the runtime) until the backend has wrapped the model.
Both models then compute the loss of the same batch and rank 0 gathers their frozen weights: the sharded
load must have read exactly what the whole load did. Rank 0 writes what it measured to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
import threading


def rss_anon() -> int:
    """This process's anonymous resident bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _measured(load) -> tuple[object, int]:
    """load() and the most private memory it added while running."""
    import ctypes
    import gc

    gc.collect()
    # Memory freed before (the other load) goes back to the system, so it cannot hide this load's growth.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    baseline = rss_anon()
    peak = [baseline]
    done = threading.Event()

    def sample():
        while not done.wait(0.002):
            peak[0] = max(peak[0], rss_anon())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = load()
    finally:
        done.set()
        sampler.join()
    return result, peak[0] - baseline


def main(recipe_path: str, out: str) -> None:
    # The runtime, imported before any baseline: what loading uses besides the model's weights.
    import accelerate  # noqa: F401
    import peft  # noqa: F401
    import safetensors  # noqa: F401
    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import lorakit
    from lorakit.backends import backend_for
    from lorakit.engine.launch import process_group
    from lorakit.model import build_model, load_config
    from lorakit.model.load_plan import WHOLE
    from lorakit.model.loss import token_loss_sum

    with process_group("gloo"):
        recipe = lorakit.load_recipe(recipe_path)
        backend = backend_for(recipe)
        _, config = load_config(recipe)
        described = backend.describe(config)
        results = {}
        for how, plan in (("sharded", backend.load_plan(described)), ("whole", WHOLE)):

            def load(plan=plan):
                built = build_model(recipe, plan)
                return built, backend.wrap(
                    built, described, lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
                )

            (built, engine), added = _measured(load)
            ids = torch.arange(5, 69).reshape(2, 32)
            with torch.no_grad():
                extra = {"decoder_input_ids": ids} if config.is_encoder_decoder else {}
                loss = token_loss_sum(engine(input_ids=ids, **extra).logits, ids) / ids.numel()
            state = engine.full_model_state()
            frozen = {k: v for k, v in (state or {}).items() if "lora_" not in k}
            results[how] = {
                "added": added,
                "loss": float(loss),
                "loaded": plan.kind == "meta",
                "frozen": frozen,
            }
            engine.close()
            del built, engine, state
        both = [None, None]
        dist.all_gather_object(both, {h: r["added"] for h, r in results.items()})
        if dist.get_rank() == 0:
            s, w = results["sharded"]["frozen"], results["whole"]["frozen"]
            same = s.keys() == w.keys() and all(torch.equal(s[k], w[k]) for k in s)
            report = {
                "added": {h: [r[h] for r in both] for h in results},
                "loss": {h: r["loss"] for h, r in results.items()},
                "meta_load": results["sharded"]["loaded"],
                "same_weights": same,
                "weights": len(s),
            }
            with open(out, "w") as f:
                json.dump(report, f)
        # Both ranks leave together: one that tore its gloo group down while the other was still inside the
        # last collective aborted once in CI ("terminate called without an active exception", rank 1).
        dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
