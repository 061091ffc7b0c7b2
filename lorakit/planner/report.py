"""The terminal table of a MemoryPlan.

MemoryPlan.describe (lorakit.planner.core) calls this module, so this module does not import core, not
even for its types: `plan` is a core.MemoryPlan and `e` a core.Estimate, read by their fields only.
"""

from __future__ import annotations

from lorakit.objectives import objective_named
from lorakit.planner.units import HEADROOM, format_bytes

_WHEN = {
    "resident": "",
    "forward": "forward and backward",
    "backward": "backward",
    "gradients": "backward and step",
    "step": "optimizer step",
    "load": "loading",
    "start": "at the forward's start",
    "generate": "while generating",
}


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _cap(n: int) -> str:
    return f"{n / 1e9:.1f} GB = {format_bytes(n)}"


def _verdict(ok: bool | None, need: int, cap: int | None) -> str:
    if ok is None:
        return "(capacity not given)"
    word = "fits" if ok else "DOES NOT FIT"
    tight = " (tight: within the planner's tolerance)" if ok and need > HEADROOM * cap else ""
    return f"{word} in {_cap(cap)}{tight}"


def _breakdown(e, where: str) -> list[str]:
    lines = []
    for i in e.items:
        if i.where != where or not i.bytes:
            continue
        when = _WHEN[i.when]
        extra = ", ".join(x for x in (when, i.note) if x)
        lines.append(f"    {i.name:<46} {format_bytes(i.bytes):>12}" + (f"  ({extra})" if extra else ""))
    return lines


def describe_estimate(e, plan) -> list[str]:
    """The lines for one setup: GPU breakdown, activations, overhead, CPU RAM, verdicts."""
    a = e.activations
    unit = "per GPU" if plan.device == "cuda" else "per process (CPU run)"
    rows = f"{e.shape.rows} x {e.shape.seq_len}" + (f" -> {e.shape.target_len}" if e.shape.target_len else "")
    if e.shape.decoder_passes > 1:
        rows += f" x {e.shape.decoder_passes} decoder passes"
    lines = [f"  setup: {e.setup.label()}  (micro-batch of {rows} tokens)", f"  {unit}:"]
    lines += _breakdown(e, "gpu")
    lines.append(f"    {'activations (peak of one micro-batch)':<46} {format_bytes(a.peak):>12}")
    lines.append(f"      kept for the backward {format_bytes(a.kept)}; output head {format_bytes(a.head)}"
                 + (f"; one recomputed layer {format_bytes(a.recompute)}" if a.recompute else ""))  # fmt: skip
    extra = objective_named(plan.objective).describe_plan(format_bytes(a.no_grad_forward))
    if extra:
        lines.append(f"      {extra}")
    lines.append(
        f"    {'= allocated peak (torch max_memory_allocated)':<46} {format_bytes(e.gpu_allocated):>12}"
    )
    if e.gpu_overhead:
        lines.append(
            f"    {'+ framework overhead (CUDA context, NCCL, frag.)':<46} {format_bytes(e.gpu_overhead):>12}"
        )
    total = "= per GPU" if plan.device == "cuda" else "= per process"
    lines.append(f"    {total:<46} {format_bytes(e.per_gpu_bytes):>12}  "
                 f"{_verdict(e.fits_gpu, e.per_gpu_bytes, plan.gpu_memory)}")  # fmt: skip
    lines.append(f"  CPU RAM per node ({plan.gpus} processes):")
    lines += _breakdown(e, "cpu")
    runtime = "~3 GiB" if plan.device == "cuda" else "~0.5 GiB"
    lines.append(f"    {f'= per node (incl. {runtime} per process)':<46} {format_bytes(e.per_node_cpu_bytes):>12}  "
                 f"{_verdict(e.fits_cpu, e.per_node_cpu_bytes, plan.cpu_memory)}")  # fmt: skip
    if e.nvme_bytes:
        lines.append(f"  NVMe per node: {format_bytes(e.nvme_bytes * plan.gpus)}")
    return lines


def describe(plan) -> str:
    """The whole report."""
    cap = _cap(plan.gpu_memory) if plan.gpu_memory else "unknown memory"
    head = [
        f"memory plan: {plan.model} ({_count(plan.total_params)} parameters), {plan.method}, {plan.dtype}, "
        f"{plan.trainable_params:,} trainable",
        f"hardware: {plan.nodes} node(s) x {plan.gpus} GPU(s) of {cap}"
        + (f", {_cap(plan.cpu_memory)} CPU RAM per node" if plan.cpu_memory else "")
        + f"; attention: {plan.attention}"
        + (
            f"; a stalled rank fails collectives after {plan.timeout_minutes:g} min (distributed.timeout_minutes)"
            if plan.timeout_minutes is not None and plan.gpus * plan.nodes > 1
            else ""
        ),
        "",
        "recipe as written:",
    ]
    lines = head + describe_estimate(plan.estimate, plan)
    if plan.checkpointing is not None:
        lines.append(f"  {plan.checkpointing.describe()}")
    fits = plan.fits
    lines.append("")
    if fits is None:
        lines.append("verdict: give --gpu-memory for a verdict and a recommendation")
    else:
        lines.append(f"verdict: the recipe as written {'fits' if fits else 'DOES NOT FIT'}")
    if plan.longest_row is not None:
        lines.append(
            f"the longest row this recipe trains on these GPUs: {plan.longest_row:,} tokens (one document "
            f"filling a packed row; the recipe's setup, distributed.sequence_parallel "
            f"{plan.sequence_parallel})"
        )
    rec = plan.recommendation
    if rec is not None and (rec is not plan.estimate and plan.recommended_overrides):
        lines += ["", f"best setup that fits (expected step time x{rec.slowdown:.2f} of the fastest setup):"]
        lines += describe_estimate(rec, plan)
        lines.append("  run it with: " + " ".join(plan.recommended_overrides))
    elif rec is not None:
        lines.append(f"the recipe's setup is also the fastest that fits (step time x{rec.slowdown:.2f})")
    elif fits is False:
        # A QLoRA recipe already has a 4-bit base: QLoRA is no advice to it.
        qlora = "" if plan.method == "qlora" else "QLoRA (method.kind: qlora), "
        lines.append(f"no setup tried fits: more GPUs, larger GPUs, {qlora}or a shorter sequence length")
    lines += ["", "assumptions:"] + [f"  - {n}" for n in plan.assumptions]
    lines.append("  - framework overhead and speed costs are stated estimates; see docs/planning.md")
    return "\n".join(lines)
