"""The router's load-balancing loss of mixture-of-experts models (Switch Transformer eqs. 4-6, as Mixtral,
Qwen3-MoE and OLMoE define it in transformers), computed by lorakit so that it is weighted like the token loss.

transformers adds `router_aux_loss_coef * aux` to the mean token loss of one forward, reading padding from a
2-D attention mask; lorakit's loss is a token-weighted sum over micro-batches and ranks, and its packed rows
carry 4-D masks or none. So the router logits are captured from the router modules during the forward
(`capture_router_logits`, forward hooks removed on exit: the backward's recomputation under activation
checkpointing does not capture again) and the loss is computed here over the real tokens of the batch.

For router logits z (tokens x experts) of every MoE layer, p = softmax(z), with N experts routed top-k:

    f_i = (top-k assignments to expert i over all layers and real tokens) / (layers x real tokens)
    P_i = (sum of p_i over all layers and real tokens) / (layers x real tokens)
    aux = N * sum_i f_i * P_i

f is a count (no gradient); the gradient flows through P into the router logits. The objective adds
`coef * aux * units` to a micro-batch's summed loss (units: its target tokens), which the loop divides by the
window's units on every rank: the aux loss is averaged over micro-batches and ranks with the token loss's
weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@contextmanager
def capture_router_logits(model: torch.nn.Module, router_classes: tuple[str, ...]) -> Iterator[list]:
    """A list that fills, during the forward run inside the block, with the router logits (the first output)
    of every module of `model` whose class name is in `router_classes`, in call order."""
    captured: list[torch.Tensor] = []

    def hook(_module, _args, output):
        captured.append(output[0] if isinstance(output, tuple) else output)

    handles = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__ in router_classes]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def load_balancing_loss(
    router_logits: list[torch.Tensor], num_experts: int, top_k: int, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The load-balancing loss (module docstring) of one forward: `router_logits`, one (tokens, experts)
    tensor per MoE layer; `token_mask`, 1 for the real tokens (flattened like the logits' rows), None: all."""
    if not router_logits:
        raise ValueError("load_balancing_loss: no router logits were captured")
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)
        mask = (
            torch.ones(p.shape[0], device=device)
            if token_mask is None
            else token_mask.reshape(-1).to(device=device, dtype=torch.float32)
        )
        chosen = torch.topk(p, top_k, dim=-1).indices
        counts = counts.scatter_add(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
        probs = probs + (p * mask[:, None]).sum(0)
        rows = rows + mask.sum()
    rows = rows.clamp_min(1.0)
    return num_experts * torch.sum((counts / rows) * (probs / rows))


def real_token_mask(batch: dict) -> torch.Tensor | None:
    """The real (not padding) tokens of a causal batch: its 2-D attention mask; None for packed rows,
    which hold real tokens only."""
    mask = batch.get("attention_mask")
    return mask if mask is not None and mask.dim() == 2 else None


@dataclass(frozen=True)
class RouterLoss:
    """The load-balancing loss of an MoE model: its router modules' classes, experts, top-k and the
    model's coefficient (config.router_aux_loss_coef)."""

    router_classes: tuple[str, ...]
    num_experts: int
    top_k: int
    coef: float

    def __call__(self, router_logits: list[torch.Tensor], batch: dict) -> torch.Tensor:
        """The loss of one forward's captured logits over `batch`'s real tokens."""
        return load_balancing_loss(router_logits, self.num_experts, self.top_k, real_token_mask(batch))


def router_loss_of(config) -> RouterLoss | None:
    """The load-balancing loss of a model of `config`: None for dense families and a zero coefficient."""
    from lorakit.model.families import family_of
    from lorakit.model.families.base import read

    moe = family_of(config).moe
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if moe is None or coef == 0.0:
        return None
    experts = int(read(config, "num_local_experts", "num_experts"))
    return RouterLoss(moe.router_classes, experts, int(read(config, "num_experts_per_tok")), coef)


class FixedRouting:
    """The top-k choices of every router call of one forward, recorded on the first forward run inside
    `applied` and forced on every later one (hooks on the router modules, removed on exit).

    What a check compares across two models of a routed family: bf16 rounding of merged weights moves router
    logits by a few ulps, which flips top-k choices at near-ties and sends a token through other experts,
    a difference of routing rather than of the weights checked. A forced call keeps the forward's own router
    logits and probabilities (softmax in fp32, gathered at the forced experts, renormalised as the router does:
    `norm_topk_prob`, Mixtral always), so the weights under test still decide every value."""

    def __init__(self, router_classes: tuple[str, ...]):
        self.router_classes = router_classes
        self.choices: list[torch.Tensor] | None = None

    @contextmanager
    def applied(self, model: torch.nn.Module) -> Iterator[None]:
        """Record (first use) or force (every later use) the routing of the forwards run inside the block."""
        recording = self.choices is None
        choices: list[torch.Tensor] = [] if recording else self.choices
        calls = [0]

        def hook(module, _args, output):
            logits, scores, indices = output
            if recording:
                choices.append(indices.detach().clone())
                return None
            if calls[0] >= len(choices):
                raise RuntimeError(f"FixedRouting: more router calls than the {len(choices)} recorded")
            forced = choices[calls[0]].to(indices.device)
            calls[0] += 1
            top = torch.softmax(logits.float(), dim=-1).gather(-1, forced)
            if getattr(module, "norm_topk_prob", True):
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(scores.dtype), forced

        handles = [
            m.register_forward_hook(hook) for m in model.modules() if type(m).__name__ in self.router_classes
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        if recording:
            self.choices = choices
        elif calls[0] != len(choices):
            raise RuntimeError(f"FixedRouting: {calls[0]} router calls, {len(choices)} recorded")

    def describe(self) -> str:
        """Words for a check's line."""
        return "routing fixed (the adapter model's top-k experts forced on every forward)"


def fixed_routing_for(config) -> FixedRouting | None:
    """A FixedRouting for a model of `config` when its family routes tokens to experts, else None."""
    from lorakit.model.families import family_of

    moe = family_of(config).moe
    return None if moe is None else FixedRouting(moe.router_classes)
