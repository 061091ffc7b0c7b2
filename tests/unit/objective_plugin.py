"""A user's plugin module (train.objective_module): importing it registers the toy objective of
tests/unit/test_objectives_registry.py, as a package of the user's would register its own."""

from lorakit.objectives import register
from tests.unit.test_objectives_registry import DoubledTokens

register(DoubledTokens)
