"""Keras integration: make ``model.fit`` compute its gradients with memsave_grads.

Keras trains inside a ``tf.function`` and differentiates with ``tf.GradientTape``.
:func:`wrap_model` replaces the model's training step (on that one model object) by
:func:`train_step`: the stock Keras step, with the one ``tape.gradient`` call replaced by
:func:`memsave_grads.gradients` on the traced graph. A model whose class defines its own
``train_step`` keeps it, with its tapes routed (:mod:`memsave_grads.tape`).

Both Keras 2 (``tf_keras``) and Keras 3 with the TensorFlow backend (``keras``, which is
``tf.keras`` in TensorFlow >= 2.16) are supported. Neither is imported by this module: each is
imported when a model of its kind is wrapped (docs/keras.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import weakref
from typing import TypeVar

import tensorflow as tf
from absl import logging

from memsave_grads import _validate
from memsave_grads import api
from memsave_grads import errors
from memsave_grads import measure
from memsave_grads import optimize
from memsave_grads import recomputation
from memsave_grads import tape
from memsave_grads._tf import early_release
from memsave_grads._tf import graph as tf_graph
from memsave_grads._tf import grappler_options
from memsave_grads._tf import ordering
from memsave_grads.core import budgets
from memsave_grads.core import calibration as core_calibration

KERAS2 = "Keras 2 (tf_keras)"
KERAS3 = "Keras 3"


#: A Keras 2 or Keras 3 model: wrap_model and unwrap_model return the model they are given.
_Model = TypeVar("_Model")


# --------------------------------------------------------------------------------------------
# Which Keras, imported lazily
# --------------------------------------------------------------------------------------------

def _import_tf_keras():
    try:
        import tf_keras  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise errors.MissingDependencyError(
            "model: this is a Keras 2 model, and memsave_grads.keras needs the tf_keras package "
            "to train it, which could not be imported. Install it with `pip install tf-keras` "
            "(or `pip install memsave-grads[keras]`).") from e
    return tf_keras


def _import_keras3():
    try:
        import keras  # pylint: disable=import-outside-toplevel
        from keras.src.backend.tensorflow import trainer  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise errors.MissingDependencyError(
            "model: this is a Keras 3 model, and memsave_grads.keras needs Keras 3 with its "
            "TensorFlow backend (keras.src.backend.tensorflow), which could not be imported. "
            "Install it with `pip install 'keras>=3'`, or use Keras 2: `pip install tf-keras`."
        ) from e
    return keras, trainer


def _class_modules(model) -> list[str]:
    return [getattr(cls, "__module__", "") or "" for cls in type(model).__mro__]


def keras_version(model) -> str:
    """:data:`KERAS2` or :data:`KERAS3` for a Keras model; our errors for anything else.

    Raises:
      InvalidTypeError: ``model`` is not a Keras ``Model``.
      MissingDependencyError: the Keras package the model comes from cannot be imported.
      InvalidArgumentError: a Keras 3 model on a backend other than TensorFlow.
    """
    modules = _class_modules(model)
    if any(m == "tf_keras" or m.startswith("tf_keras.") for m in modules):
        tf_keras = _import_tf_keras()
        if isinstance(model, tf_keras.Model):
            return KERAS2
    elif any(m == "keras" or m.startswith("keras.") for m in modules):
        keras, _ = _import_keras3()
        if isinstance(model, keras.Model):
            if keras.backend.backend() != "tensorflow":
                raise errors.InvalidArgumentError(
                    f"model: Keras 3 runs on the {keras.backend.backend()!r} backend; "
                    "memsave_grads rewrites TensorFlow graphs, so it needs "
                    "KERAS_BACKEND=tensorflow (set before importing keras).")
            return KERAS3
    raise errors.InvalidTypeError(
        f"model: expected a Keras Model (tf_keras.Model for Keras 2, or keras.Model / tf.keras."
        f"Model for Keras 3), got {type(model).__module__}.{type(model).__qualname__}: "
        f"{model!r:.80}. For a custom training loop call memsave_grads.gradients in your own "
        "tf.function instead.")


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------

#: Why ``wrap_model`` takes name patterns, not tensors (``_validate.check_checkpoints``).
_TENSORS_UNAVAILABLE = (
    "Keras traces the training step after wrap_model returns, so tensors of that graph do not "
    "exist yet; name the ops to keep with glob patterns such as '*dense_3*/Tanh'.")


def _check_options(checkpoints, fallback, can_calibrate: bool = False) -> None:
    """What can be checked before Keras traces the step; tensors of that graph do not exist
    yet, so a list must hold name patterns."""
    _validate.check_deferred_options(checkpoints, fallback,
                                     tensors_unavailable=_TENSORS_UNAVAILABLE,
                                     can_calibrate=can_calibrate)


def _is_compiled(model, version: str) -> bool:
    flag = "_is_compiled" if version == KERAS2 else "compiled"
    return bool(getattr(model, flag, False)) and getattr(model, "optimizer", None) is not None


def _stock_train_step(version: str):
    if version == KERAS2:
        return _import_tf_keras().Model.train_step
    _, trainer = _import_keras3()
    return trainer.TensorFlowTrainer.train_step


def _check_compiled(model, version: str, action: str) -> None:
    if not _is_compiled(model, version):
        keeps = "; compiling again later keeps the wrapping" if action == "wrap_model" else ""
        raise errors.InvalidArgumentError(
            f"model: {action}: the model is not compiled (no optimizer yet). Call "
            f"model.compile(optimizer=..., loss=...) first{keeps}.")


def check_trainable(model, version: str, action: str) -> None:
    """What a training step to plan or measure needs from a Keras model (``explain``,
    ``fit-limit``): compiled, with weights to train. Our errors, raised before anything is
    traced, naming ``action``. (``wrap_model`` accepts a frozen model: its layers may be
    unfrozen and the model compiled again later.)"""
    _check_compiled(model, version, action)
    if not model.trainable_weights:
        raise errors.InvalidArgumentError(
            f"model: {action}: {getattr(model, 'name', 'the model')!r} has no trainable "
            f"weights ({len(model.weights)} weights, all frozen or none), so a training step "
            "computes no gradient: nothing to plan or save. Set trainable=True on the layers to "
            "train.")


def _check_model(model, version: str, action: str) -> None:
    if version == KERAS2 and any(".training_v1" in m for m in _class_modules(model)):
        raise errors.InvalidArgumentError(
            f"model: {action}: this tf_keras model was built in a TF1 (v1) graph, where Keras "
            "trains with tf.gradients and no train_step: use `with memsave_grads.patch("
            "'memory'): model.fit(...)` there instead.")
    _check_compiled(model, version, action)
    if model.run_eagerly:
        raise errors.InvalidArgumentError(
            f"model: {action}: the model runs eagerly (run_eagerly=True, a dynamic model, or "
            "tf.config.run_functions_eagerly(True)); memsave_grads rewrites the traced graph of "
            "the training step, which eager execution does not build. Compile with "
            "run_eagerly=False.")


def has_own_train_step(model, version: str) -> bool:
    """Whether the model's class overrides Keras' ``train_step``: wrap_model then runs that step
    with its tapes routed (design note "tape routing") instead of replacing it."""
    return type(model).train_step is not _stock_train_step(version)


def _own_train_step(model, data, checkpoints, fallback, recompute_cells: bool,
                    batch_size: int | None):
    """The model's own ``train_step`` (its class's), each ``tf.GradientTape`` in it computing its
    gradient with memsave_grads (``memsave_grads.tape``); None: as it is (a calibration's plain
    step)."""
    step = functools.partial(type(model).train_step, model, data)
    if checkpoints is None:
        return step()
    version = keras_version(model)
    with tf_graph.assumed_batch_size(_planned_batch_size(model, data, checkpoints, batch_size)), (
            recomputed_recurrent_cells(model) if _recompute_cells_here(model, recompute_cells)
            else contextlib.nullcontext()):
        return tape.run_with_routed_tapes(step, checkpoints, fallback,
                                          caller=f"memsave_grads.keras ({version})")


# --------------------------------------------------------------------------------------------
# The training step
# --------------------------------------------------------------------------------------------

def _gradients(loss, variables, checkpoints, fallback, applied_together: bool = True):
    """The gradients of ``loss``, planned for an optimizer that applies them together unless
    not ``applied_together`` (the step whose updates wait for their own gradients): Keras'
    sum over replicas holds every weight gradient until the last is done (measured on tf_keras:
    128 MiB on a 6 x 2048^2 MLP whose gradients are 96), and so do steps that need them all."""
    if checkpoints is None:  # the plain step: calibrate_budget's reference
        return tf_graph.ORIGINAL_GRADIENTS(loss, variables)
    with api.gradients_applied_together() if applied_together else contextlib.nullcontext():
        return api.gradients_or_fallback(loss, variables, None, checkpoints, fallback,
                                         "memsave_grads.keras")


def _check_step(model) -> None:
    if tf.executing_eagerly():
        raise errors.EagerExecutionError(
            "model: memsave_grads.keras.train_step ran eagerly; it rewrites the traced graph of "
            "the training step. Compile with run_eagerly=False (and leave "
            "tf.config.run_functions_eagerly off), or call it inside a tf.function.")
    if getattr(model, "optimizer", None) is None:
        raise errors.InvalidArgumentError(
            "model: the model has no optimizer. Call model.compile(optimizer=..., loss=...) "
            "first.")


def _forward_and_loss(model, version: str, x, y, sample_weight):
    """(y_pred, loss) as the stock train_step of the model's Keras computes them: the
    forward pass with ``training=True``, then the compiled loss plus ``model.losses``."""
    if version == KERAS2:
        y_pred = model(x, training=True)
        return y_pred, model.compute_loss(x, y, y_pred, sample_weight)
    # pylint: disable=protected-access
    if getattr(model, "_call_has_training_arg", True):
        y_pred = model(x, training=True)
    else:
        y_pred = model(x)
    if hasattr(model, "_compute_loss"):
        return y_pred, model._compute_loss(x=x, y=y, y_pred=y_pred,
                                           sample_weight=sample_weight, training=True)
    return y_pred, model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)


# Design note "recurrent layers": a Keras 3 recurrent layer runs its cell in a while loop, and the
# loop's gradient stores every tensor of every step that the cell's gradient reads (gates and
# their activations), which the planner cannot reach: to it the loop is one op. For the traced
# training step only, each recurrent layer's cell ``call`` is wrapped in recompute(), which
# keeps just the step's inputs, states, outputs and stateful draws and replays the rest in the
# backward iteration (docs/recurrent.md). Keras 3 makes the dropout masks before the loop, so
# they are inputs of the cell and never redrawn. A layer that runs a fused kernel instead of its
# cell (cuDNN on GPU, tf_keras's LSTM and GRU) does not call the cell, and keeps its own memory.

def _recurrent_cells(model, version: str) -> list:
    """The cells of the model's Keras 3 recurrent layers (LSTM, GRU, SimpleRNN, RNN(cell),
    ConvLSTM, inside Bidirectional and nested models), once each."""
    if version != KERAS3:
        return []
    keras, _ = _import_keras3()
    cells = []
    for layer in _all_layers(model):
        cell = getattr(layer, "cell", None)
        if isinstance(layer, keras.layers.RNN) and cell is not None and not any(
                cell is c for c in cells):
            cells.append(cell)
    return cells


def _recomputed_call(call):
    """``cell.call`` whose gradient recomputes the cell's internals (keyword arguments, such
    as ``training``, are bound: recompute() takes positional tensors)."""

    @functools.wraps(call)
    def recomputed(inputs, states, *args, **kwargs):
        def step(step_inputs, step_states):
            return call(step_inputs, step_states, *args, **kwargs)
        return recomputation.recompute(step)(inputs, states)

    return recomputed


#: Models already told that XLA keeps their recurrent cells as Keras builds them.
_WARNED_XLA_CELLS: "weakref.WeakSet" = weakref.WeakSet()


@contextlib.contextmanager
def _overridden(pairs):
    """Set instance attributes ``(obj, name, value)`` for the duration of a trace, and put
    back what each object had (its own attribute, or none: the class's). object.__setattr__,
    because Keras's own __setattr__ would track the value."""
    saved = []
    try:
        for obj, name, value in pairs:
            saved.append((obj, name, obj.__dict__.get(name, _ABSENT)))
            object.__setattr__(obj, name, value)
        yield
    finally:
        for obj, name, original in reversed(saved):
            if original is _ABSENT:
                obj.__dict__.pop(name, None)
            else:
                object.__setattr__(obj, name, original)


_ABSENT = object()


def _recompute_cells_here(model, recompute_cells: bool) -> bool:
    """Whether this trace recomputes the cells: asked for, and not under XLA. Compiled by XLA,
    a recomputed cell raised the peak (Keras 3 LSTM(256), batch 32, T = 600, CPU: stock
    747 MiB, recomputed 806 MiB; docs/recurrent.md), so there the loops stay as Keras builds
    them, with one warning per model."""
    if not recompute_cells or not ordering.xla_in_effect():
        return recompute_cells
    if _recurrent_cells(model, keras_version(model)) and model not in _WARNED_XLA_CELLS:
        _WARNED_XLA_CELLS.add(model)
        logging.warning(
            "memsave_grads.keras: %s's step is compiled by XLA (its jit_compile, which 'auto' "
            "turns on for GPUs, or XLA auto-clustering), where recomputing inside a recurrent "
            "layer's loop raised the peak when measured; its recurrent cells are left as Keras "
            "builds them. Compile without XLA to recompute inside the loops "
            "(docs/recurrent.md).", getattr(model, "name", model))
    return False


@contextlib.contextmanager
def recomputed_recurrent_cells(model):
    """Within this context, the cells of ``model``'s Keras 3 recurrent layers recompute their
    internals in the backward loop (design note "recurrent layers"); outside it, nothing on the
    model changes. :func:`train_step` traces the forward pass inside it."""
    cells = _recurrent_cells(model, keras_version(model))
    with _overridden([(cell, "call", _recomputed_call(cell.call)) for cell in cells]):
        if cells:
            logging.vlog(1, "memsave_grads.keras: recomputing inside the loops of %d recurrent "
                         "cell(s) of %s", len(cells), getattr(model, "name", model))
        yield cells


def _train_step_keras2(model, data, checkpoints, fallback, release_gradients_early):
    tf_keras = _import_tf_keras()
    x, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(data)
    y_pred, loss = _forward_and_loss(model, KERAS2, x, y, sample_weight)
    if hasattr(model, "_validate_target_and_loss"):
        model._validate_target_and_loss(y, loss)  # pylint: disable=protected-access
    optimizer = model.optimizer
    variables = list(model.trainable_variables)
    if variables and _updates_wait_for_gradients(model, KERAS2, release_gradients_early):
        _apply_releasing_early(model, KERAS2, loss, checkpoints, fallback,
                               release_gradients_early)
    else:
        # What optimizer.minimize(loss, variables, tape=tape) does, with our gradients; a
        # LossScaleOptimizer (legacy or not) scales the loss and unscales the gradients.
        loss_scaled = _loss_scaled(optimizer, KERAS2)
        target = optimizer.get_scaled_loss(loss) if loss_scaled else loss
        grads = _gradients(target, variables, checkpoints, fallback)
        if loss_scaled:
            grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(zip(grads, variables))
    return model.compute_metrics(x, y, y_pred, sample_weight)


def _train_step_keras3(model, data, checkpoints, fallback, recompute_cells,
                       release_gradients_early):
    # TensorFlowTrainer.train_step of Keras 3 (keras/src/backend/tensorflow/trainer.py), with
    # tape.gradient replaced; a LossScaleOptimizer scales in scale_loss and unscales (and skips
    # non-finite steps) in apply_gradients, as in the stock step.
    keras, _ = _import_keras3()
    from keras.src.losses import loss as loss_module  # pylint: disable=import-outside-toplevel
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    recompute_here = _recompute_cells_here(model, recompute_cells)
    with recomputed_recurrent_cells(model) if recompute_here else contextlib.nullcontext():
        y_pred, loss = _forward_and_loss(model, KERAS3, x, y, sample_weight)
    # pylint: disable=protected-access
    first_input = next(i for i in tf.nest.flatten(x) if i is not None)
    model._loss_tracker.update_state(loss_module.unscale_loss_for_distribution(loss),
                                     sample_weight=tf.shape(first_input)[0])
    # pylint: enable=protected-access
    if model.optimizer is not None:
        loss = model.optimizer.scale_loss(loss)
    if model.trainable_weights and _updates_wait_for_gradients(model, KERAS3,
                                                                release_gradients_early):
        _apply_releasing_early(model, KERAS3, loss, checkpoints, fallback,
                               release_gradients_early)
    elif model.trainable_weights:
        variables = list(model.trainable_weights)
        grads = _gradients(loss, variables, checkpoints, fallback)
        model.optimizer.apply_gradients(zip(grads, variables))
    else:
        logging.warning("memsave_grads.keras: the model has no trainable weights.")
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


# Design note "early release" (docs/design.md), for Keras' fit (3 and tf_keras): each weight's
# update runs as soon as its gradient is complete, and the next gradient waits for it, so one
# weight gradient is alive at a time instead of all of them (memsave_grads.minimize does the
# same in a step of one's own). The optimizer's own apply_gradients builds the updates; its
# iterations, learning-rate schedule and weight decay are untouched.

def _check_early_release(model, version: str) -> None:
    """What cannot be released early, refused before the step is traced."""
    reason = _early_release_refusal(model, version)
    if reason is not None:
        raise errors.InvalidArgumentError(
            f"release_gradients_early: the optimizer {type(model.optimizer).__name__} cannot "
            f"update the weights one by one: {reason}.")


def _loss_scaled(optimizer, version: str) -> bool:
    """Whether the optimizer scales the loss (and checks every gradient is finite)."""
    if version == KERAS2:  # tf_keras' LossScaleOptimizer, legacy or not
        return (hasattr(optimizer, "get_scaled_loss")
                and hasattr(optimizer, "get_unscaled_gradients"))
    keras, _ = _import_keras3()
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def _early_release_refusal(model, version: str) -> str | None:
    """Why a Keras model's optimizer cannot update its weights one by one, or None."""
    optimizer = model.optimizer
    strategy = getattr(model, "distribute_strategy", None)
    distributed = tf.distribute.has_strategy() or (
        strategy is not None and strategy is not tf.distribute.get_strategy())
    if _loss_scaled(optimizer, version):
        reason = ("it is a LossScaleOptimizer, which checks that every gradient is finite "
                  "before it applies any; train in float32, or without release_gradients_early")
    elif getattr(optimizer, "global_clipnorm", None):
        reason = ("global_clipnorm scales every gradient by the norm of all of them, which is "
                  "known only when the last one is; use clipnorm or clipvalue (per weight)")
    elif getattr(optimizer, "gradient_accumulation_steps", None):
        reason = ("gradient_accumulation_steps adds the gradients up over several steps; "
                  "accumulate with a larger batch instead, which memsave_grads makes room for")
    elif distributed:
        reason = (f"under {type(strategy or tf.distribute.get_strategy()).__name__} it "
                  "sums every gradient over the strategy's replicas in one op (even with one "
                  "replica); wrap without release_gradients_early")
    elif version == KERAS3 and not hasattr(type(optimizer), _KERAS_GRADIENT_SUM):
        reason = (f"this Keras has no {type(optimizer).__name__}.{_KERAS_GRADIENT_SUM}, the "
                  "one-op sum over replicas that the wrapped step skips; wrap without "
                  "release_gradients_early, and please report the Keras version")
    elif version == KERAS2:
        reason = _keras2_sum_refusal(optimizer)
    else:
        reason = None
    return reason


def _takes_keyword(function, name: str) -> bool:
    """Whether ``function`` accepts the keyword argument ``name`` (by name or ``**kwargs``)."""
    parameters = inspect.signature(function).parameters.values()
    return any(p.name == name and p.kind is not inspect.Parameter.POSITIONAL_ONLY
               or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _keras2_sum_refusal(optimizer) -> str | None:
    """Why a tf_keras optimizer's ``apply_gradients`` cannot skip its sum over replicas
    (``experimental_aggregate_gradients=False``) without changing the step, or None."""
    tf_keras = _import_tf_keras()
    new, legacy = tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer
    cls = type(optimizer)
    if not isinstance(optimizer, (new, legacy)) or not _takes_keyword(
            cls.apply_gradients, "experimental_aggregate_gradients"):
        # tf_keras' wrapper of a tf.compat.v1.train optimizer, or a subclass whose own
        # apply_gradients leaves the argument out (OptimizerV2's _HAS_AGGREGATE_GRAD says so
        # where it is False, but Ftrl leaves it False and takes the argument all the same).
        return (f"its apply_gradients takes no experimental_aggregate_gradients, so it sums "
                "every gradient in one op; use a tf_keras optimizer (tf_keras.optimizers.* or "
                "tf_keras.optimizers.legacy.*) whose apply_gradients takes it, or wrap without "
                "release_gradients_early")
    if isinstance(optimizer, new):
        custom = cls.aggregate_gradients is not new.aggregate_gradients
    else:
        # pylint: disable=protected-access
        aggregator = getattr(optimizer, "gradient_aggregator", None)
        custom = (cls._aggregate_gradients is not legacy._aggregate_gradients
                  or (cls._transform_unaggregated_gradients
                      is not legacy._transform_unaggregated_gradients)
                  or getattr(aggregator, "__name__", None) != "all_reduce_sum_gradients")
        # pylint: enable=protected-access
    if custom:
        return ("it aggregates the gradients its own way (aggregate_gradients, "
                "_aggregate_gradients or gradient_aggregator), which the ordered step would "
                "skip; wrap without release_gradients_early")
    return None


def _updates_wait_for_gradients(model, version: str, release_gradients_early: bool) -> bool:
    """Whether the wrapped step builds each weight's update to wait for its own gradient
    (design note "early release"): always with ``release_gradients_early``, and by default
    where nothing needs all the gradients at once (outside a strategy, no loss scaling, no
    global clipping or gradient accumulation, not under XLA, which drops the edges).
    Otherwise the optimizer holds every weight gradient until the last is done."""
    if release_gradients_early:
        return True
    if getattr(model, "optimizer", None) is None:
        return False
    return (_early_release_refusal(model, version) is None
            and not ordering.xla_in_effect(tf.compat.v1.get_default_graph()))


#: The Keras 3 TensorFlow optimizer's sum of the gradients over replicas (private API): one op
#: over all of them, even outside a strategy; the early-release step skips it.
_KERAS_GRADIENT_SUM = "_all_reduce_sum_gradients"


def _apply_releasing_early(model, version: str, loss, checkpoints, fallback,
                           release_order: bool) -> None:
    """Gradients, then the optimizer's updates, each waiting for its own gradient; with
    ``release_order``, also one gradient alive at a time (``optimize.order_updates_early``)."""
    optimizer = model.optimizer
    variables = list(model.trainable_weights)
    graph = tf.compat.v1.get_default_graph()
    grad_floor = early_release.last_op_id(graph)
    grads = _gradients(loss, variables, checkpoints, fallback, applied_together=False)
    apply_floor = early_release.last_op_id(graph)
    # Outside a strategy the sum over one replica is the gradients themselves, but Keras builds
    # it as one op over all of them, which would hold every gradient until the last is
    # complete. tf_keras skips it when asked (as minimize() asks); Keras 3 has no such
    # argument, so its sum is replaced for this call. Strategies never get here:
    # release_gradients_early refuses them (_check_early_release) and the default step takes
    # this path only where _early_release_refusal finds nothing.
    if version == KERAS2:
        optimizer.apply_gradients(zip(grads, variables), experimental_aggregate_gradients=False)
        tf_variables = variables
    else:
        keras, _ = _import_keras3()
        with _overridden([(optimizer, _KERAS_GRADIENT_SUM, list)]):
            optimizer.apply_gradients(zip(grads, variables))
        tf_variables = [v.value if isinstance(v, keras.Variable) else v for v in variables]
    handles = [tf.convert_to_tensor(v.handle) for v in tf_variables]
    optimize.order_updates_early(loss, tf_variables, handles, grads, grad_floor, apply_floor,
                                 type(optimizer).__name__, "memsave_grads.keras",
                                 release_order=release_order)


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
    version = keras_version(model)
    _check_flags(recompute_cells=recompute_cells,
                 release_gradients_early=release_gradients_early)
    _validate.check_batch_size(batch_size, allow_none=True)
    _check_step(model)
    if release_gradients_early:
        _check_early_release(model, version)
    with tf_graph.assumed_batch_size(_planned_batch_size(model, data, checkpoints, batch_size)):
        if version == KERAS2:
            return _train_step_keras2(model, data, checkpoints, fallback,
                                      release_gradients_early)
        return _train_step_keras3(model, data, checkpoints, fallback, recompute_cells,
                                  release_gradients_early)


# Design note "unknown batch size": fit traces its step from a dataset whose batch dimension is
# None (the last batch may be smaller), and the memory model counts an unknown dimension as 1.
# Planned per example, a budget compares a batch of activations with a single example's, so
# weights and their gradients look as large as the whole forward pass: on a 12-layer 128-wide
# MLP, "budget:50%" per example has no plan (the smallest is 96% of plain), and for 512
# examples it plans (tests/test_unknown_batch.py).

#: Models already warned that their budget is planned per example.
_WARNED_PER_EXAMPLE: "weakref.WeakSet" = weakref.WeakSet()


def _planned_batch_size(model, data, checkpoints, batch_size: int | None) -> int | None:
    """The batch size the step's plan assumes where the trace leaves it unknown: ``batch_size``,
    else a calibrated budget's, else None (per example; one warning for a budget). None, too,
    where the traced batch size is known: nothing is assumed."""
    if checkpoints is None or not _batch_dimension_unknown(data):
        return None
    if batch_size is not None:
        return int(batch_size)
    budget = budgets.as_budget(checkpoints)
    calibration = getattr(budget, "calibration", None)
    if calibration is not None and calibration.batch_size is not None:
        return calibration.batch_size
    if budget is not None and model not in _WARNED_PER_EXAMPLE:
        _WARNED_PER_EXAMPLE.add(model)
        logging.warning(
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


def _check_flags(**flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise errors.InvalidTypeError(
                f"{name}: expected True or False, got {type(value).__name__}: {value!r:.60}.")


# --------------------------------------------------------------------------------------------
# wrap_model / unwrap_model
# --------------------------------------------------------------------------------------------

class _WrappedTrainStep:
    """What ``model.train_step`` becomes on a wrapped model (an instance attribute)."""

    def __init__(self, model, checkpoints, fallback, recompute_cells, release_gradients_early,
                 batch_size):
        self._model = weakref.ref(model)  # no reference cycle through the model's __dict__
        self.checkpoints = checkpoints
        self.fallback = fallback
        self.recompute_cells = recompute_cells
        self.release_gradients_early = release_gradients_early
        self.batch_size = batch_size
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

    def needs_calibration(self) -> bool:
        budget = budgets.as_budget(self.checkpoints)
        return budget is not None and budget.calibrate and budget.calibration is None

    def forget_calibrations_if_recompiled(self) -> None:
        """Drop the calibrations where the model was compiled again since they were measured:
        another optimizer (Adam keeps twice SGD's state) or loss moves the measured peaks."""
        compiled = _compiled_objects(self._model())
        measured_with = [None if ref is None else ref() for ref in self.calibrated_with]
        if self.calibrated_with and all(a is b for a, b in zip(measured_with, compiled)):
            return
        if self.calibrated:
            logging.info("memsave_grads.keras: %s was compiled again: its budget is "
                         "calibrated again", getattr(self._model(), "name", "model"))
        self.calibrated.clear()
        self.calibrated_with = tuple(None if o is None else weakref.ref(o) for o in compiled)

    def planned_checkpoints(self):
        """The checkpoints the next trace plans with: a budget asking for calibration is
        replaced by its calibration for the batch ``fit``/``train_on_batch`` runs."""
        if not self.needs_calibration():
            return self.checkpoints
        self.forget_calibrations_if_recompiled()  # traced by a path that calibrated nothing
        if self.calibration_key in self.calibrated:
            return self.calibrated[self.calibration_key]  # None: plain tf.gradients measured least
        # Traced by a path that ran nothing first (evaluate's or a custom loop's call of
        # make_train_function, fit with batches whose size cannot be read): planned on the
        # prediction; _calibrate_for_batch said why, or says so here once.
        uncalibrated = dataclasses.replace(budgets.as_budget(self.checkpoints), calibrate=False)
        if self not in _WARNED_UNCALIBRATED:
            _WARNED_UNCALIBRATED.add(self)
            logging.warning(
                "memsave_grads.keras: %s: the training step was traced before any batch "
                "was seen, so %s is planned on the predicted peak, not calibrated. fit "
                "and train_on_batch calibrate it on their batch first.",
                getattr(self._model(), "name", "model"), uncalibrated.describe())
        return uncalibrated

    def planned_batch_size(self) -> int | None:
        """The batch size the next trace plans for where it leaves the batch unknown: a
        calibrated budget's own (the batch it was measured on), else the one given to
        wrap_model, else the one fit or train_on_batch read (None: per example)."""
        calibrated = getattr(budgets.as_budget(self.planned_checkpoints()), "calibration", None)
        if self.needs_calibration() and calibrated is not None and calibrated.batch_size:
            return calibrated.batch_size
        return self.batch_size or self.fit_batch_size

    def __call__(self, data):
        self.traced_checkpoints = self.planned_checkpoints()
        self.traced_key = self.calibration_key
        planned = self.planned_batch_size()
        self.traced_batch_size = planned
        model = self._model()
        if has_own_train_step(model, keras_version(model)):
            return _own_train_step(model, data, self.traced_checkpoints, self.fallback,
                                   self.recompute_cells, planned)
        return train_step(model, data, checkpoints=self.traced_checkpoints,
                          fallback=self.fallback, recompute_cells=self.recompute_cells,
                          release_gradients_early=self.release_gradients_early,
                          batch_size=planned)

    def __repr__(self):
        return (f"<memsave_grads train_step checkpoints={self.checkpoints!r} "
                f"fallback={self.fallback!r} recompute_cells={self.recompute_cells!r} "
                f"release_gradients_early={self.release_gradients_early!r} "
                f"batch_size={self.batch_size!r}>")


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
            if isinstance(step, _WrappedTrainStep):
                if step.batch_size is None:
                    step.fit_batch_size = _fit_batch_size(type(model).fit, model, args, kwargs)
                if step.needs_calibration():
                    batch, static = _fit_calibration_batch(
                        type(model).fit, model, args, kwargs,
                        step.batch_size or step.fit_batch_size)
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
            if isinstance(step, _WrappedTrainStep):
                try:
                    bound = inspect.signature(type(model).train_on_batch).bind(
                        model, *args, **kwargs)
                except TypeError:  # train_on_batch itself will say what is wrong with the call
                    bound = None
                x, y = (bound.arguments.get("x"), bound.arguments.get("y")) if bound else (
                    None, None)
                if step.batch_size is None and step.fit_batch_size is None:
                    # Keras 3 traces the first size as it is, and the next one with an unknown
                    # batch dimension (reduce_retracing): that trace is planned for the size
                    # train_on_batch saw first, not per example (design note "unknown batch
                    # size").
                    step.fit_batch_size = _leading_dimension(x)
                if bound is not None and step.needs_calibration():
                    _calibrate_for_batch(model, step, (x, y) if y is not None else None, True,
                                         examples=_leading_dimension(x))
                    _retrace_if_replanned(model, step)
            return type(model).train_on_batch(model, *args, **kwargs)

    def __repr__(self):
        return "<memsave_grads train_on_batch: runs without Grappler's gradient accumulators>"


def _retrace_if_replanned(model, step: _WrappedTrainStep) -> None:
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
        logging.info("memsave_grads.keras: %s: planning the step again (batches of %s, %s; "
                     "it was planned for %s, %s)", model.name, batch_size,
                     _describe_checkpoints(step.planned_checkpoints()), step.traced_batch_size,
                     _describe_checkpoints(step.traced_checkpoints))
        model.train_function = None


def _describe_checkpoints(checkpoints) -> str:
    budget = budgets.as_budget(checkpoints)
    return budget.describe() if budget is not None else repr(checkpoints)


def _calibrate_for_batch(model, step: _WrappedTrainStep, batch, static: bool,
                         examples: int | None = None) -> None:
    """Calibrate ``step``'s budget on ``batch`` (``(x, y)``, or None: a random batch of
    ``examples``, by default the step's batch size) traced as the training function will trace
    it (``static``: with its batch size in the shapes), unless already done for its size; where
    it cannot be, plan on the prediction (``fallback="warn"``: one warning) or raise
    (``"error"``)."""
    asked = budgets.as_budget(step.checkpoints)
    step.forget_calibrations_if_recompiled()
    if batch is not None:
        examples = _leading_dimension(batch[0])
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
        logging.warning("memsave_grads.keras: %s: the step is compiled by XLA, and %s is "
                        "calibrated on the step without XLA, whose peak XLA's scheduling may "
                        "move either way; measure the result (fit-limit) before relying on it.",
                        model.name, asked.describe())
    logging.info("memsave_grads.keras: %s: calibrating %s on a batch of %d (%s)", model.name,
                 asked.describe(), examples, "its size in the trace" if static else
                 "an unknown batch dimension in the trace, as fit traces it")
    try:
        calibrated = calibrate_model(model, asked, batch_size=examples, data=batch,
                                     static_batch=static)
    except errors.InfeasibleBudgetError as infeasible:
        if step.fallback == "error":
            raise
        calibrated = _smallest_measured_budget(asked, infeasible)
        logging.warning("memsave_grads.keras: %s: %s Training goes on with %s.", model.name,
                        infeasible, "the plan of the smallest measured peak"
                        if calibrated is not None else "plain tf.gradients, which measured "
                        "no more than any plan")
        if calibrated is None and not getattr(infeasible, "calibration", None):
            calibrated = dataclasses.replace(asked, calibrate=False)
    except (*errors.FALLBACK_ERRORS, tf.errors.OpError) as failure:
        if step.fallback == "error":
            raise
        _calibration_failed(model, step, asked, f"calibration failed: {failure}")
        calibrated = dataclasses.replace(asked, calibrate=False)
    step.calibrated[key] = calibrated


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
    logging.info("memsave_grads: calibrated %s", calibrated.calibration)
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
    version = keras_version(model)
    _check_model(model, version, "calibrate_budget")
    if data is None:
        data = synthetic_batch(model, batch_size, sequence_length)
    x, y = tf.nest.map_structure(tf.convert_to_tensor, tuple(data))
    examples = int(tf.nest.flatten(x)[0].shape[0])
    specs = tf.nest.map_structure(
        lambda t: tf.TensorSpec(t.shape if static_batch else [None] + t.shape[1:], t.dtype),
        (x, y))
    wrapped = model.__dict__.get("train_step")
    settings = {"recompute_cells": getattr(wrapped, "recompute_cells", True),
                "release_gradients_early": getattr(wrapped, "release_gradients_early", False)}
    if version == KERAS3 and not model.optimizer.built:
        # As fit does before it traces: Keras 3 creates no variable inside a traced step.
        model.optimizer.build(model.trainable_variables)

    def measure_planned(planned):
        # The whole training step, updates included, as wrap_model's fit runs it; "error"
        # hands an infeasible budget to the search, which re-aims it.
        def step(x, y):
            if has_own_train_step(model, version):
                return _own_train_step(model, (x, y), planned, "error",
                                       settings["recompute_cells"], examples)
            return train_step(model, (x, y), checkpoints=planned, fallback="error",
                              batch_size=examples, **settings)
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


def _smallest_measured_budget(asked: budgets.Budget, infeasible) -> budgets.Budget | None:
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


def _calibration_failed(model, step: _WrappedTrainStep, asked: budgets.Budget,
                        why: str) -> None:
    if step.fallback == "error":
        raise errors.InvalidArgumentError(
            f"checkpoints: {asked.describe()} of {getattr(model, 'name', 'model')} cannot be "
            f"calibrated: {why}. Calibrate with memsave_grads.calibrate_budget(model, budget, "
            "data=(x, y)) and wrap with its result, or wrap with fallback='warn' to plan on "
            "the prediction.")
    logging.warning("memsave_grads.keras: %s: %s cannot be calibrated (%s); it is planned on "
                    "the predicted peak.", getattr(model, "name", "model"), asked.describe(),
                    why)


def _leading_dimension(value) -> int | None:
    leaves = [leaf for leaf in tf.nest.flatten(value) if hasattr(leaf, "shape")]
    if not leaves or not leaves[0].shape or not isinstance(leaves[0].shape[0], int):
        return None
    return int(leaves[0].shape[0])


def _fit_calibration_batch(fit, model, args, kwargs, batch_size: int | None):
    """``(batch, static)``: a batch of a ``fit(*args, **kwargs)`` call to calibrate on,
    ``(x, y)`` or None (a random batch of ``batch_size`` will do), and whether the training
    function will be traced with the batch size in its shapes.

    Arrays give their first ``batch_size`` examples; Keras 2 and 3 trace a static batch
    where every batch is full (the examples left after ``validation_split`` divide evenly),
    else an unknown one. A ``tf.data.Dataset`` gives its first element (one batch read) and its
    element spec says whether the batch size is static. Generators and ``PyDataset``s are
    not drawn from (a random batch, traced as unknown)."""
    try:
        bound = inspect.signature(fit).bind(model, *args, **kwargs)
    except TypeError:
        return None, False
    x, y = bound.arguments.get("x"), bound.arguments.get("y")
    if isinstance(x, tf.data.Dataset):
        spec = tf.nest.flatten(x.element_spec)
        shape = getattr(spec[0], "shape", None) if spec else None
        static = isinstance(shape, tf.TensorShape) and bool(shape.rank) and shape[0] is not None
        element = next(iter(x.take(1)), None)
        if isinstance(element, (tuple, list)) and len(element) >= 2 and element[1] is not None:
            return (element[0], element[1]), static
        return None, static
    examples = _leading_dimension(x)
    if examples is None or not batch_size:
        return None, False
    split = bound.arguments.get("validation_split") or 0.0
    if bound.arguments.get("validation_data") is not None:
        split = 0.0  # Keras ignores validation_split then
    training_examples = int(math.floor(examples * (1.0 - split)))
    # Fewer examples than a batch: one partial batch, traced as unknown.
    fit_batch = bound.arguments.get("batch_size") or KERAS_DEFAULT_BATCH_SIZE
    static = training_examples >= fit_batch and training_examples % fit_batch == 0
    size = min(batch_size, training_examples)
    if size < 1 or y is None or _leading_dimension(y) != examples:
        return None, static
    return tf.nest.map_structure(lambda a: a[:size], (x, y)), static


#: Keras' batch size when ``fit`` gets arrays and no ``batch_size`` (Keras 2 and 3).
KERAS_DEFAULT_BATCH_SIZE = 32


def _fit_batch_size(fit, model, args, kwargs) -> int | None:
    """The examples per batch a ``fit(*args, **kwargs)`` call trains on, where they can be read
    without drawing from the data: arrays (its ``batch_size``, Keras' default 32, at most the
    number of examples) or a ``tf.data.Dataset`` (a static batch dimension, or the size given
    to its last ``batch``). None for generators, ``Sequence``/``PyDataset`` and the like."""
    try:
        bound = inspect.signature(fit).bind(model, *args, **kwargs)
    except TypeError:  # fit itself will say what is wrong with the call
        return None
    x, batch_size = bound.arguments.get("x"), bound.arguments.get("batch_size")
    if isinstance(x, tf.data.Dataset):
        return _dataset_batch_size(x)
    leaves = [leaf for leaf in tf.nest.flatten(x) if hasattr(leaf, "shape")]
    if not leaves or not leaves[0].shape or not isinstance(leaves[0].shape[0], int):
        return None
    examples = int(leaves[0].shape[0])
    if isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size > 0:
        return min(batch_size, examples)
    return min(KERAS_DEFAULT_BATCH_SIZE, examples) if batch_size is None else None


def _dataset_batch_size(dataset) -> int | None:
    """A dataset's batch size: the constant ``batch_size`` of the nearest ``batch``/
    ``padded_batch`` upstream (``_batch_size``, private), else its static batch dimension,
    else None."""
    node = dataset
    while node is not None:
        size = getattr(node, "_batch_size", None)
        if size is not None:
            value = tf.get_static_value(size)
            return int(value) if value is not None and int(value) > 0 else None
        node = getattr(node, "_input_dataset", None)
    for spec in tf.nest.flatten(dataset.element_spec):
        shape = getattr(spec, "shape", None)
        if isinstance(shape, tf.TensorShape) and shape.rank:
            return int(shape[0]) if shape[0] is not None else None
    return None


def is_wrapped(model: object) -> bool:
    """Whether :func:`wrap_model` has wrapped this model object."""
    return isinstance(getattr(model, "__dict__", {}).get("train_step"), _WrappedTrainStep)


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
    version = keras_version(model)
    _check_options(checkpoints, fallback, can_calibrate=True)
    _check_flags(recompute_cells=recompute_cells,
                 release_gradients_early=release_gradients_early)
    _validate.check_batch_size(batch_size, allow_none=True)
    _check_model(model, version, "wrap_model")
    if release_gradients_early and has_own_train_step(model, version):
        raise errors.InvalidArgumentError(
            f"release_gradients_early: {type(model).__qualname__} defines its own train_step, "
            "which applies the gradients itself, so wrap_model cannot order the updates; wrap "
            "without release_gradients_early (its tapes are still routed), or call "
            "memsave_grads.keras.train_step(self, data, release_gradients_early=True) from it.")
    if release_gradients_early:
        _check_early_release(model, version)
    step = _WrappedTrainStep(model, checkpoints, fallback, recompute_cells,
                             release_gradients_early, batch_size)
    if step.needs_calibration():
        _check_calibration_possible(model)
    if is_wrapped(model):
        logging.info("memsave_grads.keras: re-wrapping %s with checkpoints=%r", model.name,
                     checkpoints)
    model.train_step = step
    model.fit = _WrappedFit(model)
    model.train_on_batch = _WrappedTrainOnBatch(model)
    model.train_function = None
    logging.info("memsave_grads.keras: wrapped %s (%s), checkpoints=%r", model.name, version,
                 checkpoints)
    return model


def unwrap_model(model: _Model) -> _Model:
    """Undo :func:`wrap_model`: the model trains with its class's ``train_step`` again.

    Returns ``model``.

    Raises:
      InvalidArgumentError: the model is not wrapped.
    """
    keras_version(model)
    if not is_wrapped(model):
        raise errors.InvalidArgumentError(
            f"model: unwrap_model: {getattr(model, 'name', model)!r} is not wrapped; "
            "check memsave_grads.keras.is_wrapped(model).")
    for wrapped in ("train_step", "fit", "train_on_batch"):
        model.__dict__.pop(wrapped, None)
    model.train_function = None
    return model


def _check_calibration_possible(model) -> None:
    """What a budget asking for calibration needs, checked at ``wrap_model``: allocator
    statistics (on CPU, an environment variable read when TensorFlow starts), and one device:
    the calibration runs the step outside any ``tf.distribute`` strategy."""
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is not None and type(strategy).__name__ != "_DefaultDistributionStrategy":
        raise errors.InvalidArgumentError(
            f"checkpoints: a calibrated budget measures the training step on one device, and "
            f"{model.name} trains under {type(strategy).__name__}. Calibrate a copy of the model "
            "built outside the strategy (memsave_grads.calibrate_budget(model, budget, "
            "batch_size=per_replica_batch)) and wrap this one with its result.")
    measure.check_allocator_stats()


# --------------------------------------------------------------------------------------------
# A user's model as a batch and a plan: explain(model) and the fit-limit command
# --------------------------------------------------------------------------------------------

#: Loss names (substrings, lower case) whose targets are class indices, not the output's shape.
_SPARSE_LOSSES = ("sparse",)


def _loss_names(model) -> list[str]:
    losses = getattr(model, "loss", None)
    if isinstance(losses, dict):
        losses = list(losses.values())
    losses = losses if isinstance(losses, (list, tuple)) else [losses]
    names = []
    for loss in losses:
        name = loss if isinstance(loss, str) else (
            getattr(loss, "name", None) or getattr(loss, "__name__", None)
            or type(loss).__name__)
        names.append(str(name).lower())
    return names


def _known_shape(shape, batch_size: int, sequence_length: int | None, what: str, name: str):
    dims = [batch_size]
    for d in list(shape)[1:]:
        d = getattr(d, "value", d)   # tf.compat.v1 Dimension
        if d is None:
            if sequence_length is None:
                raise errors.InvalidArgumentError(
                    f"model: {what} {name!r} has shape {tuple(shape)}, with an unknown "
                    "dimension besides the batch; pass sequence_length= (the command line's "
                    "--sequence-length) to fill it in, or pass data=(x, y).")
            d = sequence_length
        dims.append(int(d))
    return dims


def batch_specs(model, batch_size: int, sequence_length: int | None = None):
    """``(x, y)`` of one batch of ``model``'s training data, as lists of ``tf.TensorSpec``.

    Inputs come from ``model.inputs``; targets from ``model.outputs`` and the compiled loss:
    class indices (int32, the output's shape without its last axis) for sparse losses, the
    output's shape otherwise. Unknown dimensions besides the batch are ``sequence_length``.

    Raises:
      InvalidArgumentError: the model has no known inputs or outputs (not built: call it once
        or give it an ``Input``), or an unknown dimension and no ``sequence_length``.
    """
    try:
        inputs, outputs = list(model.inputs or []), list(model.outputs or [])
    except (AttributeError, ValueError):
        inputs, outputs = [], []
    if not inputs or not outputs:
        raise errors.InvalidArgumentError(
            f"model: {getattr(model, 'name', model)!r} has no known inputs and outputs (a "
            "subclassed or unbuilt model); build it with keras.Input(...), or pass "
            "data=(x, y) with one batch.")
    losses = _loss_names(model)
    x_specs = [tf.TensorSpec(_known_shape(t.shape, batch_size, sequence_length, "input",
                                          getattr(t, "name", str(i))),
                             tf.as_dtype(t.dtype), name=f"x{i}")
               for i, t in enumerate(inputs)]
    y_specs = []
    for i, t in enumerate(outputs):
        loss = losses[i] if i < len(losses) else losses[-1]
        shape = _known_shape(t.shape, batch_size, sequence_length, "output",
                             getattr(t, "name", str(i)))
        if any(word in loss for word in _SPARSE_LOSSES):
            y_specs.append(tf.TensorSpec(shape[:-1], tf.int32, name=f"y{i}"))
        else:
            y_specs.append(tf.TensorSpec(shape, tf.float32, name=f"y{i}"))
    return x_specs, y_specs


def _index_range(model) -> int:
    """Integer inputs are indices (token ids): keep them below the smallest ``input_dim`` of
    the model's embedding-like layers, and above 0, which ``mask_zero`` would mask."""
    sizes = [int(layer.input_dim) for layer in _all_layers(model)
             if isinstance(getattr(layer, "input_dim", None), int)]
    return max(min(sizes, default=2), 2)


def _all_layers(model):
    seen, stack = set(), [model]
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        yield layer
        stack.extend(getattr(layer, "layers", None) or [])
        stack.extend(getattr(layer, "_layers", None) or [])


def synthetic_batch(model, batch_size: int, sequence_length: int | None = None, seed: int = 0):
    """Random numpy ``(x, y)`` of :func:`batch_specs`: floats normal (targets uniform in
    [0, 1)), indices in [1, smallest embedding size), class indices below the output's size.
    One input or output is a single array, several a list."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(seed)
    x_specs, y_specs = batch_specs(model, batch_size, sequence_length)
    outputs = list(model.outputs)

    def values(spec, high):
        dtype = spec.dtype.as_numpy_dtype
        if spec.dtype.is_integer:
            return rng.integers(1 if high > 1 else 0, high, size=spec.shape).astype(dtype)
        return rng.standard_normal(spec.shape).astype(dtype)

    x = [values(spec, _index_range(model)) for spec in x_specs]
    y = []
    for spec, out in zip(y_specs, outputs):
        if spec.dtype.is_integer:
            y.append(values(spec, max(int(out.shape[-1]), 1)))
        else:
            y.append(rng.random(spec.shape).astype(spec.dtype.as_numpy_dtype))
    return (x[0] if len(x) == 1 else x), (y[0] if len(y) == 1 else y)


def trace_training_step(model, on_loss, batch_size: int = 32,
                        sequence_length: int | None = None, data=None,
                        release_gradients_early: bool = False):
    """Calls ``on_loss(loss, trainable_weights)`` inside a trace of one training step of a
    Keras model and returns what it returns; nothing runs and no variable changes.

    The forward pass and loss are traced as the model's ``train_step`` makes them, for a batch
    of ``batch_size`` (shapes from :func:`batch_specs`) or of the arrays or tensors of
    ``data=(x, y)``; gradients planned inside ``on_loss`` are planned as the step uses them:
    held for the optimizer, or released early (``release_gradients_early``, or a model wrapped
    so). :func:`memsave_grads.explain` uses it to plan a model's step; taking the work as a
    callback keeps this module from importing the explainer (which imports it).
    """
    version = keras_version(model)
    if data is None:
        x_specs, y_specs = batch_specs(model, batch_size, sequence_length)
        x_specs = x_specs[0] if len(x_specs) == 1 else x_specs
        y_specs = y_specs[0] if len(y_specs) == 1 else y_specs
    else:
        x, y = data
        x_specs, y_specs = tf.nest.map_structure(
            lambda v: tf.TensorSpec.from_tensor(tf.convert_to_tensor(v)), (x, y))
    results = []

    step = model.__dict__.get("train_step")
    wrapped = isinstance(step, _WrappedTrainStep)
    wanted = step.recompute_cells if wrapped else True
    # As the wrapped step traces it (design note "recurrent layers"): not under XLA, which
    # fit's step has with jit_compile=True (and "auto" on a GPU) but this trace does not.
    jit = getattr(model, "jit_compile", False)
    xla = jit is True or (jit == "auto" and bool(tf.config.list_logical_devices("GPU")))
    wanted = wanted and not xla
    early = release_gradients_early or (wrapped and step.release_gradients_early)
    if early:
        _check_early_release(model, version)  # what the wrapped step would refuse
    held = xla and not early or not _updates_wait_for_gradients(model, version, early)

    def trace(x, y):
        cells = recomputed_recurrent_cells(model) if _recompute_cells_here(model, wanted) \
            else contextlib.nullcontext()
        with cells:
            _, loss = _forward_and_loss(model, version, x, y, None)
        with api.gradients_applied_together() if held else contextlib.nullcontext():
            results.append(on_loss(loss, list(model.trainable_weights)))
        return loss

    tf.function(trace, autograph=False).get_concrete_function(x_specs, y_specs)
    return results[-1]
