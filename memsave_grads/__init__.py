"""memsave_grads: a drop-in ``tf.gradients`` that recomputes activations to save memory.

Importing this package changes nothing in TensorFlow, and imports nothing of it either: each
public name is loaded from its module on first use (PEP 562), so ``import memsave_grads`` and
the TensorFlow-free core (``memsave_grads.core``) stay fast. Call :func:`patch` to route
``tf.gradients`` (and what uses it) and ``tf.GradientTape`` inside graphs through
:func:`gradients`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: Public name -> the module that defines it (loaded on first access).
_EXPORTS = {
    "gradients": "memsave_grads.api",
    "gradients_speed": "memsave_grads.api",
    "gradients_memory": "memsave_grads.api",
    "gradients_collection": "memsave_grads.api",
    "assume_batch_size": "memsave_grads.api",
    "register_gradients": "memsave_grads.api",
    "explain": "memsave_grads._explain",
    "PlanReport": "memsave_grads._explain",
    "Budget": "memsave_grads.core.budgets",
    "calibrate_budget": "memsave_grads.calibration",
    "profile_op_seconds": "memsave_grads.measure",
    "recompute": "memsave_grads.recomputation",
    "minimize": "memsave_grads.optimize",
    "wrap_model": "memsave_grads.keras",
    "unwrap_model": "memsave_grads.keras",
    "is_wrapped": "memsave_grads.keras",
    "GradientTape": "memsave_grads.tape",
    "route_tapes": "memsave_grads.tape",
    "without_grappler_scheduling": "memsave_grads._tf.grappler_options",
    "patch": "memsave_grads.patching",
    "unpatch": "memsave_grads.patching",
    "is_patched": "memsave_grads.patching",
    "original_gradients": "memsave_grads.patching",
    **{name: "memsave_grads.errors" for name in (
        "MemsaveGradsError", "InvalidArgumentError", "InvalidTypeError", "UnknownStrategyError",
        "CheckpointNotOnPathError", "NoCheckpointsFoundError", "UnsupportedGraphError",
        "SparseGradientError", "EagerExecutionError", "PatchStateError",
        "InfeasibleBudgetError", "MissingDependencyError", "NotDifferentiableError",
        "FinalizedGraphError", "MissingTensorError")},
}

__all__ = list(_EXPORTS)

#: Modules behind public names that run without TensorFlow installed.
_TENSORFLOW_FREE = ("memsave_grads.errors", "memsave_grads.core.budgets")


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'memsave_grads' has no attribute {name!r}")
    if module not in _TENSORFLOW_FREE:
        # Checks the installed TensorFlow (memsave_grads/_tf/compat.py) before the module's own
        # `import tensorflow` could fail without saying which versions we need.
        importlib.import_module("memsave_grads._tf")
    value = getattr(importlib.import_module(module), name)
    # Cache it: the next access is a plain attribute lookup. (No public name is also a
    # submodule's name, so a later submodule import cannot shadow it.)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: the names as if imported eagerly
    from memsave_grads._explain import PlanReport, explain
    from memsave_grads._tf.grappler_options import without_grappler_scheduling
    from memsave_grads.api import (assume_batch_size, gradients, gradients_collection,
                                   gradients_memory, gradients_speed, register_gradients)
    from memsave_grads.calibration import calibrate_budget
    from memsave_grads.core.budgets import Budget
    from memsave_grads.errors import (CheckpointNotOnPathError, EagerExecutionError,
                                      FinalizedGraphError, InfeasibleBudgetError,
                                      InvalidArgumentError, InvalidTypeError, MemsaveGradsError,
                                      MissingDependencyError, MissingTensorError,
                                      NoCheckpointsFoundError,
                                      NotDifferentiableError, PatchStateError,
                                      SparseGradientError, UnknownStrategyError,
                                      UnsupportedGraphError)
    from memsave_grads.keras import is_wrapped, unwrap_model, wrap_model
    from memsave_grads.measure import profile_op_seconds
    from memsave_grads.optimize import minimize
    from memsave_grads.patching import is_patched, original_gradients, patch, unpatch
    from memsave_grads.recomputation import recompute
    from memsave_grads.tape import GradientTape, route_tapes
