"""Long runs: 500 Adam steps with memsave_grads track tf.gradients step for step.

A gradient that is right once can still drift (a stale recomputation, a copied random op, an
update racing a recomputed read) or leak (a graph that grows per step, memory that creeps up).
Each run trains the same model twice from the same initial values on the same batches, once per
gradient function, in a finalized graph, and compares every step's loss.
"""

import numpy as np
import pytest
import tensorflow as tf

import memsave_grads as mg
from memsave_grads import measure

STEPS = 500
BATCH = 32


def _init(rng, shape, fan_in):
    return tf.Variable((rng.randn(*shape) / np.sqrt(fan_in)).astype(np.float32))


def _mlp(rng):
    x = tf.compat.v1.placeholder(tf.float32, [BATCH, 32], name="x")
    labels = tf.compat.v1.placeholder(tf.int32, [BATCH], name="labels")
    h, variables = x, []
    for width_in, width_out in [(32, 64), (64, 64), (64, 64), (64, 64), (64, 64), (64, 10)]:
        w, b = _init(rng, [width_in, width_out], width_in), tf.Variable(tf.zeros([width_out]))
        variables += [w, b]
        h = tf.matmul(h, w) + b
        if width_out != 10:
            h = tf.tanh(h)
    return x, labels, h, variables


def _cnn(rng):
    x = tf.compat.v1.placeholder(tf.float32, [BATCH, 16, 16, 3], name="x")
    labels = tf.compat.v1.placeholder(tf.int32, [BATCH], name="labels")
    h, variables = x, []
    for channels_in, channels_out in [(3, 8), (8, 16), (16, 16), (16, 16)]:
        k = _init(rng, [3, 3, channels_in, channels_out], 9 * channels_in)
        variables.append(k)
        h = tf.nn.relu(tf.nn.conv2d(h, k, strides=1, padding="SAME"))
        if channels_in == 8:
            h = tf.nn.max_pool2d(h, 2, 2, "VALID")
    w = _init(rng, [16, 10], 16)
    variables.append(w)
    return x, labels, tf.matmul(tf.reduce_mean(h, axis=[1, 2]), w), variables


MODELS = {"mlp": _mlp, "cnn": _cnn}


def _batches(kind):
    """Fresh inputs each step, labelled by a fixed random linear teacher (so there is
    something to learn)."""
    rng = np.random.RandomState(1)
    shape = [BATCH, 32] if kind == "mlp" else [BATCH, 16, 16, 3]
    teacher = rng.randn(shape[-1], 10)
    for _ in range(STEPS):
        inputs = rng.randn(*shape).astype(np.float32)
        features = inputs if kind == "mlp" else inputs.mean(axis=(1, 2)) * 4
        yield inputs, np.argmax(features @ teacher, axis=1).astype(np.int32)


def _train(kind, gradients_fn):
    """Losses, per-step peak bytes and bytes in use after each step of one 500-step run."""
    graph = tf.Graph()
    with graph.as_default():
        x, labels, logits, variables = MODELS[kind](np.random.RandomState(0))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))
        grads = gradients_fn(loss, variables)
        train = tf.compat.v1.train.AdamOptimizer(1e-3).apply_gradients(zip(grads, variables))
        init = tf.compat.v1.global_variables_initializer()
    graph.finalize()  # any op added while training raises
    ops_before = len(graph.get_operations())
    losses, peaks, in_use = [], [], []
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        for inputs, targets in _batches(kind):
            peak, (value, _) = measure.peak_bytes_of(
                lambda: sess.run([loss, train], {x: inputs, labels: targets}))
            losses.append(value)
            peaks.append(peak)
            in_use.append(tf.config.experimental.get_memory_info("CPU:0")["current"])
    assert len(graph.get_operations()) == ops_before
    return np.array(losses), np.array(peaks), np.array(in_use)


# "speed" in the slow suite: the same loop, about 20 s more.
@pytest.mark.parametrize("checkpoints", ["memory", pytest.param("speed", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_500_adam_steps_track_tf_gradients(kind, checkpoints):
    expected, _, _ = _train(kind, tf.gradients)
    got, peaks, in_use = _train(
        kind, lambda loss, variables: mg.gradients(loss, variables, checkpoints=checkpoints))
    assert expected[-50:].mean() < 0.8 * expected[:50].mean(), "the model should learn"
    worst = int(np.argmax(np.abs(got - expected) / np.abs(expected)))
    np.testing.assert_allclose(
        got, expected, rtol=1e-5,
        err_msg=f"losses part at step {worst}: {got[worst]} vs {expected[worst]}")
    # Memory is stable. Per-step peaks vary by +-15% with the inter-op schedule, so compare
    # medians of early and late steps; the bytes in use between steps must not creep up (a leak
    # of 200 bytes per step would exceed the 64 KiB allowance).
    early, late = slice(5, 105), slice(-100, None)
    assert np.median(peaks[late]) <= 1.1 * np.median(peaks[early]) + 64 * 1024, (
        np.median(peaks[early]), np.median(peaks[late]))
    assert in_use[late].max() <= in_use[early].max() + 64 * 1024, (
        in_use[early].max(), in_use[late].max())
