"""Keras integration: make ``model.fit`` compute its gradients with memsave_grads.

Keras trains inside a ``tf.function`` and differentiates with ``tf.GradientTape``, which
:func:`memsave_grads.patch` does not reach. :func:`wrap_model` replaces the model's training
step (on that one model object) by :func:`train_step`: the stock Keras step, with the one
``tape.gradient`` call replaced by :func:`memsave_grads.gradients` on the traced graph.

Both Keras 2 (``tf_keras``) and Keras 3 with the TensorFlow backend (``keras``, which is
``tf.keras`` in TensorFlow >= 2.16) are supported. Neither is imported by this package: each is
imported when a model of its kind is wrapped (docs/keras.md).

The modules, one job each (docs/design.md, "Layout"):

- :mod:`~memsave_grads.keras.flavour`: which Keras a model is, decided once, and everything
  that differs between Keras 2 and 3 (the only module that imports either);
- :mod:`~memsave_grads.keras.checks`: what a model and the options must be;
- :mod:`~memsave_grads.keras.cells`: recurrent layers' cells recomputed in their loops;
- :mod:`~memsave_grads.keras.updates`: the optimizer's updates, together or released early;
- :mod:`~memsave_grads.keras.step`: the training step;
- :mod:`~memsave_grads.keras.batches`: what a ``fit``/``train_on_batch`` call trains on;
- :mod:`~memsave_grads.keras.synthetic`: a made-up batch of a model's shapes;
- :mod:`~memsave_grads.keras.calibration`: a budget calibrated on the model's whole step;
- :mod:`~memsave_grads.keras.wrapping`: ``wrap_model``/``unwrap_model``, per-batch calibration;
- :mod:`~memsave_grads.keras.tracing`: the step traced for ``explain(model)``.
"""

from memsave_grads.keras.batches import KERAS_DEFAULT_BATCH_SIZE
from memsave_grads.keras.calibration import calibrate_model
from memsave_grads.keras.cells import recomputed_recurrent_cells
from memsave_grads.keras.checks import check_trainable
from memsave_grads.keras.flavour import KERAS2
from memsave_grads.keras.flavour import KERAS3
from memsave_grads.keras.flavour import flavour_of
from memsave_grads.keras.flavour import keras_version
from memsave_grads.keras.step import train_step
from memsave_grads.keras.synthetic import batch_specs
from memsave_grads.keras.synthetic import synthetic_batch
from memsave_grads.keras.tracing import trace_training_step
from memsave_grads.keras.wrapping import is_wrapped
from memsave_grads.keras.wrapping import unwrap_model
from memsave_grads.keras.wrapping import wrap_model

__all__ = ["wrap_model", "unwrap_model", "is_wrapped", "train_step",
           "recomputed_recurrent_cells", "calibrate_model", "check_trainable",
           "trace_training_step", "batch_specs", "synthetic_batch", "flavour_of",
           "keras_version", "KERAS2", "KERAS3", "KERAS_DEFAULT_BATCH_SIZE"]
