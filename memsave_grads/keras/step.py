"""The training step: the stock Keras step of the model's Keras, with the one
``tape.gradient`` call replaced by :func:`memsave_grads.gradients` on the traced graph; or the
model's own ``train_step``, with its tapes routed."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref

import tensorflow as tf

from memsave_grads import _validate
from memsave_grads import api
from memsave_grads import errors
from memsave_grads import tape
from memsave_grads._tf import graph as tf_graph
from memsave_grads.keras import cells
from memsave_grads.keras import checks
from memsave_grads.keras import flavour as flavour_lib
from memsave_grads.keras import updates
from memsave_grads.keras.flavour import Flavour

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The options of one training step (:func:`train_step`'s, and what ``wrap_model``
    keeps for its step): see :func:`train_step` for each. ``checkpoints`` as given, or as
    ``_validate.check_checkpoints`` parsed it (``wrap_model`` parses it once)."""

    checkpoints: object = "memory"
    fallback: str = "warn"
    recompute_cells: bool = True
    release_gradients_early: bool = False
    batch_size: int | None = None


def check_flags(recompute_cells, release_gradients_early) -> None:
    _validate.check_bool(recompute_cells, "recompute_cells")
    _validate.check_bool(release_gradients_early, "release_gradients_early")


def train_step(model, data, checkpoints="memory", fallback: str = "warn",
               recompute_cells: bool = True, release_gradients_early: bool = False,
               batch_size: int | None = None):
    """One Keras training step whose gradients come from :func:`memsave_grads.gradients`.

    The stock ``Model.train_step`` of the model's Keras (2 or 3): unpack ``(x, y,
    sample_weight)``, forward with ``training=True``, the model's loss (``compute_loss``: the
    compiled loss plus ``model.losses``), gradients of it with respect to the trainable
    variables, ``model.optimizer.apply_gradients`` (a ``LossScaleOptimizer`` scales the loss
    and unscales the gradients as in the stock step), then the metrics as the stock step
    returns them. Call it where Keras traces the step (``Model.fit``'s ``tf.function``), e.g.
    from your own ``train_step``::

        class MyModel(tf_keras.Model):
            def train_step(self, data):
                return memsave_grads.keras.train_step(self, data, checkpoints="memory")

    Args:
      model: a compiled Keras model (tf_keras, or Keras 3 with the TensorFlow backend).
      data: the batch Keras passes to ``train_step``.
      checkpoints: as in :func:`memsave_grads.gradients`, without tensors (name patterns are
        fine); None: plain ``tf.gradients`` in the same step. A budget asking for
        calibration is refused here (the step is being traced): calibrate it first with
        :func:`memsave_grads.calibrate_budget`, or use :func:`wrap_model`, which does.
      fallback: ``"warn"``: where the strategy finds nothing to keep (``NoCheckpointsFoundError``)
        or cannot rewrite the graph, log a warning and use ``tf.gradients``; ``"error"``: raise.
      recompute_cells: Keras 3 recurrent layers (LSTM, GRU, SimpleRNN, RNN(cell)) recompute
        their cell's internals in the backward loop, storing per time step only the cell's
        inputs, states and outputs (design note "recurrent layers"; docs/recurrent.md). False
        keeps the loops as Keras builds them, and so does a step compiled by XLA
        (``jit_compile``), where the recomputation raised the peak (one warning).
      release_gradients_early: update each weight as soon as its gradient is complete, so
        one weight gradient is alive at a time, not all of them (design note "early
        release"); the weights and ``optimizer.iterations`` end as in the stock step (Keras
        3 optimizers, tf_keras' and its legacy ones). Refused for what needs all gradients
        at once: ``LossScaleOptimizer``, ``global_clipnorm``, ``gradient_accumulation_steps``,
        a ``tf.distribute`` strategy. Without it, the step still makes each update wait for
        its own gradient (no set order) wherever none of those applies and XLA does not
        compile the step: stock Keras computes momentum and weight-decay terms at the start
        of the step and holds them through the backward pass, and sums the gradients over
        replicas in one op (even with one replica) that holds them all until the last.
      batch_size: the examples of the batches this step runs, for the plan where the trace
        leaves the batch dimension unknown (``fit`` traces it as None; design note "unknown
        batch size"). None: a calibrated budget's batch size (``calibrate_budget``), else the
        plan is per example, where weights weigh as much as a batch of activations (one
        warning for a budget). :func:`wrap_model` passes each ``fit`` call's batch size.

    Returns:
      The dict of metric results the stock step returns.

    Raises:
      EagerExecutionError: called eagerly (``run_eagerly=True``).
      InvalidArgumentError: the model has no optimizer.
    """
    flavour = flavour_lib.flavour_of(model)
    options = StepOptions(checkpoints, fallback, recompute_cells, release_gradients_early,
                          batch_size)
    return run_step(model, flavour, data, options)


def run_step(model, flavour: Flavour, data, options: StepOptions):
    """:func:`train_step` for a model whose flavour is known."""
    check_flags(options.recompute_cells, options.release_gradients_early)
    _validate.check_batch_size(options.batch_size, allow_none=True)
    checks.check_traced(model)
    if options.release_gradients_early:
        updates.check_early_release(model, flavour)
    if options.checkpoints is not None:  # None: the plain step
        options = dataclasses.replace(
            options, checkpoints=_validate.check_checkpoints(options.checkpoints))
    planned = planned_batch_size(model, data, options.checkpoints, options.batch_size)
    # recompute_cells=False promises the recurrent loops as Keras builds them: no loop body is
    # recomputed inside by the plan either (design note "control flow and calls").
    with tf_graph.assumed_batch_size(planned), api.loops_recomputed_inside(
            options.recompute_cells):
        return _traced_step(model, flavour, data, options)


def run_wrapped_step(model, flavour: Flavour, data, options: StepOptions):
    """What a wrapped model's ``train_step`` runs: :func:`run_step`, or, where the model's
    class defines its own ``train_step``, that step as written with each ``tf.GradientTape``
    in it computing its gradients with memsave_grads (design note "tape routing"), planned,
    as Keras applies them, for gradients applied together. ``options.checkpoints`` None: the
    plain step (a calibration's reference)."""
    if not checks.has_own_train_step(model, flavour):
        return run_step(model, flavour, data, options)
    own_step = functools.partial(type(model).train_step, model, data)
    if options.checkpoints is None:
        return own_step()
    checkpoints = _validate.check_checkpoints(options.checkpoints)
    planned = planned_batch_size(model, data, checkpoints, options.batch_size)
    # Where order_own_step_updates will make each update wait for its gradient (as the
    # default step's do), the gradients are planned as used up one by one, as there; where
    # it finds the step took several gradients it orders nothing and they are held after
    # all (the predicted peaks of plan and plain both miss them alike).
    held = not updates.updates_wait_for_gradients(model, flavour, False)
    with tf_graph.assumed_batch_size(planned), cells.maybe_recomputed_cells(
            model, flavour, options.recompute_cells), api.loops_recomputed_inside(
                options.recompute_cells), api.counting_gradients_calls() as counted:
        result = tape.run_with_routed_tapes(own_step, checkpoints, options.fallback,
                                            caller=f"memsave_grads.keras ({flavour.name})",
                                            gradients_held=held)
    # Run eagerly, routed tapes are TensorFlow's (each kind noticed there): no count to read.
    if not counted.calls and not tf.executing_eagerly():
        _no_gradient_computed(model, options.fallback)
    updates.order_own_step_updates(model, flavour, counted.made)
    return result


#: Model classes already warned that their own train_step computed no gradient through us.
_WARNED_NO_GRADIENTS: "weakref.WeakSet" = weakref.WeakSet()


def _no_gradient_computed(model, fallback: str) -> None:
    """A model's own ``train_step`` was traced and computed no gradient through memsave_grads
    (no tf.GradientTape gradient, no ``memsave_grads.gradients`` or
    ``memsave_grads.keras.train_step`` call): wrap_model saves nothing there. Said once per
    class under ``fallback="warn"``, raised under ``"error"``."""
    cls = type(model)
    message = (
        f"model: wrap_model: {cls.__qualname__}.train_step computed no gradient through "
        "memsave_grads while Keras traced it (expected a tf.GradientTape.gradient, a "
        "memsave_grads.gradients or a memsave_grads.keras.train_step call; it uses none, or "
        "tf.gradients, which wrap_model does not route), so the wrapped step saves no memory. "
        "Take the gradients with tf.GradientTape, memsave_grads.gradients or "
        "memsave_grads.keras.train_step(self, data) in train_step")
    if fallback == "error":
        raise errors.InvalidArgumentError(message + ".")
    if cls not in _WARNED_NO_GRADIENTS:
        _WARNED_NO_GRADIENTS.add(cls)
        _LOG.warning("memsave_grads.keras: %s, or unwrap the model; it trains as written.",
                     message)


def _traced_step(model, flavour: Flavour, data, options: StepOptions):
    x, y, sample_weight = flavour.unpack(data)
    with cells.maybe_recomputed_cells(model, flavour, options.recompute_cells):
        y_pred, loss = flavour.forward_and_loss(model, x, y, sample_weight)
    flavour.track_loss(model, x, y, loss)
    optimizer = model.optimizer
    loss = flavour.scale_loss(optimizer, loss)
    variables = list(model.trainable_weights)

    def compute_gradients(applied_together: bool = True):
        return gradients(loss, variables, options.checkpoints, options.fallback,
                         applied_together)

    if variables and updates.updates_wait_for_gradients(model, flavour,
                                                        options.release_gradients_early):
        updates.apply_releasing_early(model, flavour, loss,
                                      lambda: compute_gradients(applied_together=False),
                                      options.release_gradients_early)
    elif variables or flavour.applies_without_weights:
        grads = flavour.unscale_gradients(optimizer, compute_gradients())
        optimizer.apply_gradients(zip(grads, variables))
    else:
        _LOG.warning("memsave_grads.keras: the model has no trainable weights.")
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def gradients(loss, variables, checkpoints, fallback, applied_together: bool = True):
    """The gradients of ``loss``, planned for an optimizer that applies them together unless
    not ``applied_together`` (the step whose updates wait for their own gradients): Keras'
    sum over replicas holds every weight gradient until the last is done (measured on tf_keras:
    128 MiB on a 6 x 2048^2 MLP whose gradients are 96), and so do steps that need them all."""
    if checkpoints is None:  # the plain step: calibrate_budget's reference
        return tf_graph.ORIGINAL_GRADIENTS(loss, variables)
    with api.gradients_applied_together() if applied_together else contextlib.nullcontext():
        return api.gradients_or_fallback(loss, variables, None, checkpoints, fallback,
                                         "memsave_grads.keras")


# Design note "unknown batch size": fit traces its step from a dataset whose batch dimension is
# None (the last batch may be smaller), and the memory model counts an unknown dimension as 1.
# Planned per example, a budget compares a batch of activations with a single example's, so
# weights and their gradients look as large as the whole forward pass: on a 12-layer 128-wide
# MLP, "budget:50%" per example has no plan (the smallest is 96% of plain), and for 512
# examples it plans (tests/test_unknown_batch.py).

#: Models already warned that their budget is planned per example.
_WARNED_PER_EXAMPLE: "weakref.WeakSet" = weakref.WeakSet()


def planned_batch_size(model, data, checkpoints, batch_size: int | None) -> int | None:
    """The batch size the step's plan assumes where the trace leaves it unknown: ``batch_size``,
    else a calibrated budget's, else None (per example; one warning for a budget). None, too,
    where the traced batch size is known: nothing is assumed."""
    if checkpoints is None or not _batch_dimension_unknown(data):
        return None
    if batch_size is not None:
        return int(batch_size)
    budget = _validate.check_checkpoints(checkpoints).budget
    calibration = getattr(budget, "calibration", None)
    if calibration is not None and calibration.batch_size is not None:
        return calibration.batch_size
    if budget is not None and model not in _WARNED_PER_EXAMPLE:
        _WARNED_PER_EXAMPLE.add(model)
        _LOG.warning(
            "memsave_grads.keras: %s: the step is traced with an unknown batch size and none "
            "is known, so %s is planned for one example, where the weights weigh as much as a "
            "whole batch's activations. Pass wrap_model(model, ..., batch_size=N) (or "
            "train_step(..., batch_size=N)), or fit with arrays or a batched tf.data.Dataset, "
            "whose batch size wrap_model reads.", getattr(model, "name", model),
            budget.describe())
    return None


def _batch_dimension_unknown(data) -> bool:
    """Whether the batch's first tensor has a static shape with an unknown first dimension."""
    for value in tf.nest.flatten(data):
        shape = getattr(value, "shape", None)
        if isinstance(shape, tf.TensorShape) and shape.rank:
            return shape[0] is None
    return False
