"""lorakit doctor: prove this machine before a long run. Environment (versions, GPUs, flash-attn,
bitsandbytes, DeepSpeed ops, build locks, disk), contracts on a small model of the recipe's architecture
with the kernels and dtype the recipe picks (packing, chunked loss, merge, accumulation, ZeRO-3 save),
speed of one block at the recipe's dimensions, and the planner's memory verdict. See docs/doctor.md.

`lorakit.doctor(recipe, quick=..., output=...)` and `python -m lorakit.doctor [RECIPE] [--quick]`: this
package is also callable (lorakit.callable_module), so `import lorakit.doctor` keeps `lorakit.doctor(...)`
working.
"""

from lorakit.callable_module import forward_calls
from lorakit.doctor.core import run_doctor
from lorakit.doctor.result import CheckResult, DoctorReport

__all__ = ["CheckResult", "DoctorReport", "run_doctor"]

forward_calls(__name__, "lorakit.doctor.core:run_doctor")
