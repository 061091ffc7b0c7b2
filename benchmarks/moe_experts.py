"""One MoE block's experts with LoRA on the fused stacks, forward + backward, per experts path: transformers'
loop over the experts ("eager"), transformers' grouped matmul through peft's materialised W + B A
("grouped_mm", transformers' default) and lorakit's grouped experts with the LoRA factored per group
(lorakit.model.grouped_experts). Interleaved rounds, median seconds per path, ratios against the loop.

    python benchmarks/moe_experts.py [--rounds 7] [--output benchmarks/results/moe_experts.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness.provenance import Provenance  # noqa: E402

# (name, hidden, expert ffn, experts, top-k, tokens, LoRA rank): the tiny Mixtral's block, and a wider one of
# Qwen3-MoE's proportions (small experts, many of them) at a CPU-sized width.
SHAPES = [("tiny", 64, 128, 4, 2, 256, 8), ("wider", 1024, 512, 16, 4, 1024, 16)]
PATHS = ("eager", "grouped_mm", "lorakit_grouped")


def block(hidden: int, ffn: int, experts: int, top_k: int, r: int):
    """A Mixtral sparse MoE block with peft's LoRA on its fused experts (non-zero B, as after training)."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=hidden, intermediate_size=ffn, num_local_experts=experts)
    config.num_experts_per_tok = top_k
    torch.manual_seed(0)
    moe = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=hidden**-0.5)
    lora = LoraConfig(r=r, lora_alpha=2 * r, target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    moe = inject_adapter_in_model(lora, moe)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    return moe, config


def step(moe, x) -> float:
    """Seconds of one forward + backward (the LoRA weights' and the input's gradients)."""
    t0 = time.perf_counter()
    moe(x).square().mean().backward()
    return time.perf_counter() - t0


def measure(shape, rounds: int) -> dict:
    import torch

    from lorakit.model.grouped_experts import register

    name, hidden, ffn, experts, top_k, tokens, r = shape
    register()
    moe, config = block(hidden, ffn, experts, top_k, r)
    x = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    for i in range(rounds + 1):  # round 0 warms up, not counted
        for path in PATHS:
            config._experts_implementation = path
            moe.zero_grad()
            t = step(moe, x)
            if i:
                times[path].append(t)
    median = {p: statistics.median(t) for p, t in times.items()}
    fields = dict(hidden=hidden, expert_ffn=ffn, experts=experts, top_k=top_k, tokens=tokens, lora_r=r)
    return {
        "shape": name,
        **fields,
        "median_seconds": median,
        "seconds": times,
        "speedup_vs_eager": {p: median["eager"] / median[p] for p in PATHS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/moe_experts.json"))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    prov = Provenance()
    result = {
        "benchmark": "moe_experts",
        **prov.start(),
        "torch_threads": args.threads,
        "rounds": args.rounds,
    }
    result["measured"] = (
        "wall seconds of one MoE block's forward + backward (fp32, CPU), LoRA on both fused expert stacks; "
        "median over interleaved rounds after one warm-up round"
    )
    result["shapes"] = [measure(s, args.rounds) for s in SHAPES]
    result.update(prov.end())
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    for s in result["shapes"]:
        ratios = ", ".join(f"{p} {v:.2f}x" for p, v in s["speedup_vs_eager"].items())
        print(f"{s['shape']}: {ratios} (vs eager loop)")


if __name__ == "__main__":
    main()
