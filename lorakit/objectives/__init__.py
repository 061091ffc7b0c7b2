"""Training objectives as a type: one module per objective family (sft.py; dpo.py with its IPO and SimPO
variants; orpo.py, kto.py), each an Objective (base.py) registered with its settings model under its
train.objective (registry.py). Importing this package (lorakit's own __init__ does) registers the built-ins
(builtin.py) with the recipe; it loads no torch: an objective's module is loaded when a run asks for it."""

from lorakit.objectives.base import Objective
from lorakit.objectives.registry import (
    make_batching,
    make_objective,
    objective_named,
    objective_type,
    prepare_data,
    register,
    register_built_ins,
    unregister,
)

register_built_ins()

__all__ = [
    "Objective",
    "make_batching",
    "make_objective",
    "objective_named",
    "objective_type",
    "prepare_data",
    "register",
    "unregister",
]
