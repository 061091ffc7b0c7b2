"""Training objectives as a type: one module per objective family (sft.py; dpo.py with its IPO and SimPO
variants), each an Objective (base.py) registered under its train.objective (registry.py)."""

from lorakit.objectives.base import Objective
from lorakit.objectives.registry import (
    make_batching,
    make_objective,
    objective_named,
    objective_type,
    prepare_data,
    register,
    unregister,
)

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
