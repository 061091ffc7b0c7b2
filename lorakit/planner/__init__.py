"""The memory planner: will a recipe fit on given GPUs and CPU RAM, and what is the best setup that does.

    import lorakit
    p = lorakit.plan("recipes/flan_t5_xxl_lora.yaml", gpus=8, gpu_memory="40GB")
    p.fits, p.per_gpu_bytes, p.per_node_cpu_bytes, p.recommendation
    print(p.describe())

See docs/planning.md for the model behind the numbers and its limits.
"""

from lorakit.planner.core import Estimate, MemoryPlan, plan
from lorakit.planner.units import PlanError, format_bytes, parse_bytes

__all__ = ["Estimate", "MemoryPlan", "PlanError", "format_bytes", "parse_bytes", "plan"]
