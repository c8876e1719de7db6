"""A Keras model's training step traced for planning, not run: what ``explain(model)`` plans."""

from __future__ import annotations

import contextlib

import tensorflow as tf

from memsave_grads import api
from memsave_grads.keras import cells
from memsave_grads.keras import flavour as flavour_lib
from memsave_grads.keras import synthetic
from memsave_grads.keras import updates
from memsave_grads.keras import wrapping


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
    flavour = flavour_lib.flavour_of(model)
    if data is None:
        x_specs, y_specs = synthetic.batch_specs(model, batch_size, sequence_length)
        x_specs = synthetic.as_model_inputs(model, x_specs)
        y_specs = y_specs[0] if len(y_specs) == 1 else y_specs
    else:
        x, y = data
        x_specs, y_specs = tf.nest.map_structure(
            lambda v: tf.TensorSpec.from_tensor(tf.convert_to_tensor(v)), (x, y))
    results = []

    wrapped = wrapping.wrapped_step(model)
    wanted = wrapped.options.recompute_cells if wrapped is not None else True
    # As the wrapped step traces it (design note "recurrent layers"): not under XLA, which
    # fit's step has with jit_compile=True (and "auto" on a GPU) but this trace does not.
    jit = getattr(model, "jit_compile", False)
    xla = jit is True or (jit == "auto" and bool(tf.config.list_logical_devices("GPU")))
    wanted = wanted and not xla
    early = release_gradients_early or (wrapped is not None
                                        and wrapped.options.release_gradients_early)
    if early:
        updates.check_early_release(model, flavour)  # what the wrapped step would refuse
    held = xla and not early or not updates.updates_wait_for_gradients(model, flavour, early)

    def trace(x, y):
        with cells.maybe_recomputed_cells(model, flavour, wanted):
            _, loss = flavour.forward_and_loss(model, x, y, None)
        with api.gradients_applied_together() if held else contextlib.nullcontext():
            results.append(on_loss(loss, list(model.trainable_weights)))
        return loss

    tf.function(trace, autograph=False).get_concrete_function(x_specs, y_specs)
    return results[-1]
