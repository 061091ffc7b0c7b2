"""How generating uses sharded weights (distributed.gather_for_generation), as the plan counts it.

Evaluation's predictions (eval.generate), GRPO's rollouts (grpo.rollout_engine engine) and GRPO's eval
completions run transformers' generate on the Engine's weights (docs/backends.md#generation). Sharded over
N ranks (ZeRO-3, FSDP2) they go one of two ways:

    gathered        every weight gathered whole once per generate call and held until it returns: the rank
                    holds its resident states, the whole weights (a new tensor each: its own share stays
                    too) and what the generation itself holds (GRPO: the rollouts' KV cache and logits; eval
                    predictions' KV cache is not modelled)
    layer by layer  each decoding step's forward gathers the layers again, as training's forward does (the
                    forward's gathered weights)

true gathers, false goes layer by layer, auto (the default) gathers when what gathering adds on a rank,
every sharded weight whole (a new buffer beside the rank's own share), fits in GATHER_SHARE of the memory
free on the device at that moment (the runtime's rule, lorakit.backends.base.gather_fits). The plan takes as free the
capacity less the framework's share (CUDA context; a CPU run's process) and the resident states: what the
first generate call finds. Without a capacity, auto is counted as gathering, the conservative answer.
The whole model includes the small parameters ZeRO-3 already keeps whole on every rank (below
stage3_param_persistence_threshold), which gathering leaves alone: tens of MB counted twice at most.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lorakit.backends.base import GATHER_SHARE, gather_fits
from lorakit.planner.states import Item, Setup, counts
from lorakit.units import format_bytes

GATHERED, LAYER_BY_LAYER, WHOLE = "gathered", "layer_by_layer", "whole"


@dataclass(frozen=True)
class Generation:
    """What generating does with the weights on one rank of a setup."""

    moments: tuple[str, ...]  # what generates: GRPO rollouts, eval predictions, eval completions
    setting: bool | str  # distributed.gather_for_generation
    sharded: bool  # ZeRO-3, FSDP2: generation gathers the weights, whole or layer by layer
    sharded_over: int  # the ranks they are sharded over
    whole_bytes: int  # every weight whole, as generate reads it (model.dtype; a 4-bit base packed)
    free_bytes: int | None  # free on the device when generation starts; None: capacity unknown
    gathers: bool
    # Allocated while generating: resident states, the weights generation holds, GRPO's rollouts (KV cache,
    # logits; eval predictions' KV cache is not modelled). Set by the estimate.
    peak_bytes: int = 0

    @property
    def adds_bytes(self) -> int:
        """What the runtime's auto rule weighs: every weight whole (gathered into a buffer of its own, beside
        the rank's share)."""
        return self.whole_bytes

    @property
    def mode(self) -> str:
        """gathered, layer_by_layer, or whole (nothing sharded)."""
        if not self.sharded:
            return WHOLE
        return GATHERED if self.gathers else LAYER_BY_LAYER

    def item(self) -> Item:
        """The breakdown's line for the gathered weights (mode gathered only)."""
        return Item("whole model gathered for generation", self.whole_bytes, "gpu", "generate",
                    "every weight, once per generate call", kind="generation")  # fmt: skip

    def why(self) -> str:
        """Why generation goes the way it does."""
        if self.setting != "auto":
            return f"distributed.gather_for_generation {str(self.setting).lower()}"
        if self.free_bytes is None:
            return ("distributed.gather_for_generation auto with the GPU memory unknown: counted as gathering, "
                    "the conservative answer (give --gpu-memory for the runtime's rule)")  # fmt: skip
        verb = "fits in" if self.gathers else "exceeds"
        return (f"distributed.gather_for_generation auto: what gathering adds ({format_bytes(self.adds_bytes)}, "
                f"every weight whole) {verb} {GATHER_SHARE:.0%} of the {format_bytes(self.free_bytes)} "
                "free beside the resident states")  # fmt: skip

    def note(self) -> str | None:
        """The plan's line on generation; None when nothing is sharded."""
        if self.mode == WHOLE:
            return None
        what = f"generation ({', '.join(self.moments)})"
        kv = ", eval's KV cache not counted" if "eval predictions" in self.moments else ""
        peak = f"; {format_bytes(self.peak_bytes)} allocated while generating{kv}"
        if self.gathers:
            return (f"{what} gathers the whole model ({format_bytes(self.whole_bytes)}) once per generate call, "
                    f"beside the resident states: {self.why()}{peak}")  # fmt: skip
        return (
            f"{what} goes layer by layer (each decoding step gathers every layer again): {self.why()}{peak}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (an estimate's `generation`)."""
        return {
            "mode": self.mode,
            "moments": list(self.moments),
            "setting": self.setting,
            "sharded_over": self.sharded_over,
            "whole_bytes": self.whole_bytes,
            "adds_bytes": self.adds_bytes,
            "free_bytes": self.free_bytes,
            "gathered_bytes": self.whole_bytes if self.mode == GATHERED else 0,
            "peak_bytes": self.peak_bytes,
            "why": self.why() if self.mode != WHOLE else "the weights are whole on every rank",
        }


def generation_moments(recipe) -> tuple[str, ...]:
    """What generates on the Engine's weights during a run of `recipe`: GRPO's rollouts (unless vLLM
    generates them) and eval completions, or eval.generate's predictions."""
    grpo = getattr(recipe, "grpo", None) if recipe.train.objective == "grpo" else None
    if grpo is not None:
        rollouts = ("GRPO rollouts",) if grpo.rollout_engine == "engine" else ()
        return rollouts + (("eval completions",) if recipe.eval_active() else ())
    return ("eval predictions",) if recipe.eval_active() and recipe.eval.generate else ()


def planned_generation(recipe, arch, dtype_bytes: int, setup: Setup, world: int,
                       free: int | None) -> Generation | None:  # fmt: skip
    """How `recipe` generates under `setup` on `world` ranks with `free` bytes free beside the resident
    states (None: capacity unknown); None when nothing generates. The weights are sharded under ZeRO-3 and
    FSDP2 (planned as ZeRO-3) over the world (FSDP2's hybrid sharding over a shard group)."""
    moments = generation_moments(recipe)
    if not moments:
        return None
    c = counts(arch, recipe.method, dtype_bytes, None)
    whole = c.frozen_bytes + c.trainable * dtype_bytes
    sharded, setting = setup.zero_stage == 3, recipe.distributed.gather_for_generation
    g = Generation(moments, setting, sharded, world if sharded else 1, whole, free, gathers=False)
    if not sharded or setting is False:
        return g
    gathers = setting is True or free is None or gather_fits(g.adds_bytes, free)
    return replace(g, gathers=gathers)


LAYER_BY_LAYER_OVERRIDE = "distributed.gather_for_generation=false"


def generation_ways(recipe, generation: Generation | None) -> list[tuple[Any, list[str]]]:
    """The recipes the recommendation tries, in order, with the overrides each adds: `recipe` as written,
    then, when it generates (`generation`) and may gather the whole model for it, the same generating layer
    by layer (slower, but it never holds more than a forward's weights)."""
    ways: list[tuple[Any, list[str]]] = [(recipe, [])]
    if generation is not None and generation.setting is not False:
        d = recipe.distributed.model_copy(update={"gather_for_generation": False})
        ways.append((recipe.model_copy(update={"distributed": d}), [LAYER_BY_LAYER_OVERRIDE]))
    return ways
