"""Which Keras a model is, decided once: :func:`flavour_of` returns the :class:`Flavour` of
Keras 2 (``tf_keras``) or Keras 3 (``keras``, which is ``tf.keras`` in TensorFlow >= 2.16), and
everything that differs between the two lives in its methods, so that the rest of
:mod:`memsave_grads.keras` never asks which Keras it has.

Neither Keras is imported here at import time: each is imported when a model of its kind is
first seen (docs/keras.md). This module also holds the two helpers that read Keras objects of
either kind: :func:`all_layers` and :func:`overridden`.
"""

from __future__ import annotations

import contextlib
import inspect

import tensorflow as tf

from memsave_grads import errors

KERAS2 = "Keras 2 (tf_keras)"
KERAS3 = "Keras 3"

#: The Keras 3 TensorFlow optimizer's sum of the gradients over replicas (private API): one op
#: over all of them, even outside a strategy; the early-release step skips it.
KERAS3_GRADIENT_SUM = "_all_reduce_sum_gradients"


def class_modules(value) -> list[str]:
    """The modules of the classes ``value``'s class derives from (what tells a Keras model's
    kind without importing Keras)."""
    return [getattr(cls, "__module__", "") or "" for cls in type(value).__mro__]


def is_keras_model(value) -> bool:
    """A Keras 2 or 3 model, told by its class's modules (imports no Keras)."""
    return any(m.split(".")[0] in ("keras", "tf_keras") for m in class_modules(value)) and hasattr(
        value, "trainable_weights")


class Flavour:
    """What differs between Keras 2 and Keras 3, for the stock training step and the model and
    optimizer objects around it. One instance per Keras: :data:`TF_KERAS` and
    :data:`KERAS`."""

    #: :data:`KERAS2` or :data:`KERAS3`, as messages and ``keras_version`` name it.
    name: str

    def stock_train_step(self):
        """The class attribute ``train_step`` of this Keras' ``Model`` (what wrap_model
        replaces, and unwrap_model restores)."""
        raise NotImplementedError

    def is_compiled(self, model) -> bool:
        """Whether ``model.compile`` ran (the optimizer may still be None)."""
        raise NotImplementedError

    def refuse_model(self, model, action: str) -> None:
        """Our error for a model of this Keras that no training step of ours can train."""

    def unpack(self, data):
        """``(x, y, sample_weight)`` of the batch Keras passes to ``train_step``."""
        raise NotImplementedError

    def forward_and_loss(self, model, x, y, sample_weight):
        """(y_pred, loss) as the stock train_step of this Keras computes them: the forward
        pass with ``training=True``, then the compiled loss plus ``model.losses``."""
        raise NotImplementedError

    def track_loss(self, model, x, y, loss) -> None:
        """What the stock step does with the loss between the forward pass and the
        gradients."""

    def scale_loss(self, optimizer, loss):
        """The loss the gradients are taken of (a loss-scaling optimizer's scaled loss)."""
        raise NotImplementedError

    def unscale_gradients(self, optimizer, grads: list) -> list:
        """The gradients ``apply_gradients`` takes, from those of :meth:`scale_loss`."""
        return grads

    #: Whether the stock step calls ``apply_gradients`` even when the model has no trainable
    #: weights (tf_keras' does, with an empty list; Keras 3's warns and skips it).
    applies_without_weights: bool = True

    def loss_scaled(self, optimizer) -> bool:
        """Whether the optimizer scales the loss (and checks every gradient is finite)."""
        raise NotImplementedError

    def gradient_sum_refusal(self, optimizer) -> str | None:
        """Why the optimizer's ``apply_gradients`` cannot skip its one-op sum over replicas
        (design note "early release"), or None."""
        raise NotImplementedError

    def apply_unsummed(self, optimizer, grads: list, variables: list) -> list:
        """``optimizer.apply_gradients`` without the one-op sum over replicas, which would
        hold every gradient until the last is complete (only outside a strategy, where the sum
        over one replica is the gradients themselves). Returns the ``tf.Variable`` of each of
        ``variables``."""
        raise NotImplementedError

    def recurrent_layer_type(self):
        """The class of this Keras' recurrent layers whose cells wrap_model recomputes
        (design note "recurrent layers"), or None."""
        return None

    def build_optimizer(self, model) -> None:
        """Make the optimizer's variables before a step is traced, where this Keras does so
        outside the trace (as its ``fit`` does)."""

    def __repr__(self):
        return f"<memsave_grads Keras flavour {self.name}>"


class _Keras2(Flavour):
    name = KERAS2

    @property
    def module(self):
        """``tf_keras``, imported on each use (a removed package is noticed)."""
        try:
            import tf_keras  # pylint: disable=import-outside-toplevel
        except ImportError as e:
            raise errors.MissingDependencyError(
                "model: this is a Keras 2 model, and memsave_grads.keras needs the tf_keras "
                "package to train it, which could not be imported. Install it with `pip "
                "install tf-keras` (or `pip install memsave-grads[keras]`).") from e
        return tf_keras

    def stock_train_step(self):
        return self.module.Model.train_step

    def is_compiled(self, model) -> bool:
        return bool(getattr(model, "_is_compiled", False))

    def refuse_model(self, model, action: str) -> None:
        if any(".training_v1" in m for m in class_modules(model)):
            raise errors.InvalidArgumentError(
                f"model: {action}: this tf_keras model was built in a TF1 (v1) graph, where "
                "Keras trains with tf.gradients and no train_step: use `with memsave_grads."
                "patch('memory'): model.fit(...)` there instead.")

    def unpack(self, data):
        return self.module.utils.unpack_x_y_sample_weight(data)

    def forward_and_loss(self, model, x, y, sample_weight):
        y_pred = model(x, training=True)
        return y_pred, model.compute_loss(x, y, y_pred, sample_weight)

    def track_loss(self, model, x, y, loss) -> None:
        if hasattr(model, "_validate_target_and_loss"):
            model._validate_target_and_loss(y, loss)  # pylint: disable=protected-access

    # What optimizer.minimize(loss, variables, tape=tape) does: a LossScaleOptimizer (legacy or
    # not) scales the loss and unscales the gradients.
    def scale_loss(self, optimizer, loss):
        return optimizer.get_scaled_loss(loss) if self.loss_scaled(optimizer) else loss

    def unscale_gradients(self, optimizer, grads: list) -> list:
        return optimizer.get_unscaled_gradients(grads) if self.loss_scaled(optimizer) else grads

    def loss_scaled(self, optimizer) -> bool:
        # tf_keras' LossScaleOptimizer, legacy or not
        return (hasattr(optimizer, "get_scaled_loss")
                and hasattr(optimizer, "get_unscaled_gradients"))

    def gradient_sum_refusal(self, optimizer) -> str | None:
        """tf_keras skips the sum where ``apply_gradients`` is given
        ``experimental_aggregate_gradients=False``, unless the optimizer sums its own way."""
        new, legacy = self.module.optimizers.Optimizer, self.module.optimizers.legacy.Optimizer
        cls = type(optimizer)
        if not isinstance(optimizer, (new, legacy)) or not _takes_keyword(
                cls.apply_gradients, "experimental_aggregate_gradients"):
            # tf_keras' wrapper of a tf.compat.v1.train optimizer, or a subclass whose own
            # apply_gradients leaves the argument out (OptimizerV2's _HAS_AGGREGATE_GRAD says
            # so where it is False, but Ftrl leaves it False and takes the argument all the same).
            return ("its apply_gradients takes no experimental_aggregate_gradients, so it sums "
                    "every gradient in one op; use a tf_keras optimizer (tf_keras.optimizers.* "
                    "or tf_keras.optimizers.legacy.*) whose apply_gradients takes it, or wrap "
                    "without release_gradients_early")
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

    def apply_unsummed(self, optimizer, grads: list, variables: list) -> list:
        optimizer.apply_gradients(zip(grads, variables), experimental_aggregate_gradients=False)
        return variables

    # tf_keras' LSTM and GRU run a fused kernel instead of their cell, and keep their own
    # memory: no recurrent layer of tf_keras is recomputed (design note "recurrent layers").


class _Keras3(Flavour):
    name = KERAS3
    applies_without_weights = False

    @staticmethod
    def _imported():
        """``(keras, keras.src.backend.tensorflow.trainer)``: the stock train_step's module is
        Keras 3's TensorFlow backend, whose absence is our error."""
        try:
            import keras  # pylint: disable=import-outside-toplevel
            # pylint: disable-next=import-outside-toplevel
            from keras.src.backend.tensorflow import trainer
        except ImportError as e:
            raise errors.MissingDependencyError(
                "model: this is a Keras 3 model, and memsave_grads.keras needs Keras 3 with its "
                "TensorFlow backend (keras.src.backend.tensorflow), which could not be imported. "
                "Install it with `pip install 'keras>=3'`, or use Keras 2: `pip install "
                "tf-keras`.") from e
        return keras, trainer

    @property
    def module(self):
        return self._imported()[0]

    def stock_train_step(self):
        return self._imported()[1].TensorFlowTrainer.train_step

    def is_compiled(self, model) -> bool:
        return bool(getattr(model, "compiled", False))

    def unpack(self, data):
        return self.module.utils.unpack_x_y_sample_weight(data)

    def forward_and_loss(self, model, x, y, sample_weight):
        # TensorFlowTrainer.train_step of Keras 3 (keras/src/backend/tensorflow/trainer.py).
        # pylint: disable=protected-access
        if getattr(model, "_call_has_training_arg", True):
            y_pred = model(x, training=True)
        else:
            y_pred = model(x)
        if hasattr(model, "_compute_loss"):
            return y_pred, model._compute_loss(x=x, y=y, y_pred=y_pred,
                                               sample_weight=sample_weight, training=True)
        return y_pred, model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)

    def track_loss(self, model, x, y, loss) -> None:
        from keras.src.losses import loss as loss_module  # pylint: disable=import-outside-toplevel
        first_input = next(i for i in tf.nest.flatten(x) if i is not None)
        model._loss_tracker.update_state(  # pylint: disable=protected-access
            loss_module.unscale_loss_for_distribution(loss),
            sample_weight=tf.shape(first_input)[0])

    # A LossScaleOptimizer scales in scale_loss and unscales (and skips non-finite steps) in
    # apply_gradients, as in the stock step.
    def scale_loss(self, optimizer, loss):
        return optimizer.scale_loss(loss) if optimizer is not None else loss

    def loss_scaled(self, optimizer) -> bool:
        return isinstance(optimizer, self.module.optimizers.LossScaleOptimizer)

    def gradient_sum_refusal(self, optimizer) -> str | None:
        if not hasattr(type(optimizer), KERAS3_GRADIENT_SUM):
            return (f"this Keras has no {type(optimizer).__name__}.{KERAS3_GRADIENT_SUM}, the "
                    "one-op sum over replicas that the wrapped step skips; wrap without "
                    "release_gradients_early, and please report the Keras version")
        return None

    def apply_unsummed(self, optimizer, grads: list, variables: list) -> list:
        # Keras 3 has no argument to skip the sum, so it is replaced for this call.
        with overridden([(optimizer, KERAS3_GRADIENT_SUM, list)]):
            optimizer.apply_gradients(zip(grads, variables))
        return [v.value if isinstance(v, self.module.Variable) else v for v in variables]

    def recurrent_layer_type(self):
        return self.module.layers.RNN

    def build_optimizer(self, model) -> None:
        if not model.optimizer.built:
            # As fit does before it traces: Keras 3 creates no variable inside a traced step.
            model.optimizer.build(model.trainable_variables)


#: The two flavours (one object each: their imports are made once).
TF_KERAS = _Keras2()
KERAS = _Keras3()


def flavour_of(model) -> Flavour:
    """The :class:`Flavour` of a Keras model; our errors for anything else.

    Raises:
      InvalidTypeError: ``model`` is not a Keras ``Model``.
      MissingDependencyError: the Keras package the model comes from cannot be imported.
      InvalidArgumentError: a Keras 3 model on a backend other than TensorFlow.
    """
    modules = class_modules(model)
    if any(m == "tf_keras" or m.startswith("tf_keras.") for m in modules):
        if isinstance(model, TF_KERAS.module.Model):
            return TF_KERAS
    elif any(m == "keras" or m.startswith("keras.") for m in modules):
        keras = KERAS.module
        if isinstance(model, keras.Model):
            if keras.backend.backend() != "tensorflow":
                raise errors.InvalidArgumentError(
                    f"model: Keras 3 runs on the {keras.backend.backend()!r} backend; "
                    "memsave_grads rewrites TensorFlow graphs, so it needs "
                    "KERAS_BACKEND=tensorflow (set before importing keras).")
            return KERAS
    raise errors.InvalidTypeError(
        f"model: expected a Keras Model (tf_keras.Model for Keras 2, or keras.Model / tf.keras."
        f"Model for Keras 3), got {type(model).__module__}.{type(model).__qualname__}: "
        f"{model!r:.80}. For a custom training loop call memsave_grads.gradients in your own "
        "tf.function instead.")


def keras_version(model) -> str:
    """:data:`KERAS2` or :data:`KERAS3` for a Keras model (its :func:`flavour_of`'s name);
    our errors for anything else."""
    return flavour_of(model).name


def _takes_keyword(function, name: str) -> bool:
    """Whether ``function`` accepts the keyword argument ``name`` (by name or ``**kwargs``)."""
    parameters = inspect.signature(function).parameters.values()
    return any(p.name == name and p.kind is not inspect.Parameter.POSITIONAL_ONLY
               or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def all_layers(model):
    """Every layer of ``model``, nested models' included, once each (``model`` first)."""
    seen, stack = set(), [model]
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        yield layer
        stack.extend(getattr(layer, "layers", None) or [])
        stack.extend(getattr(layer, "_layers", None) or [])


_ABSENT = object()


@contextlib.contextmanager
def overridden(pairs):
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
