"""A made-up batch of a Keras model's shapes, for what plans or measures a step without the
user's data: ``explain(model)``, the fit-limit command and ``calibrate_budget(model)``."""

from __future__ import annotations

import tensorflow as tf

from memsave_grads import errors
from memsave_grads.keras import flavour as flavour_lib

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
                    "dimension besides the batch; pass sequence_length= to fill it in (on the "
                    "command line: explain's --sequence-length, fit-limit's --vary sequence "
                    "--batch N), or pass data=(x, y).")
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


def as_model_inputs(model, flat: list):
    """``flat`` (one value per ``model.inputs``) in the structure the model's ``call`` takes:
    a dict where the model was built from a dict of inputs (keras_hub's task models:
    ``{"token_ids": ..., "padding_mask": ...}``; Keras 3 refuses a list there), else one value
    or a list. ``model.inputs`` is the dict's values flattened in sorted key order, as
    ``tf.nest`` flattens it."""
    structure = None
    try:
        structure = model.input
    except (AttributeError, ValueError):
        pass
    if isinstance(structure, dict) and len(tf.nest.flatten(structure)) == len(flat):
        return tf.nest.pack_sequence_as(structure, list(flat))
    return flat[0] if len(flat) == 1 else list(flat)


def _index_range(model) -> int:
    """Integer inputs are indices (token ids): keep them below the smallest ``input_dim`` of
    the model's embedding-like layers, and above 0, which ``mask_zero`` would mask."""
    sizes = [int(layer.input_dim) for layer in flavour_lib.all_layers(model)
             if isinstance(getattr(layer, "input_dim", None), int)]
    return max(min(sizes, default=2), 2)


def synthetic_batch(model, batch_size: int, sequence_length: int | None = None, seed: int = 0):
    """Random numpy ``(x, y)`` of :func:`batch_specs`: floats normal (targets uniform in
    [0, 1)), indices in [1, smallest embedding size), class indices below the output's size.
    One input or output is a single array, several a list (inputs a dict where the model
    takes one: :func:`as_model_inputs`)."""
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
    return as_model_inputs(model, x), (y[0] if len(y) == 1 else y)
