"""Text fine-tuning of a multimodal checkpoint (Gemma 3 4B and up: Gemma3ForConditionalGeneration, a SigLIP
vision tower and a projector beside the language model): lorakit's data is text, so the adapter goes on the
language model only, unless the recipe names a tower in method.target_modules.

`all-linear` (or a suffix list such as [q_proj, v_proj], which SigLIP's attention shares) would otherwise put
LoRA on the vision tower too: memory for nothing, and an image path changed that no image trained. The
family lists its towers (`Family.towers`); the adapter (peft's exclude_modules), the planner's count of
adapted layers and the console line all read `towers_left_alone` here."""

from __future__ import annotations

from collections.abc import Sequence

from lorakit.model.families.registry import family_of


def towers_of(config) -> tuple[str, ...]:
    """The towers of `config`'s checkpoint besides its language model: its family's, when the config has a
    vision tower (`vision_config`); () for a text-only checkpoint."""
    if getattr(config, "vision_config", None) is None:
        return ()
    return family_of(config).towers


def left_alone(towers: Sequence[str], target_modules) -> tuple[str, ...]:
    """Of `towers`, those the adapter leaves out: all but any an entry of a `target_modules` list names
    (`vision_tower`, or a path through it: the recipe asks for it)."""
    named = target_modules if isinstance(target_modules, (list, tuple)) else ()
    return tuple(t for t in towers if not any(t in entry.split(".") for entry in named))


def towers_left_alone(config, target_modules) -> tuple[str, ...]:
    """The towers of `config`'s checkpoint the adapter for `target_modules` leaves out."""
    return left_alone(towers_of(config), target_modules)


def in_towers(module: str, towers: Sequence[str]) -> bool:
    """Whether the module called `module` (a dotted name) lies inside one of `towers`."""
    parts = module.split(".")
    return any(t in parts for t in towers)


def exclude_pattern(towers: Sequence[str]) -> str | None:
    """peft's exclude_modules for `towers`: a regular expression every module inside one of them matches
    (peft matches a string in full); None when there is nothing to leave out."""
    if not towers:
        return None
    return r"(.*\.)?(" + "|".join(towers) + r")(\..*)?"


def describe(config, target_modules) -> str | None:
    """The console line saying that a multimodal checkpoint's towers stay as they are (None: nothing is
    left out)."""
    towers = towers_left_alone(config, target_modules)
    if not towers:
        return None
    return (
        f"multimodal checkpoint ({getattr(config, 'model_type', None)}), text data: adapting the language "
        f"model only; {', '.join(towers)} left as they are (name one in method.target_modules to adapt it)"
    )
