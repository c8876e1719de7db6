"""The batches a ``fit`` or ``train_on_batch`` call trains on, read from its arguments without
drawing from the data where that can be done: their size, for the plan (design note "unknown
batch size"), and one of them, to calibrate a budget on (design note "calibrated budgets")."""

from __future__ import annotations

import inspect
import math

import tensorflow as tf

#: Keras' batch size when ``fit`` gets arrays and no ``batch_size`` (Keras 2 and 3).
KERAS_DEFAULT_BATCH_SIZE = 32


def leading_dimension(value) -> int | None:
    """The static first dimension of ``value``'s first array or tensor, or None."""
    leaves = [leaf for leaf in tf.nest.flatten(value) if hasattr(leaf, "shape")]
    if not leaves or not leaves[0].shape or not isinstance(leaves[0].shape[0], int):
        return None
    return int(leaves[0].shape[0])


def bound_arguments(method, model, args, kwargs) -> inspect.BoundArguments | None:
    """``method(model, *args, **kwargs)``'s arguments by name; None where they do not bind
    (the method itself will say what is wrong with the call)."""
    try:
        return inspect.signature(method).bind(model, *args, **kwargs)
    except TypeError:
        return None


def fit_batch_size(fit, model, args, kwargs) -> int | None:
    """The examples per batch a ``fit(*args, **kwargs)`` call trains on, where they can be read
    without drawing from the data: arrays (its ``batch_size``, Keras' default 32, at most the
    number of examples) or a ``tf.data.Dataset`` (a static batch dimension, or the size given
    to its last ``batch``). None for generators, ``Sequence``/``PyDataset`` and the like."""
    bound = bound_arguments(fit, model, args, kwargs)
    if bound is None:
        return None
    x, batch_size = bound.arguments.get("x"), bound.arguments.get("batch_size")
    if isinstance(x, tf.data.Dataset):
        return _dataset_batch_size(x)
    examples = leading_dimension(x)
    if examples is None:
        return None
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


def fit_calibration_batch(fit, model, args, kwargs, batch_size: int | None):
    """``(batch, static)``: a batch of a ``fit(*args, **kwargs)`` call to calibrate on,
    ``(x, y)`` or None (a random batch of ``batch_size`` will do), and whether the training
    function will be traced with the batch size in its shapes.

    Arrays give their first ``batch_size`` examples; Keras 2 and 3 trace a static batch
    where every batch is full (the examples left after ``validation_split`` divide evenly),
    else an unknown one. A ``tf.data.Dataset`` gives its first element (one batch read) and its
    element spec says whether the batch size is static. Generators and ``PyDataset``s are
    not drawn from (a random batch, traced as unknown)."""
    bound = bound_arguments(fit, model, args, kwargs)
    if bound is None:
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
    examples = leading_dimension(x)
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
    if size < 1 or y is None or leading_dimension(y) != examples:
        return None, static
    return tf.nest.map_structure(lambda a: a[:size], (x, y)), static
