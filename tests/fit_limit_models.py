"""Models for the fit-limit command's end-to-end tests (``tests/fit_limit_models.py:<name>``
is a MODEL argument): small, and memory-bound at a batch of a few hundred."""

import tensorflow as tf


def residual_mlp(batch_size, depth=16, width=256):
    """A residual tanh MLP: ``width`` KiB per activation per 1024 examples, so its plain step
    needs about ``2 x depth`` of them; one compiled Keras 3 model (fit-limit makes the data)."""
    import keras  # pylint: disable=import-outside-toplevel  # only this model needs Keras
    del batch_size  # the same model at every batch size
    keras.utils.set_random_seed(0)
    inputs = keras.Input((width,))
    h = inputs
    for _ in range(depth):
        h = h + keras.layers.Dense(width, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    return model


def tanh_chain_step(batch_size, depth=16, width=256):
    """A training step that differentiates with tf.gradients (what patch() reaches): a chain
    of ``depth`` tanh layers, SGD on its weights; no Keras, so a try starts quickly."""
    rng = tf.random.Generator.from_seed(0)
    weights = [tf.Variable(rng.normal((width, width)) / width ** 0.5) for _ in range(depth)]
    x = rng.normal((batch_size, width))

    @tf.function
    def step():
        h = x
        for w in weights:
            h = tf.tanh(h @ w)
        loss = tf.reduce_mean(h * h)
        for w, g in zip(weights, tf.gradients(loss, weights)):
            w.assign_sub(0.1 * g)
        return loss

    return step
