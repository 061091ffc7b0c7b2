"""One MoE block's experts with LoRA on the fused stacks, forward + backward, per experts path: transformers'
loop ("eager"), its grouped matmul through peft's W + B A ("grouped_mm") and lorakit's grouped experts with
the LoRA factored per group. Interleaved rounds, median seconds per path, ratios against the loop; shapes in
specs/moe_experts.yaml, the command in benchmarks/README.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import load_spec, main  # noqa: E402

SPEC = load_spec("moe_experts")
PATHS = ("eager", "grouped_mm", "lorakit_grouped")


def block(hidden: int, expert_ffn: int, experts: int, top_k: int, lora_r: int, **_):
    """A Mixtral sparse MoE block with peft's LoRA on its fused experts (non-zero B, as after training)."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=hidden, intermediate_size=expert_ffn, num_local_experts=experts)
    config.num_experts_per_tok = top_k
    torch.manual_seed(0)
    moe = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=hidden**-0.5)
    experts = ["experts.gate_up_proj", "experts.down_proj"]
    moe = inject_adapter_in_model(LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_parameters=experts), moe)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    return moe, config


def measure_shape(shape: dict, rounds: int) -> dict:
    """The spec's shape with each path's seconds per round, their medians and the speed-ups over the loop."""
    import torch

    from lorakit.model.grouped_experts import register

    register()
    moe, config = block(**shape)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, shape["tokens"], shape["hidden"], generator=gen, requires_grad=True)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    for i in range(rounds + 1):  # round 0 warms up, not counted
        for path in PATHS:
            config._experts_implementation = path
            moe.zero_grad()
            t0 = time.perf_counter()
            moe(x).square().mean().backward()  # the LoRA weights' and the input's gradients
            if i:
                times[path].append(time.perf_counter() - t0)
    median = {p: statistics.median(t) for p, t in times.items()}
    speedup = {p: median["eager"] / median[p] for p in PATHS}
    return {**shape, "median_seconds": median, "seconds": times, "speedup_vs_eager": speedup}


def measure(bench) -> int:
    import torch

    torch.set_num_threads(bench.args.threads)
    result = bench.result(torch_threads=bench.args.threads, rounds=bench.args.rounds)
    result["shapes"] = [measure_shape(s, bench.args.rounds) for s in SPEC["shapes"]]
    for s in result["shapes"]:
        ratios = ", ".join(f"{p} {v:.2f}x" for p, v in s["speedup_vs_eager"].items())
        bench.log(f"{s['shape']}: {ratios} (vs eager loop)")
    return bench.finish(result)


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
