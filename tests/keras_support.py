"""What the Keras test modules share: both Keras versions, and a clean Keras state per test.

Import the fixture into a test module (``from keras_support import fresh_keras``) to make it
apply there: pytest finds autouse fixtures in the module's namespace.
"""

import pytest

tf_keras = pytest.importorskip("tf_keras")
import keras as keras3  # noqa: E402  (Keras 3 is TensorFlow 2.21's tf.keras)

KERAS = {"keras2": tf_keras, "keras3": keras3}
FLAVOURS = pytest.mark.parametrize("flavour", ["keras2", "keras3"])


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
