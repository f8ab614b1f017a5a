"""``dwdp plan``: a roofline planner for DWDP vs DEP (pure Python, no torch).

Public entry points:
  ``plan(...) -> PlanResult``            the full prediction (``PlanResult.to_json()``)
  ``memory_fit(...) -> (fits, message, breakdown)``  the operator's admission check
  ``calibrate(measured) -> dict``        measured vs predicted for the same shapes
See docs/PLANNER.md for the model, its assumptions and its limits.
"""

from .calibration import calibrate
from .memory import MemoryBreakdown, memory_fit
from .plan import PlanResult, plan

__all__ = ["plan", "PlanResult", "memory_fit", "MemoryBreakdown", "calibrate"]
