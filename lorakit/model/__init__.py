"""Model: loading, attention backend choice, LoRA and gradient checkpointing.

Names are imported on first use: `lorakit.model.source` (config and tokenizer, what the launcher and
`lorakit.prepare` need) loads without peft and the modeling code that `lorakit.model.build` imports.
"""

from lorakit.lazy import lazy_names

__all__, __getattr__ = lazy_names(
    __name__,
    {
        "lorakit.model.build": ("BuiltModel", "build_model", "count_parameters"),
        "lorakit.model.load_plan": ("LoadPlan",),
        "lorakit.model.source": ("load_config", "load_tokenizer"),
    },
)
