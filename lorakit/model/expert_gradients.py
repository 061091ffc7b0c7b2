"""Whether the experts really train: after the first step, how many expert adapters received a gradient.

LoRA on fused experts is peft's parameter LoRA (ParamWrapper): its weights reach the loss only when the
experts' forward goes through the wrapper. A path that reads the fused parameter directly (another experts
implementation, a kernel, a wrapper lost on the way) trains nothing on the experts while the loss still falls
through attention: a silent failure peers shipped. So the run hooks the gradient of every expert adapter's
lora_B (at step 1 lora_A's gradient is zero, since B starts at zero) and, after the first optimizer step,
counts the experts whose slice of it is non-zero on any rank. It says the count in one line; zero is an error
(exit 2) before a second step is spent.

peft's layout of an E-expert stack's lora_B (out x r*E) is rank-major: expert e's columns are r_i * E + e
(ParamWrapper.get_delta_weight reshapes it to out x r x E).
"""

from __future__ import annotations

import torch

from lorakit.errors import LorakitError


class ExpertsNotTrainingError(LorakitError):
    """No expert adapter received a gradient in the first step: the experts' LoRA is not in the computation."""


class ExpertGradientProbe:
    """Gradient hooks on the expert adapters of `model` (peft ParamWrappers of more than one expert), until
    `finish()`."""

    def __init__(self, model: torch.nn.Module):
        from peft.tuners.lora.layer import ParamWrapper

        self.stacks: list[tuple[str, int]] = []
        self.seen: list[torch.Tensor] = []
        self.handles = []
        for name, module in model.named_modules():
            if not isinstance(module, ParamWrapper) or module.num_experts <= 1:
                continue
            for adapter, linear in module.lora_B.items():
                weight = linear.weight
                if not weight.requires_grad:
                    continue
                if hasattr(weight, "to_local"):
                    # FSDP2: the sharded parameter's gradient is assigned by its reduce-scatter, not computed
                    # by autograd, so a hook on it would never fire: no probe (docs/moe.md says so).
                    self.remove()
                    return
                i = len(self.stacks)
                self.stacks.append((f"{name}.{module.parameter_name}.{adapter}", module.num_experts))
                self.seen.append(torch.zeros(module.num_experts, dtype=torch.bool))
                self.handles.append(weight.register_hook(self._hook(i, module.num_experts)))

    def _hook(self, i: int, experts: int):
        def record(grad: torch.Tensor) -> None:
            if grad.numel() % experts:
                # Not the stack's whole gradient (a partition): any non-zero element counts for every expert.
                hit = (grad != 0).any().expand(experts)
            else:
                hit = grad.detach().reshape(-1, experts).ne(0).any(0)
            self.seen[i] = self.seen[i] | hit.cpu()

        return record

    def remove(self) -> None:
        """Remove the hooks and forget the stacks (a probe that cannot count)."""
        for h in self.handles:
            h.remove()
        self.handles, self.stacks, self.seen = [], [], []

    def __bool__(self) -> bool:
        return bool(self.stacks)

    def finish(self) -> tuple[int, int]:
        """Remove the hooks and return (experts with a gradient on any rank, expert adapters), the same on
        every rank (one all_reduce: every rank calls it)."""
        from lorakit import dist

        for h in self.handles:
            h.remove()
        self.handles = []
        flags = [float(x) for s in self.seen for x in s.tolist()]
        hit = dist.all_reduce(flags, op="max") if flags else []
        return int(sum(hit)), len(flags)

    def check(self, say) -> tuple[int, int]:
        """finish(), then `say` the line; ExpertsNotTrainingError (exit 2) when no expert got a gradient."""
        got, total = self.finish()
        layers = len(self.stacks)
        line = (
            f"experts: {got:,} of {total:,} expert adapters ({layers} fused stacks) received gradients in "
            "the first step"
        )
        if total and got == 0:
            raise ExpertsNotTrainingError(
                f"{line}: the experts' LoRA is not in the computation (the experts' forward does not go "
                "through peft's parameter wrapper), so they would not train; leave the experts out of "
                "method.target_modules or report this with the model and versions"
            )
        if total and got < total:
            line += " (an expert no token of the step was routed to gets none)"
        say(line)
        return got, total
