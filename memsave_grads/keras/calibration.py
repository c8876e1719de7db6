"""A budget calibrated on a Keras model's whole training step (design note "calibrated
budgets"): what :func:`memsave_grads.calibrate_budget` does for a Keras model, and what the
wrapped ``fit``/``train_on_batch`` call once per batch size."""

from __future__ import annotations

import dataclasses
import logging

import tensorflow as tf

from memsave_grads import measure
from memsave_grads._tf import grappler_options
from memsave_grads.core import budgets
from memsave_grads.core import calibration as core_calibration
from memsave_grads.keras import checks
from memsave_grads.keras import flavour as flavour_lib
from memsave_grads.keras import step as step_lib
from memsave_grads.keras import synthetic

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)


def calibrate_model(model, asked: budgets.Budget, *, batch_size: int,
                    sequence_length: int | None = None, data=None, static_batch: bool = False,
                    runs: int = measure.DEFAULT_RUNS,
                    max_measurements: int = core_calibration.DEFAULT_MAX_MEASUREMENTS
                    ) -> budgets.Budget:
    """``asked`` calibrated on this Keras model's whole training step (design note
    "calibrated budgets"): what :func:`memsave_grads.calibrate_budget` does for a Keras model
    (arguments checked there), and what the wrapped ``fit``/``train_on_batch`` call."""
    measure_step, examples = _calibration_measure(model, batch_size, sequence_length, data,
                                                  runs, static_batch)
    step = ("Keras step traced with its batch size, as train_on_batch traces it"
            if static_batch else "Keras step traced with an unknown batch dimension, as "
            f"fit traces it, planned for {examples} examples")
    measure.check_allocator_stats()
    calibrated = core_calibration.calibrate(asked, measure_step,
                                            max_measurements=max_measurements, step=step,
                                            batch_size=examples)
    _LOG.info("memsave_grads: calibrated %s", calibrated.calibration)
    return calibrated


def _training_state(model, step=None) -> list:
    """Every variable one training step may change: weights, batch-norm statistics, dropout
    seeds, the optimizer's slots and iterations, the metrics' totals, and whatever else the
    traced ``step`` (a concrete function) captures: state the model does not list, such as a
    stateful RNN's states and Keras 3's global seed generator, which ``keras.random`` calls
    without a seed advance."""
    optimizer_variables = getattr(model.optimizer, "variables", [])
    if callable(optimizer_variables):  # tf_keras legacy optimizers: a method
        optimizer_variables = optimizer_variables()
    captured = list(step.variables) if step is not None else []
    found, seen = [], set()
    for v in [*model.variables, *optimizer_variables,
              *(v for metric in model.metrics for v in metric.variables), *captured]:
        # A Keras 3 variable and the tf.Variable it holds (which a step captures) are one.
        held = getattr(v, "_value", None)
        v = held if isinstance(held, tf.Variable) else v
        if id(v) not in seen:
            seen.add(id(v))
            found.append(v)
    return found


def _calibration_measure(model, batch_size, sequence_length, data, runs: int,
                         static_batch: bool):
    """``(measure, examples)``: ``measure(planned)`` runs the model's whole training step
    under ``planned`` (None: plain ``tf.gradients``) and returns its measured peak, every
    variable it changed restored."""
    flavour = flavour_lib.flavour_of(model)
    checks.check_model(model, flavour, "calibrate_budget")
    if data is None:
        data = synthetic.synthetic_batch(model, batch_size, sequence_length)
    x, y = tf.nest.map_structure(tf.convert_to_tensor, tuple(data))
    examples = int(tf.nest.flatten(x)[0].shape[0])
    specs = tf.nest.map_structure(
        lambda t: tf.TensorSpec(t.shape if static_batch else [None] + t.shape[1:], t.dtype),
        (x, y))
    # A wrapped model's step options (wrap_model's WrappedTrainStep.options), else the defaults.
    wrapped = getattr(model.__dict__.get("train_step"), "options", step_lib.StepOptions())
    flavour.build_optimizer(model)

    def measure_planned(planned):
        # The whole training step, updates included, as wrap_model's fit runs it; "error"
        # hands an infeasible budget to the search, which re-aims it.
        options = dataclasses.replace(wrapped, checkpoints=planned, fallback="error",
                                      batch_size=examples)

        def step(x, y):
            return step_lib.run_wrapped_step(model, flavour, (x, y), options)
        concrete = tf.function(step, autograph=False).get_concrete_function(*specs)
        # After the trace: tf_keras makes its slots there.
        state = _training_state(model, concrete)
        saved = [tf.identity(tf.convert_to_tensor(v)) for v in state]
        try:
            with grappler_options.without_grappler_scheduling():  # as wrap_model's fit runs
                return measure.step_peak_bytes(lambda: concrete(x, y), runs)
        finally:
            for variable, value in zip(state, saved):
                variable.assign(value)

    return measure_planned, examples


def smallest_measured_budget(asked: budgets.Budget, infeasible) -> budgets.Budget | None:
    """The budget planning where the calibration measured its smallest peak (so that
    ``fallback="warn"`` trains with the least memory measured), or None (plain
    ``tf.gradients`` in the step) where nothing measured less than the plain step."""
    record = getattr(infeasible, "calibration", None)
    if record is None or not record.tries:
        return None
    smallest = min(record.tries, key=lambda t: (t.measured_bytes, -t.planned_fraction))
    if smallest.measured_bytes >= record.plain_measured_bytes:
        return None
    return dataclasses.replace(asked, bytes=None, fraction=smallest.planned_fraction,
                               calibration=record, calibrate=False)
