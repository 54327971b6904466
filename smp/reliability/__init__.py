"""Reliability: no hangs, no silent NaNs, clear errors when a rank fails.

- `step_guard(step)`: a failure on one rank stops every rank fast, naming the rank and step
  (guard.py; the census that names dead or hung ranks is census.py).
- `check_finite_grads(model, step, action)`: NaN/inf gradients found after backward, the same
  decision (raise / skip / warn) on every rank; `trace_nonfinite_forward(model)` then finds
  the first module whose forward output went non-finite.
"""

from smp.reliability.finite import (
    NonFiniteGradientError,
    NonFiniteGradientWarning,
    NonFiniteTrace,
    check_finite_grads,
    find_nonfinite_grads,
    trace_nonfinite_forward,
)
from smp.reliability.guard import PEER_FAILURE_EXIT_CODE, PeerFailure, current_step, step_guard, stop_watchdog

__all__ = [
    "PEER_FAILURE_EXIT_CODE",
    "NonFiniteGradientError",
    "NonFiniteGradientWarning",
    "NonFiniteTrace",
    "PeerFailure",
    "check_finite_grads",
    "current_step",
    "find_nonfinite_grads",
    "step_guard",
    "stop_watchdog",
    "trace_nonfinite_forward",
]
