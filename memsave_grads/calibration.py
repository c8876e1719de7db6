"""``calibrate_budget()``: a budget held against the measured step, not the prediction.

A :class:`~memsave_grads.Budget` bounds the memory model's predicted peak, and the model misses
terms on some networks (docs/budgets.md). :func:`calibrate_budget` runs the step instead: the
plain ``tf.gradients`` step once, then plans under re-aimed budgets until one measures within
what was asked (the search: :mod:`memsave_grads.core.calibration`; design note "calibrated
budgets"). It returns a budget to pass where budgets go (``wrap_model``, ``gradients``,
``patch``).
"""

from __future__ import annotations

import logging

import tensorflow as tf

from memsave_grads import _validate
from memsave_grads import errors
from memsave_grads import measure as measure_lib
from memsave_grads._tf import grappler_options
from memsave_grads.core import budgets
from memsave_grads.core import calibration as core_calibration
from memsave_grads.keras import calibration as keras_calibration
from memsave_grads.keras import flavour as keras_flavour

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)


def calibrate_budget(model_or_step, budget: budgets.Budget | str, *, batch_size: int = 32,
                     sequence_length: int | None = None, data=None, static_batch: bool = False,
                     runs: int = measure_lib.DEFAULT_RUNS,
                     max_measurements: int = core_calibration.DEFAULT_MAX_MEASUREMENTS
                     ) -> budgets.Budget:
    """``budget`` re-aimed so that the plan it gives measures within it on this machine.

    The budget is read against measured peaks: ``fraction`` of the *measured* plain
    ``tf.gradients`` step, or ``bytes`` of measured step peak (the allocator's peak above what
    was in use when the step started: weights and optimizer state are not counted). The plain
    step runs once, then each plan: a warm-up run and ``runs`` measured runs, the largest peak
    counting. Plans are re-aimed (design note "calibrated budgets") until one measures within
    the budget and at least 90% of it, or ``max_measurements`` plans were measured; the
    result is the budget of the one that held with the least recompute. Calibrate at the
    batch size you train with: the plans, and the memory model's misses, depend on it.

    Example::

        budget = memsave_grads.calibrate_budget(model, "budget:50%", batch_size=64)
        print(budget.calibration)         # what was measured
        memsave_grads.wrap_model(model, budget)
        model.fit(x, y, batch_size=64)

    Args:
      model_or_step: a compiled Keras model (tf_keras, or Keras 3 with the TensorFlow
        backend, whose class keeps the stock ``train_step``): its training step is measured
        as ``wrap_model`` builds it (a wrapped model's settings kept), updates included, the
        plain step being the same with ``tf.gradients``; every variable the steps change
        (weights, optimizer slots and iterations, batch-norm statistics, dropout seeds,
        metrics) is restored afterwards. Or a function ``step(checkpoints)`` that computes one step's
        gradients with ``memsave_grads.gradients(..., checkpoints=checkpoints)`` and returns
        them; it is traced without AutoGraph, and called with ``checkpoints=None`` for the
        plain step, where it must use ``tf.gradients``. Variables it changes are not restored.
      budget: a :class:`~memsave_grads.Budget` or ``"budget:..."`` string; a calibrated
        budget is calibrated again from what was asked.
      batch_size, sequence_length, data: the batch of a Keras model's step, as in
        :func:`memsave_grads.explain`: ``data=(x, y)`` arrays, or a random batch of
        ``batch_size`` examples.
      static_batch: False (default): a Keras model's step is traced as ``fit`` traces it,
        with an unknown batch dimension, and planned for the batch's size as ``wrap_model``'s
        ``fit`` plans it (design note "unknown batch size"); True: with the batch size in
        every shape, as ``train_on_batch``, ``explain(model)`` and fit-limit trace it. The two
        traces differ (measured on a Keras 3 BN/dropout MLP at batch 1024: a 50% budget
        calibrated on the static trace peaked at 1.20-1.28x its target under ``fit``; one
        calibrated on fit's trace held there). The returned budget records the batch size
        (``calibration.batch_size``).
      runs: measured runs per step (>= 1).
      max_measurements: plans measured at most (>= 1).

    Returns:
      A :class:`~memsave_grads.Budget` of the planned fraction that held; its
      ``calibration`` holds the asked budget, the target in bytes and every measured try.

    Raises:
      InfeasibleBudgetError: no measured plan fit; the message states the smallest measured
        peak as a share of the measured plain step.
      AllocatorStatsUnavailableError: the allocator keeps no statistics (on CPU, set
        ``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow is imported).
      InvalidTypeError, InvalidArgumentError: bad arguments (before anything runs).
    """
    asked = _asked_budget(budget)
    _validate.check_count(runs, "runs")
    _validate.check_count(max_measurements, "max_measurements")
    _validate.check_batch_size(batch_size)  # a step function's own batch: checked all the same
    if keras_flavour.is_keras_model(model_or_step):
        _validate.check_bool(static_batch, "static_batch")
        return keras_calibration.calibrate_model(
            model_or_step, asked, batch_size=batch_size, sequence_length=sequence_length,
            data=data, static_batch=static_batch, runs=runs, max_measurements=max_measurements)
    if not callable(model_or_step):
        raise errors.InvalidTypeError(
            f"model_or_step: expected a compiled Keras model or a function "
            f"step(checkpoints) that returns gradients, got {type(model_or_step).__name__}: "
            f"{model_or_step!r:.80}.")
    measure_lib.check_allocator_stats()
    calibrated = core_calibration.calibrate(asked, _function_step(model_or_step, runs),
                                            max_measurements=max_measurements,
                                            step="step function")
    _LOG.info("memsave_grads: calibrated %s", calibrated.calibration)
    return calibrated


def _asked_budget(budget) -> budgets.Budget:
    parsed = budgets.as_budget(budget)
    if parsed is not None:
        return parsed.calibration.asked if parsed.calibration is not None else parsed
    raise errors.InvalidTypeError(
        f"budget: expected a memsave_grads.Budget or a 'budget:...' string such as "
        f"'budget:50%', got {type(budget).__name__}: {budget!r:.80}.")


def _function_step(step, runs: int):
    def measure(planned):
        concrete = tf.function(lambda: step(planned), autograph=False).get_concrete_function()
        with grappler_options.without_grappler_scheduling():  # as the docs run a step
            return measure_lib.step_peak_bytes(concrete, runs)
    return measure
