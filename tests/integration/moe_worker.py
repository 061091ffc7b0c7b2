"""One optimizer step of each tiny MoE model (Mixtral, Qwen3-MoE, OLMoE) under DeepSpeed ZeRO-3 with
deliberately skewed routing: one rank's row repeats a single token (on Mixtral every position of it is routed
to the same two experts in every layer, the other experts get none of that rank's tokens:
tests/unit/test_moe.py), the other rank holds ordinary rows. LoRA on attention, the experts and the router (method.train_router), the load-balancing loss
on; writes loss, grad norm, the aux-loss metric and the gathered adapter of each, before (KIND-MODE-start.pt)
and after the step. Each family is a check of its own (worker_checks.py): one failing does not stop the next.

    python -m tests.integration.moe_worker CACHE OUT MODE

MODE: two_ranks (under torchrun, 2 processes, each rank one micro-batch) | accumulate (one process, the two
micro-batches accumulated: the same window). Launched by test_token_weighting.py (two_ranks through
two_ranks_worker.py).
"""

import json
import sys
from functools import partial
from pathlib import Path

import torch

# Each MoE family of issue 45, stepped in turn in one launch.
KINDS = ("mixtral", "qwen3_moe", "olmoe")
# Rank 0's skewed row, then rank 1's rows (token ids of the tiny vocabulary).
SKEWED = [[57] * 24]
ORDINARY = [list(range(100, 120)), list(range(300, 313))]


def _recipe(cache: str, out: str, world: int, kind: str):
    from tests.conftest import tiny_recipe

    return tiny_recipe(
        Path(cache),
        Path(out) / "run",
        model={"name_or_path": f"tiny:{kind}"},
        data={"format": "instruction", "max_length": 128},
        method={"dropout": 0.0, "train_router": True},
        train={"max_grad_norm": 0.0, "lr": 1e-2, "gradient_accumulation_steps": 3 - world},
        distributed={"zero_stage": 3, "num_processes": world},
    )


def main(cache: str, out: str, mode: str) -> None:
    import deepspeed

    from lorakit import dist
    from lorakit.backends.deepspeed import DeepSpeedBackend, DeepSpeedEngine
    from lorakit.backends.deepspeed_config import build_ds_config
    from lorakit.data.collate import CausalCollator
    from lorakit.engine.launch import process_group
    from lorakit.engine.loop import train_window
    from lorakit.engine.save import gather_adapter_state
    from lorakit.meter import TokenMeter
    from lorakit.model import build_model
    from lorakit.objectives.sft import SftObjective
    from tests.integration.token_weighting_worker import _same_start
    from tests.integration.worker_checks import run_checks

    def step(kind: str) -> None:
        recipe = _recipe(cache, out, 2 if mode == "two_ranks" else 1, kind)
        ds_config = build_ds_config(recipe, dist.world_size(), accelerator="cpu")
        built = build_model(recipe, DeepSpeedBackend(recipe).load_plan(ds_config))
        _same_start(built.model)
        ds_config["optimizer"] = {"type": "SGD", "params": {"lr": 1.0}}
        trainable = [p for p in built.model.parameters() if p.requires_grad]
        engine, *_ = deepspeed.initialize(model=built.model, config=ds_config, model_parameters=trainable)
        engine = DeepSpeedEngine(engine, built)
        start = gather_adapter_state(engine)
        collate = CausalCollator(pad_token_id=0)
        batches = [collate([{"input_ids": r, "labels": r} for r in rows]) for rows in (SKEWED, ORDINARY)]
        window = [batches[dist.rank()]] if mode == "two_ranks" else batches
        objective = SftObjective.from_recipe(recipe, built.model.config)
        stats = train_window(engine, built.inputs, window, TokenMeter(), objective)
        weights = gather_adapter_state(engine)
        if dist.is_main():
            torch.save(start, Path(out) / f"{kind}-{mode}-start.pt")
            torch.save(weights, Path(out) / f"{kind}-{mode}.pt")
            (Path(out) / f"{kind}-{mode}.json").write_text(json.dumps(stats))
        engine.close()

    with process_group():
        run_checks(out, {f"{kind}-{mode}": partial(step, kind) for kind in KINDS})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(*sys.argv[1:])
