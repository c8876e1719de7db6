"""Exceptions raised by memsave_grads.

Every error we raise derives from :class:`MemsaveGradsError` *and* from the builtin exception a
caller would expect (``ValueError``, ``TypeError``, ``RuntimeError``), so ``except ValueError``
keeps working in code written for ``tf.gradients``. Messages follow one pattern: which argument,
what was expected, what was given, and how to fix it.
"""

from __future__ import annotations


class MemsaveGradsError(Exception):
    """Base class of every error raised by memsave_grads."""

    # AutoGraph (tf.function's default, and Keras 2's training function) re-raises an error
    # from a converted function as the same type only when that type's __init__ is
    # Exception.__init__; otherwise it raises a StagingError. The builtin bases (ValueError...)
    # each have their own __init__, so without this line our errors lose their type there.
    __init__ = Exception.__init__


class InvalidArgumentError(MemsaveGradsError, ValueError):
    """An argument has the right type but a value we cannot use."""


class InvalidTypeError(MemsaveGradsError, TypeError):
    """An argument has a type we cannot use."""


class MissingTensorError(InvalidArgumentError, AttributeError):
    """``ys`` or ``xs``, or one of their items, is None. Also an ``AttributeError``: what
    ``tf.gradients`` raises for the same input."""


class UnknownStrategyError(InvalidArgumentError):
    """``checkpoints=`` names a strategy that does not exist."""


class CheckpointNotOnPathError(InvalidArgumentError):
    """A requested checkpoint is not on any path from ``xs`` to ``ys``."""


class NoCheckpointsFoundError(InvalidArgumentError):
    """The strategy found no tensor worth keeping in this graph."""


class NotDifferentiableError(InvalidArgumentError):
    """Every y (or every x) has a dtype gradients cannot flow through (integer, boolean,
    string): tf.gradients would return only ``None``, so there is nothing to rewrite."""


class InfeasibleBudgetError(InvalidArgumentError):
    """A memory budget is below the smallest peak any plan reaches.

    Attributes (set by ``solvers.problem.infeasible``; ``None`` on a copy that AutoGraph re-raised,
    which keeps only the type and the message):
      min_feasible_bytes: the smallest predicted peak the solver found (for an exact solver,
        the smallest there is): a budget at least this large is feasible.
      budget_bytes: the budget asked for, in bytes (a fraction resolved against the plain peak).
      plain_peak_bytes: the predicted peak of plain ``tf.gradients`` on the same graph, so a
        caller can state both numbers as fractions of it or ask again with a fraction.
      calibration: from :func:`memsave_grads.calibrate_budget` (where the three numbers above
        are measured, not predicted): the ``Calibration`` with every measured try.
    """

    # No __init__ of its own, so that the type survives AutoGraph (see MemsaveGradsError).
    min_feasible_bytes: int | None = None
    budget_bytes: int | None = None
    plain_peak_bytes: int | None = None
    calibration: object = None


class MissingDependencyError(MemsaveGradsError, ImportError):
    """An optional dependency (scipy for the 'milp' solver, tf-keras for Keras helpers) is
    not installed."""


class UnsupportedGraphError(MemsaveGradsError, NotImplementedError):
    """The forward graph uses a construct the rewrite cannot copy safely."""


class SparseGradientError(MemsaveGradsError, ValueError):
    """A sparse partial must be densified but its dense shape is unknown."""


class EagerExecutionError(MemsaveGradsError, RuntimeError):
    """Called with eager tensors outside a graph or ``tf.function``."""


class PatchStateError(MemsaveGradsError, RuntimeError):
    """``patch()``/``unpatch()`` called in the wrong state."""


class FinalizedGraphError(MemsaveGradsError, RuntimeError):
    """The graph of ``ys`` is finalized: no gradient op can be added to it (``tf.gradients``
    cannot add its own either, so there is nothing to fall back to)."""


_LIKE_TENSORFLOWS: dict = {}


def like_tensorflows(error: MemsaveGradsError, tensorflow_error: BaseException
                     ) -> MemsaveGradsError:
    """``error``, made an instance of ``tensorflow_error``'s type as well where that is a
    builtin exception it is not one of already, so that code catching what ``tf.gradients``
    raises for the same input catches ours too (docs/guarantees.md). The combined type
    subclasses ``error``'s first, and pickles (as multiprocessing and test runners do)."""
    kind = type(tensorflow_error)
    if isinstance(error, kind) or kind.__module__ != "builtins":
        return error
    combined = _combined(type(error), kind)
    return error if combined is None else combined(*error.args)


def _combined(ours: type, kind: type) -> type | None:
    key = (ours, kind)
    if key not in _LIKE_TENSORFLOWS:
        try:
            _LIKE_TENSORFLOWS[key] = type(ours.__name__, key, {
                "__module__": __name__,
                "__reduce__": lambda self: (_rebuilt, (ours, kind, self.args))})
        except TypeError:  # two builtins whose instances are laid out differently
            _LIKE_TENSORFLOWS[key] = None
    return _LIKE_TENSORFLOWS[key]


def _rebuilt(ours: type, kind: type, args: tuple) -> BaseException:
    combined = _combined(ours, kind)
    return (combined or ours)(*args)


#: Errors after which a patched ``tf.gradients`` may fall back to the original function: the
#: graph is fine for TensorFlow, we merely have nothing to gain or cannot rewrite it. A
#: checkpoint list given to ``patch()`` applies to every gradient call of the program, so a
#: call it has nothing on the path of (a second-order call inside ``tf.hessians``) falls back
#: too.
FALLBACK_ERRORS = (NoCheckpointsFoundError, NotDifferentiableError, UnsupportedGraphError,
                   CheckpointNotOnPathError)
