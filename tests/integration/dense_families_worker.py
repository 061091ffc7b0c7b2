"""One optimizer step of LoRA on each dense family's tiny model (issue 45), on one process and on two under
DeepSpeed ZeRO-3; writes loss, grad norm and the updated (gathered) LoRA weights of each.

    python dense_families_worker.py CACHE OUT MODE

MODE: single (one process, the 6 rows as one batch) | two_ranks (2 processes, ZeRO-3, rows 1 and 5).
Launched by test_token_weighting.py (two_ranks under torchrun, through two_ranks_worker.py). Steps follow
token_weighting_worker's (fp32, SGD at lr 1, every LoRA weight drawn from one generator).
"""

import json
import sys
from functools import partial
from pathlib import Path

import torch

# Every dense family of issue 45 (the Llama-style ones the token-weighting test checks aside): Gemma 2 (tied
# head, embedding scale, soft-capping on eager, alternating windows), Phi-3 (fused qkv and gate_up), Qwen3
# and OLMo 2 (q/k norms), Gemma 3 text (q/k norms, local and global layers), T5Gemma (encoder-decoder).
KINDS = ("gemma2", "phi3", "qwen3", "gemma3", "olmo2", "t5gemma")
SPLIT = [(0, 1), (1, 6)]


def _step(cache: str, out: str, kind: str, mode: str) -> None:
    from lorakit import dist
    from lorakit.backends.deepspeed import DeepSpeedBackend
    from lorakit.backends.deepspeed_config import build_ds_config
    from lorakit.data import prepare_data
    from lorakit.data.collate import padded_collator
    from lorakit.engine.loop import train_window
    from lorakit.engine.save import gather_adapter_state
    from lorakit.meter import TokenMeter
    from lorakit.model import build_model, load_config, load_tokenizer
    from tests.conftest import tiny_recipe
    from tests.integration.token_weighting_worker import _engine, _same_start

    recipe = tiny_recipe(
        Path(cache),
        Path(out) / "run",
        model={"name_or_path": f"tiny:{kind}"},
        data={"format": "instruction", "max_length": "auto"},
        method={"dropout": 0.0},
        train={"max_grad_norm": 0.0, "lr": 1e-2},
        distributed={"zero_stage": 3, "num_processes": 1 if mode == "single" else 2},
    )
    source, config = load_config(recipe)
    tok = load_tokenizer(recipe, source)
    data = prepare_data(recipe, tok, config)
    ds_config = build_ds_config(recipe, dist.world_size(), accelerator="cpu")
    built = build_model(recipe, DeepSpeedBackend(recipe).load_plan(ds_config))
    _same_start(built.model)
    engine = _engine(recipe, built, ds_config)
    rows = [data.train[i] for i in range(6)]
    start, end = (0, 6) if mode == "single" else SPLIT[dist.rank()]
    stats = train_window(engine, built.inputs, [padded_collator(tok, config)(rows[start:end])], TokenMeter())
    _save(Path(out) / f"{kind}-{mode}", stats, gather_adapter_state(engine), dist.is_main())
    engine.close()


def _save(stem: Path, stats: dict, weights: dict, main_rank: bool) -> None:
    """The step's stats (JSON) and gathered LoRA weights, as test_token_weighting._check_same_step reads."""
    if main_rank:
        torch.save(weights, stem.with_suffix(".pt"))
        stem.with_suffix(".json").write_text(json.dumps(stats))


def main(cache: str, out: str, mode: str) -> None:
    from lorakit.engine.launch import process_group
    from tests.integration.worker_checks import run_checks

    with process_group():
        run_checks(out, {f"{kind}-{mode}": partial(_step, cache, out, kind, mode) for kind in KINDS})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(*sys.argv[1:])
