"""bf16 at ZeRO-0 with lorakit's own mixed-precision AdamW: flat fp32 masters, one host sync per step.

Why: at zero_stage 0 in bf16, DeepSpeed 0.19.8 wraps any optimizer that is not its own FusedAdam (lorakit
gives it torch's AdamW, deepspeed_config.py says why) in `FP16_UnfusedOptimizer`, which checks every
trainable tensor for overflow with its own `.item()` and copies, scales and norms the tensors one by one: a
host sync per trainable tensor per step (879 for FLAN-T5-XL's 864 LoRA tensors on the H100 lease of
2026-11-27, benchmarks/results/gpu_h100_2026-11-27.md). ZeRO-1/2/3 keep flat buffers and are not affected.

What was weighed (docs/backends.md#zero-0-in-bf16): running stage 0 as a one-process ZeRO-1 changes the
recipe's stage, its checkpoint layout (older stage-0 checkpoints would not load) and copies every gradient
into ZeRO's buckets; fp32 adapters under torch autocast train other numbers than ZeRO-1/2/3 (fp32 compute
weights). So here DeepSpeed runs without its bf16 wrapper (bf16 off in the config it is given; the run
directory still records the recipe's) and `MixedPrecisionAdamW` does the same mixed precision as ZeRO's
optimizers: bf16 weights and gradients in the model, fp32 master weights and AdamW state in one flat tensor
per parameter group, clipping on the global norm, a non-finite step skipped (DeepSpeed reads `overflow`
and leaves the LR schedule where it was), one fused (CUDA) or foreach (CPU) AdamW, and a foreach copy back
to bf16. The one host sync is the gradient norm, which the loop logs anyway.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch


def owns_bf16(config: dict[str, Any]) -> bool:
    """Whether lorakit, not DeepSpeed, does the mixed precision of this DeepSpeed config: bf16 at ZeRO-0
    with torch's AdamW (deepspeed_config.build_ds_config's optimizer without offload)."""
    return (
        config["zero_optimization"]["stage"] == 0
        and config["bf16"]["enabled"]
        and bool(config["optimizer"]["params"].get("torch_adam"))
    )


def engine_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config DeepSpeed is given when lorakit owns the mixed precision: no bf16 wrapper, no optimizer
    of its own (one is passed), no clipping (MixedPrecisionAdamW clips its fp32 gradients), and gradients
    still all-reduced in bf16 as DeepSpeed's bf16 mode does (without it DeepSpeed would reduce in fp32)."""
    out = copy.deepcopy(config)
    out.pop("optimizer")
    out["bf16"] = {"enabled": False}
    out["gradient_clipping"] = 0.0
    out["communication_data_type"] = "bf16"
    return out


def place_module(model: torch.nn.Module, device: str) -> None:
    """The module as DeepSpeed's bf16 mode makes it in deepspeed.initialize, before the optimizer's fp32
    masters are copied from it: every floating-point parameter in bf16, buffers untouched (transformers
    keeps some weights in fp32, T5's `wo`; ZeRO-1/2/3 train them in bf16 too), all on `device`, where
    the masters are made (DeepSpeed's own move to it is then a no-op)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != torch.bfloat16:
            p.data = p.data.to(torch.bfloat16)
    model.to(device)


def mixed_precision_adamw(model_parameters: list[Any], config: dict[str, Any]) -> MixedPrecisionAdamW:
    """MixedPrecisionAdamW over deepspeed.initialize's model_parameters with the config's AdamW settings
    and clipping."""
    params = dict(config["optimizer"]["params"])
    params.pop("torch_adam")
    return MixedPrecisionAdamW(model_parameters, max_grad_norm=config["gradient_clipping"], **params)


class MixedPrecisionAdamW(torch.optim.AdamW):
    """torch's AdamW on one flat fp32 master per parameter group of low-precision (bf16) parameters.

    `step()` gathers the groups' gradients into the masters' fp32 gradients (one cat each), takes the global
    norm (the step's only host sync), skips a non-finite step (`overflow`), clips, steps, and copies the
    masters back into the parameters. `param_groups` hold the masters (the LR schedule sets their lr)."""

    def __init__(self, params: list[Any], *, max_grad_norm: float = 0.0, **adamw: Any):
        groups = params if params and isinstance(params[0], dict) else [{"params": list(params)}]
        self.low: list[list[torch.Tensor]] = []
        masters = []
        for group in groups:
            low = list(group["params"])
            flat = torch.cat([p.detach().reshape(-1).float() for p in low])
            self.low.append(low)
            masters.append({**group, "params": [torch.nn.Parameter(flat)]})
        super().__init__(masters, **adamw)
        self.max_grad_norm = max_grad_norm
        # Read by DeepSpeed's engine after each step: skip the LR schedule, report the norm.
        self.overflow = False
        self._global_grad_norm: float | None = None

    def _masters(self) -> list[torch.Tensor]:
        return [g["params"][0] for g in self.param_groups]

    def _copy_back(self, master: torch.Tensor, low: list[torch.Tensor]) -> None:
        # Cast once (one kernel), so the foreach copy, like the gradients' cat, sees one dtype: what torch's
        # batched CUDA kernels take; with mixed dtypes they may fall back to a launch per tensor.
        flat = master.detach().to(low[0].dtype)
        views = flat.split([p.numel() for p in low])
        torch._foreach_copy_(low, [v.view(p.shape) for v, p in zip(views, low, strict=True)])

    @torch.no_grad()
    def step(self, closure=None):
        """One mixed-precision AdamW step of the window's gradients (see the class)."""
        masters = self._masters()
        for master, low in zip(masters, self.low, strict=True):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in low]
            # One batched cat in the gradients' dtype, then one cast (see _copy_back). The bf16 gradients
            # go once gathered (DeepSpeed would drop them after the step): the step never holds more than
            # one bf16 and one fp32 copy of the gradients, what the planner counts for it.
            flat = torch.cat([g.reshape(-1) for g in grads])
            for p in low:
                p.grad = None
            del grads
            master.grad = flat.to(master.dtype)
            del flat
        norms = torch.stack([torch.linalg.vector_norm(m.grad) for m in masters])
        total = torch.linalg.vector_norm(norms)
        self._global_grad_norm = float(total)
        self.overflow = not math.isfinite(self._global_grad_norm)
        if not self.overflow:
            if self.max_grad_norm > 0:
                # ZeRO's clipping: scale by max_norm / (norm + 1e-6) when that is below 1.
                coef = (self.max_grad_norm / (total + 1e-6)).clamp(max=1.0)
                torch._foreach_mul_([m.grad for m in masters], coef)
            super().step()
        for master, low in zip(masters, self.low, strict=True):
            master.grad = None
            if not self.overflow:
                self._copy_back(master, low)
        return None

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state and the fp32 masters (bf16 weights alone would lose their low bits on resume)."""
        out = super().state_dict()
        out["masters"] = [m.detach() for m in self._masters()]
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """What state_dict wrote, or a checkpoint of DeepSpeed's FP16_UnfusedOptimizer (lorakit's ZeRO-0
        bf16 runs before this optimizer), whose per-tensor masters and AdamW state are flattened here."""
        if "fp32_groups" in state_dict:
            state_dict = _from_unfused(state_dict)
        state_dict = dict(state_dict)
        for master, saved, low in zip(self._masters(), state_dict.pop("masters"), self.low, strict=True):
            if saved.numel() != master.numel():
                raise ValueError(
                    f"checkpoint optimizer holds {saved.numel()} trainable values in a group, this model "
                    f"{master.numel()}: not the same trainable parameters"
                )
            master.copy_(saved)
            self._copy_back(master, low)
        super().load_state_dict(state_dict)


def _from_unfused(old: dict[str, Any]) -> dict[str, Any]:
    """An FP16_UnfusedOptimizer state dict (per-tensor fp32 masters and torch AdamW state) in
    MixedPrecisionAdamW's layout (one flat tensor per group)."""
    inner = old["optimizer_state_dict"]
    state, groups = {}, []
    for i, (group, fp32) in enumerate(zip(inner["param_groups"], old["fp32_groups"], strict=True)):
        per = [inner["state"].get(idx, {}) for idx in group["params"]]
        flat = {}
        for key in ("exp_avg", "exp_avg_sq"):
            flat[key] = torch.cat(
                [
                    s[key].reshape(-1) if key in s else torch.zeros_like(p).reshape(-1)
                    for s, p in zip(per, fp32, strict=True)
                ]
            )
        steps = [s["step"] for s in per if "step" in s]
        if steps:
            state[i] = {"step": steps[0].clone() if torch.is_tensor(steps[0]) else steps[0], **flat}
        groups.append({**group, "params": [i]})
    masters = [torch.cat([p.detach().reshape(-1).float() for p in fp32]) for fp32 in old["fp32_groups"]]
    return {"state": state, "param_groups": groups, "masters": masters}
