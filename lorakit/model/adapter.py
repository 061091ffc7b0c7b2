"""The recipe's method as peft's own config (LoraConfig or IA3Config), and LoRA+'s optimizer groups.

Nothing here reimplements peft: DoRA, rsLoRA, PiSSA / OLoRA / Gaussian init, modules_to_save and IA3 are
peft options; LoRA+ groups are peft's `create_loraplus_optimizer` grouping, handed to DeepSpeed as
parameter groups instead of an optimizer (DeepSpeed builds the optimizer from the ds_config).
"""

from __future__ import annotations

from typing import Any

from lorakit.recipe.schema import MethodSection

# method.init -> peft's init_lora_weights.
_INIT = {"default": True, "gaussian": "gaussian", "pissa": "pissa", "olora": "olora"}


def _task_type(is_encoder_decoder: bool):
    from peft import TaskType

    return TaskType.SEQ_2_SEQ_LM if is_encoder_decoder else TaskType.CAUSAL_LM


def peft_config(method: MethodSection, is_encoder_decoder: bool, family=None, model=None):
    """The peft config for the recipe's method section: LoraConfig (lora, qlora) or IA3Config (ia3).

    For a mixture-of-experts `family` (lorakit.model.families.moe) the fused experts (and, with
    method.train_router, the router) are peft `target_parameters`, and all-linear becomes the names of
    `model`'s linear layers: given as "all-linear", peft 0.21 would rewrite it for transformers 5's fused MoE
    layout itself, adapting the router and doubling the experts' rank (peft.utils.transformers_weight_conversion)."""
    # A multimodal checkpoint's vision tower and projector stay out of a text adapter unless the recipe
    # names them (lorakit.model.families.multimodal).
    exclude = _towers_pattern(method, model)
    if method.kind == "ia3":
        from peft import IA3Config

        listed = isinstance(method.target_modules, list)
        return IA3Config(
            # None: peft's IA3 defaults for the architecture (targets and feedforward modules together).
            target_modules=method.target_modules if listed else None,
            exclude_modules=exclude,
            feedforward_modules=method.feedforward_modules or ([] if listed else None),
            modules_to_save=method.modules_to_save,
            task_type=_task_type(is_encoder_decoder),
        )
    from peft import LoraConfig

    target_modules, target_parameters = _moe_targets(method, family, model)
    return LoraConfig(
        r=method.r,
        lora_alpha=method.alpha,
        # peft's parameter LoRA refuses any dropout, and one config is all it takes: with fused targets the
        # linear layers' dropout is set after peft builds them (apply_linear_dropout).
        lora_dropout=0.0 if target_parameters else method.dropout,
        target_modules=target_modules,
        target_parameters=target_parameters,
        exclude_modules=exclude,
        use_dora=method.use_dora,
        use_rslora=method.use_rslora,
        init_lora_weights=_INIT[method.init],
        modules_to_save=method.modules_to_save,
        task_type=_task_type(is_encoder_decoder),
    )


def _towers_pattern(method: MethodSection, model) -> str | None:
    """peft's exclude_modules for the towers of `model`'s checkpoint that the adapter leaves alone."""
    if model is None:
        return None
    from lorakit.model.families.multimodal import exclude_pattern, towers_left_alone

    return exclude_pattern(towers_left_alone(model.config, method.target_modules))


def _moe_targets(method: MethodSection, family, model) -> tuple[Any, list[str] | None]:
    """(target_modules, target_parameters) for peft: the recipe's own for dense families; for MoE ones,
    the linear layers by name (module docstring) and the fused parameters the method adapts."""
    moe = getattr(family, "moe", None)
    if moe is None:
        return method.target_modules, None
    import torch

    from lorakit.model.families.moe import EXPERTS, parameter_targets

    fused = {t.rsplit(".", 1)[-1] for t in moe.experts}
    if method.target_modules == "all-linear":
        head = model.get_output_embeddings()
        modules = sorted({
            n.rsplit(".", 1)[-1] for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m is not head
        })  # fmt: skip
    else:
        modules = [t for t in method.target_modules if t != EXPERTS and t not in fused]
    return modules, list(parameter_targets(moe, method)) or None


def apply_linear_dropout(model, method: MethodSection) -> int:
    """method.dropout on the adapters of a model whose LoraConfig had to say 0 (fused MoE parameters among
    its targets: peft's ParamWrapper cannot drop its input): each LoRA layer that is not a parameter wrapper
    gets the nn.Dropout peft's own update_layer would have given it. Returns how many layers got it.

    The entry replaced is peft's per-adapter dropout module, which peft reads at every forward: configuration
    of the layer, not a patch of its code. The saved adapter_config.json keeps lora_dropout 0, which is what
    peft needs to load it back (dropout does not act at inference)."""
    if not getattr(method, "dropout", 0) or method.kind not in ("lora", "qlora"):
        return 0
    import torch
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    changed = 0
    for module in model.modules():
        if isinstance(module, LoraLayer) and not isinstance(module, ParamWrapper):
            for name, drop in module.lora_dropout.items():
                if isinstance(drop, torch.nn.Identity):
                    module.lora_dropout[name] = torch.nn.Dropout(p=method.dropout)
                    changed += 1
    return changed


def optimizer_groups(model, method: MethodSection, lr: float, weight_decay: float) -> list[Any]:
    """The optimizer's parameters: the trainable parameters, or with method.lr_ratio_b LoRA+'s groups
    (lora_B and 1-D weights at lr x ratio), each group with its own `lr`.

    peft's create_loraplus_optimizer sorts the parameters and calls `optimizer_cls(groups, **kwargs)`; the
    callable given here returns the groups, since the backend builds the optimizer (DeepSpeed from its
    config's AdamW; at ZeRO-0 in bf16 and on FSDP2, lorakit), and a LambdaLR scales each group's own lr."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not method.lr_ratio_b:
        return trainable
    from peft.optimizers import create_loraplus_optimizer

    def groups_only(groups: list[dict[str, Any]], **_: Any) -> list[dict[str, Any]]:
        # DeepSpeed's ZeRO optimizers cannot hold an empty group (no embedding LoRA here is the usual case).
        return [g for g in groups if g["params"]]

    return create_loraplus_optimizer(
        model,
        groups_only,
        lr=lr,
        loraplus_lr_ratio=method.lr_ratio_b,
        loraplus_weight_decay=weight_decay,
        # LoRA on embeddings trains at train.lr (peft's default is 1e-6), as it would without LoRA+.
        loraplus_lr_embedding=lr,
    )
