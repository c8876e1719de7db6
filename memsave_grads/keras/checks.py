"""What a Keras model and the options of its wrapped step must be, refused with our errors
before anything is traced (and, in the step, what only the trace can tell)."""

from __future__ import annotations

import tensorflow as tf

from memsave_grads import _validate
from memsave_grads import errors
from memsave_grads import measure
from memsave_grads.keras.flavour import Flavour

#: Why ``wrap_model`` takes name patterns, not tensors (``_validate.check_checkpoints``).
TENSORS_UNAVAILABLE = (
    "Keras traces the training step after wrap_model returns, so tensors of that graph do not "
    "exist yet; name the ops to keep with glob patterns such as '*dense_3*/Tanh'.")


def check_options(checkpoints, fallback, can_calibrate: bool = False):
    """What can be checked before Keras traces the step; tensors of that graph do not exist
    yet, so a list must hold name patterns. Returns the parsed ``checkpoints``."""
    return _validate.check_deferred_options(checkpoints, fallback,
                                            tensors_unavailable=TENSORS_UNAVAILABLE,
                                            can_calibrate=can_calibrate)


def check_compiled(model, flavour: Flavour, action: str) -> None:
    if not flavour.is_compiled(model) or getattr(model, "optimizer", None) is None:
        keeps = "; compiling again later keeps the wrapping" if action == "wrap_model" else ""
        raise errors.InvalidArgumentError(
            f"model: {action}: the model is not compiled (no optimizer yet). Call "
            f"model.compile(optimizer=..., loss=...) first{keeps}.")


def check_trainable(model, flavour: Flavour, action: str) -> None:
    """What a training step to plan or measure needs from a Keras model (``explain``,
    ``fit-limit``): compiled, with weights to train. Our errors, raised before anything is
    traced, naming ``action``. (``wrap_model`` accepts a frozen model: its layers may be
    unfrozen and the model compiled again later.)"""
    check_compiled(model, flavour, action)
    if not model.trainable_weights:
        raise errors.InvalidArgumentError(
            f"model: {action}: {getattr(model, 'name', 'the model')!r} has no trainable "
            f"weights ({len(model.weights)} weights, all frozen or none), so a training step "
            "computes no gradient: nothing to plan or save. Set trainable=True on the layers to "
            "train.")


def check_model(model, flavour: Flavour, action: str) -> None:
    """What wrapping (or measuring the wrapped step of) a model needs: a model of a Keras we
    train, compiled, running traced."""
    flavour.refuse_model(model, action)
    check_compiled(model, flavour, action)
    if model.run_eagerly:
        raise errors.InvalidArgumentError(
            f"model: {action}: the model runs eagerly (run_eagerly=True, a dynamic model, or "
            "tf.config.run_functions_eagerly(True)); memsave_grads rewrites the traced graph of "
            "the training step, which eager execution does not build. Compile with "
            "run_eagerly=False.")


def has_own_train_step(model, flavour: Flavour) -> bool:
    """Whether the model's class overrides Keras' ``train_step``: the wrapped step then runs
    that step as written, with its tapes routed (design note "tape routing"), instead of
    replacing it."""
    return type(model).train_step is not flavour.stock_train_step()


def check_own_train_step_options(model, flavour: Flavour, release_gradients_early: bool) -> None:
    """A model's own ``train_step`` applies its gradients itself, so its updates cannot be
    ordered: ``release_gradients_early`` is refused for it."""
    if release_gradients_early and has_own_train_step(model, flavour):
        raise errors.InvalidArgumentError(
            f"release_gradients_early: {type(model).__qualname__} defines its own train_step, "
            "which applies the gradients itself, so wrap_model cannot order the updates; wrap "
            "without release_gradients_early (its tapes are still routed), or call "
            "memsave_grads.keras.train_step(self, data, release_gradients_early=True) from it.")


def check_traced(model) -> None:
    """What the step can check only once it runs: traced, not eager, with an optimizer."""
    if tf.executing_eagerly():
        raise errors.EagerExecutionError(
            "model: memsave_grads.keras.train_step ran eagerly; it rewrites the traced graph of "
            "the training step. Compile with run_eagerly=False (and leave "
            "tf.config.run_functions_eagerly off), or call it inside a tf.function.")
    if getattr(model, "optimizer", None) is None:
        raise errors.InvalidArgumentError(
            "model: the model has no optimizer. Call model.compile(optimizer=..., loss=...) "
            "first.")


def check_calibration_possible(model) -> None:
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
