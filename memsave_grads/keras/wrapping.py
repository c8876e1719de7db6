"""``wrap_model`` / ``unwrap_model``: a model's ``train_step``, ``fit`` and ``train_on_batch``
replaced on that one model object, with a budget asking for calibration calibrated per batch
size before the step is traced for it."""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import TypeVar

import tensorflow as tf

from memsave_grads import _validate
from memsave_grads import api
from memsave_grads import errors
from memsave_grads._tf import grappler_options
from memsave_grads.core import budgets
from memsave_grads.core.checkpoints import ParsedCheckpoints
from memsave_grads.keras import batches
from memsave_grads.keras import calibration
from memsave_grads.keras import checks
from memsave_grads.keras import flavour as flavour_lib
from memsave_grads.keras import step as step_lib
from memsave_grads.keras import updates
from memsave_grads.keras.flavour import Flavour

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

#: A Keras 2 or Keras 3 model: wrap_model and unwrap_model return the model they are given.
_Model = TypeVar("_Model")


class WrappedTrainStep:
    """What ``model.train_step`` becomes on a wrapped model (an instance attribute)."""

    def __init__(self, model, flavour: Flavour, options: step_lib.StepOptions):
        self._model = weakref.ref(model)  # no reference cycle through the model's __dict__
        self.flavour = flavour
        #: What wrap_model was given, its checkpoints parsed (see planned_checkpoints).
        self.options = options
        self.asked: ParsedCheckpoints = options.checkpoints
        #: The batch size of the running ``fit`` call (_WrappedFit), when it can be read.
        self.fit_batch_size: int | None = None
        #: The batch size the cached training function was planned for.
        self.traced_batch_size: int | None = None
        #: A budget asking for calibration (``Budget.calibrate``), calibrated per batch:
        #: (examples, whether the trace knows the batch size) -> the calibrated budget; None ->
        #: the budget planned on the prediction where the batch could not be read.
        self.calibrated: dict[tuple[int, bool] | None, budgets.Budget] = {}
        #: What ``calibrated`` was measured with (weak references to the optimizer and the
        #: compiled loss): compiling again makes new ones, and the calibrations are redone.
        self.calibrated_with: tuple = ()
        #: The batch the next trace runs, once ``fit``/``train_on_batch`` calibrated for it.
        self.calibration_key: tuple[int, bool] | None = None
        #: The checkpoints the cached training function was planned with, and the
        #: calibration key it was traced for.
        self.traced_checkpoints = None
        self.traced_key: tuple[int, bool] | None = None

    @property
    def batch_size(self) -> int | None:
        """The batch size given to wrap_model."""
        return self.options.batch_size

    def needs_calibration(self) -> bool:
        budget = self.asked.budget
        return budget is not None and budget.calibrate and budget.calibration is None

    def forget_calibrations_if_recompiled(self) -> None:
        """Drop the calibrations where the model was compiled again since they were measured:
        another optimizer (Adam keeps twice SGD's state) or loss moves the measured peaks."""
        compiled = _compiled_objects(self._model())
        measured_with = [None if ref is None else ref() for ref in self.calibrated_with]
        if self.calibrated_with and all(a is b for a, b in zip(measured_with, compiled)):
            return
        if self.calibrated:
            _LOG.info("memsave_grads.keras: %s was compiled again: its budget is "
                      "calibrated again", getattr(self._model(), "name", "model"))
        self.calibrated.clear()
        self.calibrated_with = tuple(None if o is None else weakref.ref(o) for o in compiled)

    def planned_checkpoints(self):
        """The checkpoints the next trace plans with: a budget asking for calibration is
        replaced by its calibration for the batch ``fit``/``train_on_batch`` runs."""
        if not self.needs_calibration():
            return self.asked
        self.forget_calibrations_if_recompiled()  # traced by a path that calibrated nothing
        if self.calibration_key in self.calibrated:
            return self.calibrated[self.calibration_key]  # None: plain tf.gradients measured least
        # Traced by a path that ran nothing first (evaluate's or a custom loop's call of
        # make_train_function, fit with batches whose size cannot be read): planned on the
        # prediction; _calibrate_for_batch said why, or says so here once.
        uncalibrated = dataclasses.replace(self.asked.budget, calibrate=False)
        if self not in _WARNED_UNCALIBRATED:
            _WARNED_UNCALIBRATED.add(self)
            _LOG.warning(
                "memsave_grads.keras: %s: the training step was traced before any batch "
                "was seen, so %s is planned on the predicted peak, not calibrated. fit "
                "and train_on_batch calibrate it on their batch first.",
                getattr(self._model(), "name", "model"), uncalibrated.describe())
        return uncalibrated

    def planned_batch_size(self) -> int | None:
        """The batch size the next trace plans for where it leaves the batch unknown: a
        calibrated budget's own (the batch it was measured on), else the one given to
        wrap_model, else the one fit or train_on_batch read (None: per example)."""
        if self.needs_calibration():  # planned: a calibrated budget, or None (plain)
            calibrated = getattr(self.planned_checkpoints(), "calibration", None)
            if calibrated is not None and calibrated.batch_size:
                return calibrated.batch_size
        return self.batch_size or self.fit_batch_size

    def __call__(self, data):
        self.traced_checkpoints = self.planned_checkpoints()
        self.traced_key = self.calibration_key
        planned = self.planned_batch_size()
        self.traced_batch_size = planned
        options = dataclasses.replace(self.options, checkpoints=self.traced_checkpoints,
                                      batch_size=planned)
        return step_lib.run_wrapped_step(self._model(), self.flavour, data, options)

    def __repr__(self):
        o = self.options
        return (f"<memsave_grads train_step checkpoints={self.asked.given!r} "
                f"fallback={o.fallback!r} recompute_cells={o.recompute_cells!r} "
                f"release_gradients_early={o.release_gradients_early!r} "
                f"batch_size={o.batch_size!r}>")


def _compiled_objects(model) -> tuple:
    """The objects ``compile`` makes anew each time: the optimizer (a string compiles to a
    new one) and the loss container (Keras 3 ``_compile_loss``, tf_keras ``compiled_loss``)."""
    loss = getattr(model, "_compile_loss", None)
    if loss is None:
        loss = getattr(model, "compiled_loss", None)
    return (getattr(model, "optimizer", None), loss)


#: Wrapped steps already warned that they were traced before calibration.
_WARNED_UNCALIBRATED: "weakref.WeakSet" = weakref.WeakSet()


class _WrappedFit:
    """What ``model.fit`` becomes on a wrapped model: the class's ``fit``, after reading the
    batch size of the call for the plan (design note "unknown batch size") and calibrating a
    budget that asks for it on the call's first batch (design note "calibrated budgets"). A
    training function planned for another batch size or budget is traced again. It runs
    without Grappler's gradient accumulators (design note "Grappler's gradient
    accumulators")."""

    def __init__(self, model):
        # A strong reference, as a bound method holds its object: ``fit = model.fit`` keeps
        # the model alive (the cycle through the model's __dict__ is the collector's).
        self._model = model

    def __call__(self, *args, **kwargs):
        model = self._model
        step = model.__dict__.get("train_step")
        with grappler_options.without_grappler_scheduling():
            if isinstance(step, WrappedTrainStep):
                fit = type(model).fit
                if step.batch_size is None:
                    step.fit_batch_size = batches.fit_batch_size(fit, model, args, kwargs)
                if step.needs_calibration():
                    batch, static = batches.fit_calibration_batch(
                        fit, model, args, kwargs, step.batch_size or step.fit_batch_size)
                    _calibrate_for_batch(model, step, batch, static)
                _retrace_if_replanned(model, step)
            return type(model).fit(model, *args, **kwargs)

    def __repr__(self):
        return "<memsave_grads fit: reads the batch size for the plan>"


class _WrappedTrainOnBatch:
    """What ``model.train_on_batch`` becomes on a wrapped model: the class's
    ``train_on_batch`` without Grappler's gradient accumulators, after calibrating a budget
    that asks for it on the batch it is given (the first of each size)."""

    def __init__(self, model):
        self._model = model  # strong, as in _WrappedFit

    def __call__(self, *args, **kwargs):
        model = self._model
        step = model.__dict__.get("train_step")
        with grappler_options.without_grappler_scheduling():
            if isinstance(step, WrappedTrainStep):
                bound = batches.bound_arguments(type(model).train_on_batch, model, args, kwargs)
                x, y = (bound.arguments.get("x"), bound.arguments.get("y")) if bound else (
                    None, None)
                if step.batch_size is None and step.fit_batch_size is None:
                    # Keras 3 traces the first size as it is, and the next one with an unknown
                    # batch dimension (reduce_retracing): that trace is planned for the size
                    # train_on_batch saw first, not per example (design note "unknown batch
                    # size").
                    step.fit_batch_size = batches.leading_dimension(x)
                if bound is not None and step.needs_calibration():
                    _calibrate_for_batch(model, step, (x, y) if y is not None else None, True,
                                         examples=batches.leading_dimension(x))
                    _retrace_if_replanned(model, step)
            return type(model).train_on_batch(model, *args, **kwargs)

    def __repr__(self):
        return "<memsave_grads train_on_batch: runs without Grappler's gradient accumulators>"


def _retrace_if_replanned(model, step: WrappedTrainStep) -> None:
    """Drop the cached training function where the next trace would plan differently: for
    another batch size, or under another calibration."""
    if model.train_function is None or step.traced_checkpoints is None:
        return
    # What the next trace would plan for (a calibrated budget: the batch it was measured on,
    # which is not always the size fit or train_on_batch first read).
    batch_size = step.planned_batch_size()
    # Calibrated budgets of two keys may have equal fractions (Budget equality ignores the
    # calibration record), yet their traces differ: compare the keys.
    replanned = (step.calibration_key != step.traced_key if step.needs_calibration()
                 else step.planned_checkpoints() != step.traced_checkpoints)
    if replanned or (batch_size is not None and batch_size != step.traced_batch_size):
        _LOG.info("memsave_grads.keras: %s: planning the step again (batches of %s, %s; "
                  "it was planned for %s, %s)", model.name, batch_size,
                  _describe_checkpoints(step.planned_checkpoints()), step.traced_batch_size,
                  _describe_checkpoints(step.traced_checkpoints))
        model.train_function = None


def _describe_checkpoints(checkpoints) -> str:
    """A step's planned checkpoints (parsed, a calibrated budget, or None) for a message."""
    return checkpoints.describe() if checkpoints is not None else repr(checkpoints)


def _calibrate_for_batch(model, step: WrappedTrainStep, batch, static: bool,
                         examples: int | None = None) -> None:
    """Calibrate ``step``'s budget on ``batch`` (``(x, y)``, or None: a random batch of
    ``examples``, by default the step's batch size) traced as the training function will trace
    it (``static``: with its batch size in the shapes), unless already done for its size; where
    it cannot be, plan on the prediction (``fallback="warn"``: one warning) or raise
    (``"error"``)."""
    asked = step.asked.budget
    step.forget_calibrations_if_recompiled()
    if batch is not None:
        examples = batches.leading_dimension(batch[0])
    elif examples is None:
        examples = step.batch_size or step.fit_batch_size
    if not getattr(model, "built", True):
        step.calibration_key = None
        if None not in step.calibrated:
            _calibration_failed(model, step, asked, "the model is not built yet, and its "
                                "variables are made by the first step (give it an Input, or "
                                "call model.build(input_shape) before fit)")
            step.calibrated[None] = dataclasses.replace(asked, calibrate=False)
        return
    if examples is None:
        step.calibration_key = None
        if None not in step.calibrated:
            _calibration_failed(model, step, asked, "the batch size cannot be read without "
                                "drawing from the data (pass wrap_model(..., batch_size=N))")
            step.calibrated[None] = dataclasses.replace(asked, calibrate=False)
        return
    key = (examples, static)
    step.calibration_key = key
    if key in step.calibrated:
        return
    if getattr(model, "jit_compile", False) is True:
        _LOG.warning("memsave_grads.keras: %s: the step is compiled by XLA, and %s is "
                     "calibrated on the step without XLA, whose peak XLA's scheduling may "
                     "move either way; measure the result (fit-limit) before relying on it.",
                     model.name, asked.describe())
    _LOG.info("memsave_grads.keras: %s: calibrating %s on a batch of %d (%s)", model.name,
              asked.describe(), examples, "its size in the trace" if static else
              "an unknown batch dimension in the trace, as fit traces it")
    fallback = step.options.fallback
    try:
        calibrated = calibration.calibrate_model(model, asked, batch_size=examples, data=batch,
                                                 static_batch=static)
    except errors.InfeasibleBudgetError as infeasible:
        if fallback == "error":
            raise
        calibrated = calibration.smallest_measured_budget(asked, infeasible)
        _LOG.warning("memsave_grads.keras: %s: %s Training goes on with %s.", model.name,
                     infeasible, "the plan of the smallest measured peak"
                     if calibrated is not None else "plain tf.gradients, which measured "
                     "no more than any plan")
        if calibrated is None and not getattr(infeasible, "calibration", None):
            calibrated = dataclasses.replace(asked, calibrate=False)
    except (*errors.FALLBACK_ERRORS, tf.errors.OpError) as failure:
        if fallback == "error":
            raise
        _calibration_failed(model, step, asked, f"calibration failed: {failure}")
        calibrated = dataclasses.replace(asked, calibrate=False)
    step.calibrated[key] = calibrated


def _calibration_failed(model, step: WrappedTrainStep, asked: budgets.Budget,
                        why: str) -> None:
    if step.options.fallback == "error":
        raise errors.InvalidArgumentError(
            f"checkpoints: {asked.describe()} of {getattr(model, 'name', 'model')} cannot be "
            f"calibrated: {why}. Calibrate with memsave_grads.calibrate_budget(model, budget, "
            "data=(x, y)) and wrap with its result, or wrap with fallback='warn' to plan on "
            "the prediction.")
    _LOG.warning("memsave_grads.keras: %s: %s cannot be calibrated (%s); it is planned on "
                 "the predicted peak.", getattr(model, "name", "model"), asked.describe(),
                 why)


def is_wrapped(model: object) -> bool:
    """Whether :func:`wrap_model` has wrapped this model object."""
    return isinstance(getattr(model, "__dict__", {}).get("train_step"), WrappedTrainStep)


def wrapped_step(model) -> WrappedTrainStep | None:
    """The step :func:`wrap_model` gave this model, or None."""
    step = getattr(model, "__dict__", {}).get("train_step")
    return step if isinstance(step, WrappedTrainStep) else None


def wrap_model(model: _Model, checkpoints: api.Checkpoints = "memory",
               fallback: str = "warn", recompute_cells: bool = True,
               release_gradients_early: bool = False, batch_size: int | None = None) -> _Model:
    """Make ``model.fit`` (and ``train_on_batch``) compute gradients with memsave_grads.

    Patches **this model object in place** and returns it: its ``train_step`` becomes
    :func:`train_step` with these arguments. The model's ``jit_compile`` (True, False or
    Keras 3's "auto") is kept: under XLA the recomputation waits for its gradients through
    dataflow (docs/design.md, note "ordering under XLA"). The cached training function is
    dropped, so the next ``fit`` traces the new step. The class, other models, ``evaluate``
    and ``predict`` are unchanged; compiling again keeps the wrapping; :func:`unwrap_model`
    undoes it. Saved models do not remember it (wrap again after loading). Wrapping a wrapped
    model replaces its settings.

    Args:
      model: a compiled Keras model: tf_keras (Keras 2), or Keras 3 (``keras`` / ``tf.keras``
        in TF >= 2.16) with the TensorFlow backend. Where its class defines its own
        ``train_step``, that step runs as written, each ``tf.GradientTape`` in it computing
        its gradients with memsave_grads (design note "tape routing").
      checkpoints: as in :func:`memsave_grads.gradients`: ``"memory"`` (default), ``"speed"``,
        a budget, or a list of op-name patterns (not tensors: the step is traced later). A
        budget asking for calibration (``"budget:50%:calibrated"``,
        ``Budget(fraction=0.5, calibrate=True)``) is held against *measured* peaks: before
        ``fit`` (or ``train_on_batch``) first trains on batches of a size, it runs
        :func:`memsave_grads.calibrate_budget` on one of them (the first ``batch_size``
        examples of arrays, a dataset's first batch; a random batch for generators), traced
        as the training function will be, then plans with the result (design note
        "calibrated budgets"). That costs the plain step and 2-6 plans' steps, once per batch
        size; every variable they change is restored. It needs the plain step to fit.
      fallback: ``"warn"`` (default) or ``"error"``; see :func:`train_step`. For a calibrated
        budget, ``"warn"`` also trains with the plan of the smallest measured peak where no
        plan measured within the budget (one warning with the numbers), and on the
        prediction where the step cannot be measured; ``"error"`` raises.
      recompute_cells: Keras 3 recurrent layers recompute inside their loop (default); see
        :func:`train_step`.
      release_gradients_early: apply each weight's update as soon as its gradient is
        complete (default False); see :func:`train_step`. Checked against the optimizer
        here and again when the step is traced (compiling again may change it). Without it
        the step still makes each update wait for its own gradient where the optimizer
        allows (see :func:`train_step`).

    Returns:
      ``model`` itself.

    Raises:
      InvalidTypeError: not a Keras model, or checkpoints of a type we cannot use.
      InvalidArgumentError: not compiled, running eagerly, built in a TF1 graph, defining its
        own ``train_step`` with ``release_gradients_early``, or a bad ``fallback``;
        UnknownStrategyError for an unknown name; a budget to calibrate on a model under a
        ``tf.distribute`` strategy.
      AllocatorStatsUnavailableError: a budget to calibrate where the allocator keeps no
        statistics (on CPU, set ``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow starts).
      MissingDependencyError: its Keras package cannot be imported.
    """
    flavour = flavour_lib.flavour_of(model)
    parsed = checks.check_options(checkpoints, fallback, can_calibrate=True)
    step_lib.check_flags(recompute_cells, release_gradients_early)
    _validate.check_batch_size(batch_size, allow_none=True)
    checks.check_model(model, flavour, "wrap_model")
    checks.check_own_train_step_options(model, flavour, release_gradients_early)
    if release_gradients_early:
        updates.check_early_release(model, flavour)
    step = WrappedTrainStep(model, flavour, step_lib.StepOptions(
        parsed, fallback, recompute_cells, release_gradients_early, batch_size))
    if step.needs_calibration():
        checks.check_calibration_possible(model)
    if is_wrapped(model):
        _LOG.info("memsave_grads.keras: re-wrapping %s with checkpoints=%r", model.name,
                  checkpoints)
    model.train_step = step
    model.fit = _WrappedFit(model)
    model.train_on_batch = _WrappedTrainOnBatch(model)
    model.train_function = None
    _LOG.info("memsave_grads.keras: wrapped %s (%s), checkpoints=%r", model.name,
              flavour.name, checkpoints)
    return model


def unwrap_model(model: _Model) -> _Model:
    """Undo :func:`wrap_model`: the model trains with its class's ``train_step`` again.

    Returns ``model``.

    Raises:
      InvalidArgumentError: the model is not wrapped.
    """
    flavour_lib.flavour_of(model)
    if not is_wrapped(model):
        raise errors.InvalidArgumentError(
            f"model: unwrap_model: {getattr(model, 'name', model)!r} is not wrapped; "
            "check memsave_grads.keras.is_wrapped(model).")
    for wrapped in ("train_step", "fit", "train_on_batch"):
        model.__dict__.pop(wrapped, None)
    model.train_function = None
    return model
