"""Whether the experts really train: after the first step, how many expert adapters received a gradient.

LoRA on fused experts is peft's parameter LoRA (ParamWrapper): its weights reach the loss only when the
experts' forward goes through the wrapper. A path that reads the fused parameter directly (another experts
implementation, a kernel, a wrapper lost on the way) trains nothing on the experts while the loss still falls
through attention: a silent failure peers shipped. So the run reads the gradient of every expert adapter's
lora_B (at step 1 lora_A's gradient is zero, since B starts at zero) and, after the first optimizer step,
counts the experts whose columns of it are non-zero on any rank. It says the count in one line; zero is an
error (exit 2) before a second step is spent.

Where the gradient is read: a plain parameter (one process, DeepSpeed's every ZeRO stage) by a hook on its
gradient as autograd computes it. A sharded DTensor parameter (FSDP2) never takes part in autograd: FSDP2
reduce-scatters the gradient of the gathered weight into the shard's `.grad` itself, once per accumulation
window, and then runs the shard's post-accumulate-grad hooks (torch >= 2.5; FSDP2 needs 2.6). So there the
hook is one of those, reading this rank's rows of the window's reduced gradient, before clipping and the
optimizer: the gradient itself, not the update (an update can move a weight with no gradient: weight decay
on a B that starts non-zero, as PiSSA's and OLoRA's do).

peft's layout of an E-expert stack's lora_B (out x r*E) is rank-major: expert e's columns are r_i * E + e
(ParamWrapper.get_delta_weight reshapes it to out x r x E). FSDP2 shards dim 0, so each rank holds every
column of some rows (or of none, when there are fewer rows than ranks).
"""

from __future__ import annotations

import torch

from lorakit.errors import LorakitError


class ExpertsNotTrainingError(LorakitError):
    """No expert adapter received a gradient in the first step: the experts' LoRA is not in the computation."""


def expert_columns(rows: torch.Tensor, experts: int) -> torch.Tensor:
    """Which of the `experts` experts have a non-zero entry in `rows`: whole rows (any number, none too) of an
    E-expert stack's lora_B or of its gradient (out x r*E, expert e's columns r_i * E + e); bool, on CPU."""
    return rows.detach().ne(0).any(0).reshape(-1, experts).any(0).cpu()


def _whole_rows(weight) -> bool:
    """Whether each rank's local tensor of the DTensor `weight` holds whole rows: sharded on dim 0 (FSDP2's
    placement) or replicated (hybrid sharding's replica dimension)."""
    return all(p.is_replicate() or p.is_shard(0) for p in weight.placements)


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
                i = len(self.stacks)
                self.stacks.append((f"{name}.{module.parameter_name}.{adapter}", module.num_experts))
                self.seen.append(torch.zeros(module.num_experts, dtype=torch.bool))
                if hasattr(weight, "to_local"):
                    # FSDP2: no autograd hook on a sharded parameter fires; FSDP2 runs these after its reduce.
                    hook = self._sharded_hook(i, module.num_experts, _whole_rows(weight))
                    self.handles.append(weight.register_post_accumulate_grad_hook(hook))
                else:
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

    def _sharded_hook(self, i: int, experts: int, whole_rows: bool):
        def record(param: torch.Tensor) -> None:
            if param.grad is None:
                return
            local = param.grad.to_local()
            if whole_rows:
                hit = expert_columns(local, experts)
            else:
                # Some columns only (a placement other than FSDP2's): any non-zero counts for every expert.
                hit = local.detach().ne(0).any().expand(experts).cpu()
            self.seen[i] = self.seen[i] | hit

        return record

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
