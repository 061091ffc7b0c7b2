"""The recipe's method section: LoRA and its variants, QLoRA, IA3 or full fine-tuning (docs/methods.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lorakit.recipe.section import Section


class MethodSection(Section):
    """What is trained: a peft adapter (LoRA on a base in model.dtype or in 4 bits, or IA3) or every
    parameter. See docs/methods.md."""

    kind: Literal["lora", "qlora", "full", "ia3"] = Field(
        "lora",
        description="lora: train a LoRA adapter on the frozen base, kept in model.dtype; qlora: the same on "
        "a base quantized to 4 bits (bitsandbytes NF4, double quantization, compute and storage in "
        'model.dtype; needs pip install "lorakit[qlora]"), for when GPU memory is short; full: train every '
        "weight; ia3: train IA3 scaling vectors (peft's IA3Config), far fewer weights than LoRA.",
    )
    quant_type: Literal["nf4", "fp4"] | None = Field(
        None,
        description="kind qlora: the 4-bit data type of the base. null means nf4 (NormalFloat4, the QLoRA "
        "paper's choice); fp4 is plain 4-bit float. Only kind qlora quantizes: set with full or lora it is "
        "an error.",
    )
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (the update is scaled by alpha / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear",
        description="Modules that get the adapter: `all-linear` (LoRA: every linear layer but the output "
        "head; ia3: peft's IA3 defaults for the architecture, e.g. T5 k, v, wo and Llama k_proj, v_proj, "
        "down_proj) or a list of module-name suffixes such as [q, k, v, o].",
    )
    use_dora: bool = Field(
        False,
        description="LoRA, qlora: DoRA (peft use_dora), a LoRA direction plus a trained magnitude per output "
        "feature of each adapted layer.",
    )
    use_rslora: bool = Field(
        False,
        description="LoRA, qlora: rank-stabilized LoRA (peft use_rslora), scaling the update by "
        "alpha / sqrt(r) instead of alpha / r.",
    )
    init: Literal["default", "pissa", "olora", "gaussian"] = Field(
        "default",
        description="LoRA: how the adapter starts (peft init_lora_weights). default: B = 0; gaussian: A "
        "Gaussian, B = 0; pissa / olora: A and B from the base weight's principal singular vectors / a QR "
        "decomposition, subtracted from the base. The saved adapter is converted to a plain LoRA adapter of "
        "rank 2r on the original base (docs/methods.md), so it loads and merges like any other.",
    )
    lr_ratio_b: float | None = Field(
        None,
        gt=0,
        description="LoRA+: the lora_B matrices (and 1-D trainable weights, as peft's LoRA+ groups them) "
        "train at train.lr x this ratio, through their own optimizer parameter group; null: one learning "
        "rate. The LoRA+ paper suggests 16.",
    )
    modules_to_save: list[str] | None = Field(
        None,
        description="Adapters: modules trained in full next to the adapter and saved with it (peft "
        "modules_to_save), e.g. [embed_tokens, lm_head] for an extended vocabulary.",
    )
    train_router: bool = Field(
        False,
        description="LoRA, qlora on a mixture-of-experts model (Mixtral, Qwen3-MoE, OLMoE): also adapt the "
        "router's weight (peft's LoRA on it). false keeps the router frozen, as routing was pretrained; "
        "its load-balancing loss still trains what feeds it (docs/moe.md).",
    )
    feedforward_modules: list[str] | None = Field(
        None,
        description="kind ia3: the target modules whose input (not output) is scaled, a subset of "
        "target_modules; null: peft's defaults with target_modules all-linear, else none.",
    )

    @model_validator(mode="after")
    def _check(self) -> MethodSection:
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError("method.target_modules: give at least one module name, or `all-linear`")
        if self.quant_type is not None and self.kind == "full":
            raise ValueError(
                "method.quant_type: full fine-tuning cannot train a 4-bit base (bitsandbytes' 4-bit weights "
                "are frozen, and full has no adapter to train on top of them); use method.kind: qlora, or "
                "remove method.quant_type"
            )
        if self.quant_type is not None and self.kind == "ia3":
            raise ValueError(
                "method.quant_type: kind ia3 keeps the base in model.dtype (lorakit quantizes the base for a "
                "LoRA adapter only); use method.kind: qlora, or remove method.quant_type"
            )
        if self.quant_type is not None and self.kind == "lora":
            raise ValueError(
                "method.quant_type: kind lora keeps the base in model.dtype: remove method.quant_type "
                "(method.quant_type=null on the command line), or use method.kind: qlora for a 4-bit base"
            )
        if not self.lora():
            for name in self._lora_options_set():
                raise ValueError(
                    f"method.{name}: a LoRA option, and kind {self.kind} trains no LoRA adapter; use kind "
                    "lora or qlora, or remove it"
                )
        if self.modules_to_save is not None and (self.kind == "full" or not self.modules_to_save):
            raise ValueError(
                "method.modules_to_save: kind full trains every module already"
                if self.kind == "full"
                else "method.modules_to_save: give at least one module name, or null"
            )
        if self.feedforward_modules is not None and self.kind != "ia3":
            raise ValueError("method.feedforward_modules: only kind ia3 scales feedforward inputs")
        if self.feedforward_modules is not None and not (
            isinstance(self.target_modules, list)
            and set(self.feedforward_modules) <= set(self.target_modules)
        ):
            raise ValueError(
                "method.feedforward_modules: must be a subset of a method.target_modules list (with all-linear "
                "peft picks both for the architecture)"
            )
        self._check_combinations()
        return self

    def _lora_options_set(self) -> list[str]:
        options = {"use_dora": self.use_dora, "use_rslora": self.use_rslora, "lr_ratio_b": self.lr_ratio_b}
        named = [name for name, value in options.items() if value]
        return named + (["init"] if self.init != "default" else [])

    def _check_combinations(self) -> None:
        """What peft cannot do, found by trying (tests/unit/test_methods.py shows the failure)."""
        if self.kind == "qlora" and self.init == "pissa":
            # peft's pissa_init decomposes the weight tensor as it finds it: a 4-bit weight stored as uint8 is
            # refused (TypeError), and one stored in model.dtype (lorakit's quant storage) is the packed 4-bit
            # bytes read as numbers: the SVD fails on non-finite values. olora_init dequantizes first.
            raise ValueError(
                "method.init: pissa decomposes the base weights, which peft cannot do on a 4-bit base; use kind "
                "lora, or init olora / default / gaussian"
            )

    def adapter(self) -> bool:
        """Whether the method trains a peft adapter (lora, qlora, ia3) rather than every weight (full)."""
        return self.kind in ("lora", "qlora", "ia3")

    def lora(self) -> bool:
        """Whether the adapter is LoRA (lora, qlora), the kind the LoRA options (DoRA, rsLoRA, init, LoRA+)
        apply to."""
        return self.kind in ("lora", "qlora")

    def mutates_base(self) -> bool:
        """Whether the adapter's init rewrites the base weights (pissa, olora): its saved form is converted."""
        return self.init in ("pissa", "olora")

    def options(self) -> list[str]:
        """The options set on the method, as comparisons label runs: dora, rslora, pissa, lora+ x16, ..."""
        named = [name for name, on in (("dora", self.use_dora), ("rslora", self.use_rslora)) if on]
        named += [self.init] if self.init != "default" else []
        named += [f"lora+ x{self.lr_ratio_b:g}"] if self.lr_ratio_b else []
        named += [f"full {','.join(self.modules_to_save)}"] if self.modules_to_save else []
        return named

    def quantization(self) -> str | None:
        """The base's 4-bit data type (nf4, fp4), or None when the base is not quantized."""
        if self.kind != "qlora":
            return None
        return self.quant_type or "nf4"
