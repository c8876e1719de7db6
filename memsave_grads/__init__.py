"""memsave_grads: a drop-in ``tf.gradients`` that recomputes activations to save memory.

Importing this package changes nothing in TensorFlow; call :func:`patch` to route
``tf.gradients`` (and what uses it) through :func:`gradients`.
"""

from memsave_grads.api import gradients
from memsave_grads.api import gradients_collection
from memsave_grads.api import gradients_memory
from memsave_grads.api import gradients_speed
from memsave_grads.budgets import Budget
from memsave_grads.memory import profile_op_seconds
from memsave_grads.optimize import minimize
from memsave_grads._explain import PlanReport
from memsave_grads._explain import explain
from memsave_grads.errors import CheckpointNotOnPathError
from memsave_grads.errors import EagerExecutionError
from memsave_grads.errors import FinalizedGraphError
from memsave_grads.errors import InfeasibleBudgetError
from memsave_grads.errors import InvalidArgumentError
from memsave_grads.errors import InvalidTypeError
from memsave_grads.errors import MemsaveGradsError
from memsave_grads.errors import MissingDependencyError
from memsave_grads.errors import NoCheckpointsFoundError
from memsave_grads.errors import NotDifferentiableError
from memsave_grads.errors import PatchStateError
from memsave_grads.errors import SparseGradientError
from memsave_grads.errors import UnknownStrategyError
from memsave_grads.errors import UnsupportedGraphError
from memsave_grads.patch import is_patched
from memsave_grads.patch import original_gradients
from memsave_grads.patch import patch
from memsave_grads.keras import is_wrapped
from memsave_grads.keras import unwrap_model
from memsave_grads.keras import wrap_model
from memsave_grads.patch import unpatch
from memsave_grads.recompute import recompute

__version__ = "0.1.0"

__all__ = [
    "gradients", "gradients_speed", "gradients_memory", "gradients_collection",
    "explain", "PlanReport", "Budget", "profile_op_seconds", "recompute",
    "minimize", "wrap_model", "unwrap_model", "is_wrapped",
    "patch", "unpatch", "is_patched", "original_gradients",
    "MemsaveGradsError", "InvalidArgumentError", "InvalidTypeError", "UnknownStrategyError",
    "CheckpointNotOnPathError", "NoCheckpointsFoundError", "UnsupportedGraphError",
    "SparseGradientError", "EagerExecutionError", "PatchStateError", "InfeasibleBudgetError",
    "MissingDependencyError", "NotDifferentiableError", "FinalizedGraphError",
]
