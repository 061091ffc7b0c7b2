"""Runs one optimizer step on fixed micro-batches; writes loss, grad norm and updated LoRA weights.

    python token_weighting_worker.py CACHE OUT MODE      (MODE: one_batch | accumulate | two_ranks)

Launched by test_token_weighting.py, under torchrun for two_ranks.
"""

import json
import sys
from pathlib import Path

import torch


def main(cache: str, out: str, mode: str) -> None:
    import deepspeed

    from lorakit.data import Seq2SeqCollator, prepare_data
    from lorakit.engine import dist
    from lorakit.engine.deepspeed_config import build_ds_config
    from lorakit.engine.launch import process_group
    from lorakit.engine.loop import train_window
    from lorakit.engine.save import gather_adapter_state
    from lorakit.meter import TokenMeter
    from lorakit.model import build_model, load_config, load_tokenizer
    from tests.conftest import tiny_recipe

    gas = 2 if mode == "accumulate" else 1
    recipe = tiny_recipe(
        Path(cache),
        Path(out) / "run",
        method={"dropout": 0.0},
        train={"gradient_accumulation_steps": gas, "max_grad_norm": 0.0, "lr": 1e-2},
        distributed={"zero_stage": 3, "num_processes": 2 if mode == "two_ranks" else 1},
    )
    with process_group():
        source, config = load_config(recipe)
        tok = load_tokenizer(recipe, source)
        data = prepare_data(recipe, tok, config)
        ds_config = build_ds_config(recipe, dist.world_size(), accelerator="cpu")
        # Plain SGD at lr 1 makes the update exactly -gradient, so the weights compare gradients; Adam's
        # g / (|g| + eps) would amplify float-order noise wherever g is near eps.
        ds_config["optimizer"] = {"type": "SGD", "params": {"lr": 1.0}}
        built = build_model(recipe, ds_config)
        engine, *_ = deepspeed.initialize(
            model=built.model,
            config=ds_config,
            model_parameters=[p for p in built.model.parameters() if p.requires_grad],
        )
        collate = Seq2SeqCollator(tok.pad_token_id, config.decoder_start_token_id)
        # Two micro-batches with very different target-token counts: 1 row vs 5 rows.
        rows_a = [data.train[i] for i in range(1)]
        rows_b = [data.train[i] for i in range(1, 6)]
        if mode == "one_batch":
            window = [collate(rows_a + rows_b)]
        elif mode == "accumulate":
            window = [collate(rows_a), collate(rows_b)]
        else:
            window = [collate(rows_a if dist.rank() == 0 else rows_b)]
        stats = train_window(engine, built.inputs, window, TokenMeter())
        weights = gather_adapter_state(engine.module)
        if dist.is_main():
            torch.save(weights, Path(out) / f"{mode}.pt")
            (Path(out) / f"{mode}.json").write_text(json.dumps(stats))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(*sys.argv[1:])
