"""What the Keras test modules share: both Keras versions, and a clean Keras state per test.

Import the fixture into a test module (``from keras_support import fresh_keras``) to make it
apply there: pytest finds autouse fixtures in the module's namespace.
"""

import pytest

tf_keras = pytest.importorskip("tf_keras")
import keras as keras3  # noqa: E402  (Keras 3 is TensorFlow 2.21's tf.keras)

KERAS = {"keras2": tf_keras, "keras3": keras3}
FLAVOURS = pytest.mark.parametrize("flavour", ["keras2", "keras3"])


def one_flavour_by_default(default: str):
    """Like ``FLAVOURS`` for a model-scale check: both Keras versions under ``-m slow``, only
    ``default`` in the default suite. Give the checks of one kind different defaults, so that
    the default suite still runs each kind and each version."""
    return pytest.mark.parametrize("flavour", [
        flavour if flavour == default else pytest.param(flavour, marks=pytest.mark.slow)
        for flavour in KERAS])


def clear_session(keras) -> None:
    if keras is keras3:
        keras.backend.clear_session(free_memory=False)  # its gc.collect() costs 0.2 s a call
    else:
        keras.backend.clear_session()


@pytest.fixture(autouse=True)
def fresh_keras():
    """Models in one process share Keras state (layer names, seeds, floatx): reset it for
    each test."""
    for keras in KERAS.values():
        clear_session(keras)
    yield
    for keras in KERAS.values():
        keras.backend.set_floatx("float32")


def bn_dropout_mlp(keras, depth=16, width=256):
    """A deep MLP with batch norm and dropout, compiled with SGD and momentum: state a
    training-mode forward pass moves, and masks backprop reads."""
    inputs = keras.Input((width,))
    h = inputs
    for _ in range(depth):
        h = keras.layers.Dense(width, activation="tanh")(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Dropout(0.1)(h)
    outputs = keras.layers.Dense(10)(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
    return model


def fit_step_peaks_mib(keras, model, batch_size=1024, width=256):
    """Per-step allocator peaks (MiB above what was in use before the step) of ``model.fit`` on
    3.5 batches of random data, so that fit traces its step with a None batch size: the
    whole batches after the first (which allocates kernel scratch)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from memsave_grads import measure  # pylint: disable=import-outside-toplevel
    rows = 3 * batch_size + batch_size // 2
    x = np.random.default_rng(0).standard_normal((rows, width)).astype("float32")
    y = np.zeros((rows, 10), "float32")
    peaks = []

    class Peaks(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            tf.config.experimental.reset_memory_stats("CPU:0")
            self.before = tf.config.experimental.get_memory_info("CPU:0")["current"]

        def on_train_batch_end(self, batch, logs=None):
            info = tf.config.experimental.get_memory_info("CPU:0")
            peaks.append((info["peak"] - self.before) / 2**20)

    measure.check_allocator_stats()
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0,
              callbacks=[Peaks()])
    return peaks[1:3]
