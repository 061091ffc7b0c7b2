"""What the mixture-of-experts families (Mixtral, Qwen3-MoE, OLMoE) share.

In transformers 5 each of them has one layout: a decoder layer's `mlp` is a sparse MoE block holding a router
(`mlp.gate`, a module with a (experts, hidden) `weight`, not an nn.Linear) and the experts fused into two 3-D
parameters (`mlp.experts.gate_up_proj`: experts x 2*ffn x hidden, `mlp.experts.down_proj`: experts x hidden
x ffn). LoRA reaches the fused experts through peft's parameter targeting (`target_parameters`, peft's
ParamWrapper: rank r per expert on each fused tensor), which cannot apply dropout: method.dropout applies to
the linear layers' adapters only (lorakit.model.adapter.apply_linear_dropout). The router stays frozen
unless the recipe sets `method.train_router` (then peft's LoRA adapts its weight too). ZeRO-3 gathers each MoE
block whole (a leaf module): which experts a rank's tokens reach differs between ranks, and per-expert
gathers would leave ranks waiting on collectives the others never enter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from lorakit.model.families.base import Experts, Family, MoeLayout, Shape, Tiny, dense_decoder_mlp, read
from lorakit.model.families.decoder import CAUSAL_PACKING, decoder_shape

EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
ROUTER_WEIGHT = "mlp.gate.weight"
# A target_modules entry naming the experts as a whole (besides their parameters' own names).
EXPERTS = "experts"


def moe_shape(config, linear_names: Sequence[str]) -> Shape:
    """decoder_shape with the experts: how many (num_local_experts or num_experts), how many each token is
    routed to (num_experts_per_tok) and one expert's intermediate size (moe_intermediate_size, else
    intermediate_size). The experts are SwiGLU (gate and up fused), whatever the linear layers' names."""
    experts = Experts(
        count=int(read(config, "num_local_experts", "num_experts")),
        active=int(read(config, "num_experts_per_tok")),
        ffn=int(read(config, "moe_intermediate_size", "intermediate_size")),
    )
    return replace(decoder_shape(config, linear_names), gated_mlp=True, experts=experts)


def moe_family(name: str, tiny: Tiny, block: str, router: str) -> Family:
    """An MoE decoder-only family: causal packing (the router and experts are token-wise), the tiled loss
    (logits are lm_head's output) and the tiled MLP on dense MLP layers only, the MoE block (`block`, a class
    name) a ZeRO-3 leaf, and its router class (`router`) for the load-balancing loss."""
    layout = MoeLayout(experts=EXPERT_PARAMETERS, router=ROUTER_WEIGHT, router_classes=(router,))
    return Family(
        name,
        (name,),
        encoder_decoder=False,
        shape=moe_shape,
        packed=CAUSAL_PACKING,
        tiled_loss=True,
        tiled_mlp=dense_decoder_mlp,
        zero3_leaf_modules=(block,),
        tiny=tiny,
        moe=layout,
    )


def parameter_targets(moe: MoeLayout | None, method) -> tuple[str, ...]:
    """The fused parameters peft adapts for a LoRA method section (its target_parameters): the experts when
    target_modules is all-linear or names them (`experts`, or a fused parameter's name such as
    gate_up_proj), and the router's weight with method.train_router. Empty for dense families."""
    if moe is None or method.kind not in ("lora", "qlora"):
        return ()
    listed = method.target_modules if isinstance(method.target_modules, list) else None
    experts = tuple(
        p for p in moe.experts if listed is None or EXPERTS in listed or p.rsplit(".", 1)[-1] in listed
    )
    return experts + ((moe.router,) if method.train_router else ())


def check_method(family: Family, method) -> None:
    """Exit 2 before any weight loads when the method cannot adapt this MoE family's fused parameters:
    peft's parameter LoRA has no DoRA, and one LoraConfig gives every adapter the same. (It has no dropout
    either: method.dropout applies to the linear layers' adapters only, and `describe` says so.)"""
    targets = parameter_targets(family.moe, method)
    if not targets:
        if getattr(method, "train_router", False) and family.moe is None and method.kind != "full":
            from lorakit.errors import RecipeError

            raise RecipeError(f"method.train_router: {family.name!r} models have no MoE router")
        return
    from lorakit.errors import RecipeError

    where = f"{family.name} trains LoRA on its fused {', '.join(t.rsplit('.', 1)[-1] for t in targets)}"
    if method.use_dora:
        raise RecipeError(f"method.use_dora: {where} through peft's parameter targeting, which has no DoRA")


def describe(family: Family, method, config) -> str | None:
    """The run's sentence on what trains in an MoE model and its load-balancing loss (None: dense)."""
    if family.moe is None:
        return None
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    aux = f"the router's load-balancing loss x {coef:g} (config.router_aux_loss_coef) added, token-weighted"
    if method.kind == "full":
        return f"{family.name} (MoE): every weight trains, router included; {aux}"
    targets = parameter_targets(family.moe, method)
    experts = [t.rsplit(".", 1)[-1] for t in targets if t != family.moe.router]
    what = f"LoRA on the fused experts ({', '.join(experts)}, no dropout)" if experts else "experts frozen"
    router = "LoRA on the router" if family.moe.router in targets else "the router frozen"
    line = f"{family.name} (MoE): {what}, {router} (method.train_router); {aux}"
    drop = dropout_note(family.moe, method)
    return f"{line}; {drop}" if drop else line


def dropout_note(moe: MoeLayout | None, method) -> str | None:
    """What method.dropout does when the method adapts fused parameters (peft's parameter LoRA cannot drop
    its input): None when there is no dropout or nothing fused is adapted."""
    if not getattr(method, "dropout", 0) or not parameter_targets(moe, method):
        return None
    return (
        f"LoRA dropout {method.dropout:g} on the linear layers' adapters, none on the fused experts "
        "(peft's parameter LoRA cannot apply it)"
    )


def tiny_moe(config_cls: str, model_cls: str, **moe: Any) -> Tiny:
    """The Tiny builder of an MoE family: the causal tiny fields with `moe` (experts, top-k), and router
    weights redrawn with a visible spread (some transformers versions start routers at zero, which routes
    every token by index ties)."""
    from lorakit.model.families.decoder import causal_tiny

    dense = causal_tiny(config_cls, model_cls, tie_word_embeddings=False, **moe)

    def model(cfg):
        import torch

        built = dense.model(cfg)
        with torch.no_grad():
            for name, p in built.named_parameters():
                if name.endswith(ROUTER_WEIGHT):
                    torch.nn.init.normal_(p, std=cfg.hidden_size**-0.5)
        return built

    return Tiny(tokenizer="causal", config=dense.config, model=model, reshapable=True)
