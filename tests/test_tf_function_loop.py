"""The tf.function training-loop recipe (docs/tf_function.md): a step that calls
memsave_grads.gradients and applies a Keras optimizer trains like GradientTape, at a lower
measured peak."""

import numpy as np
import pytest
import tensorflow as tf

import memsave_grads as mg
from memsave_grads import measure

ROWS, WIDTH, DEPTH = 1024, 256, 48  # 1 MiB per activation, 0.25 MiB per weight


def _make_step(method, optimizer_name):
    keras = pytest.importorskip("tf_keras")
    rng = np.random.RandomState(0)
    weights = [tf.Variable((rng.randn(WIDTH, WIDTH) / np.sqrt(WIDTH) / 2).astype(np.float32))
               for _ in range(DEPTH)]
    optimizer = {"sgd": lambda: keras.optimizers.SGD(0.01),
                 "adam": lambda: keras.optimizers.Adam(1e-3)}[optimizer_name]()

    def loss_fn(x):
        h = x
        for w in weights:
            h = h + tf.tanh(tf.matmul(h, w))
        return tf.reduce_mean(h * h)

    @tf.function
    def step(x):
        if method == "GradientTape":
            with tf.GradientTape() as tape:
                loss = loss_fn(x)
            grads = tape.gradient(loss, weights)
        else:
            loss = loss_fn(x)
            grads = mg.gradients(loss, weights, checkpoints=method)
        optimizer.apply_gradients(zip(grads, weights))
        return loss

    return step, weights


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_recipe_trains_like_gradient_tape_with_a_lower_peak(optimizer_name):
    data = [tf.constant(np.random.RandomState(10 + i).randn(ROWS, WIDTH).astype(np.float32))
            for i in range(4)]
    results = {}
    for method in ("GradientTape", "memory"):
        step, weights = _make_step(method, optimizer_name)
        step(data[0])  # trace; the first call also creates the optimizer's slots
        peak = measure.peak_bytes_of(lambda: step(data[1]).numpy())[0]
        losses = [float(step(x)) for x in data[2:]]
        results[method] = (peak, losses, [w.numpy() for w in weights])
    tape_peak, tape_losses, tape_weights = results["GradientTape"]
    peak, losses, trained = results["memory"]
    np.testing.assert_allclose(losses, tape_losses, rtol=1e-5)
    for got, want in zip(trained, tape_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # 48 blocks keep ~2 activations each under GradientTape (96 MiB); "memory" keeps ~sqrt(48)
    # of them. The 12 MiB of weight gradients are alive in both until the optimizer runs.
    assert tape_peak >= 80 * measure.MIB, tape_peak / measure.MIB
    assert peak <= 0.5 * tape_peak, (peak / measure.MIB, tape_peak / measure.MIB)
