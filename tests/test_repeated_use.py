"""Many gradients() calls in one graph: a GAN's two losses, gradients of gradients, names."""

import numpy as np
import pytest
import tensorflow as tf

import memsave_grads as mg
from conftest import assert_grads_close

BATCH, NOISE, DATA, WIDTH = 16, 8, 12, 32


def _dense_stack(h, widths, prefix, rng):
    variables = []
    for i, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:])):
        w = tf.Variable((rng.randn(n_in, n_out) / np.sqrt(n_in)).astype(np.float32),
                        name=f"{prefix}_w{i}")
        variables.append(w)
        h = tf.matmul(h, w)
        if i < len(widths) - 2:
            h = tf.nn.leaky_relu(h)
    return h, variables


def _gan(gradients_fn, steps=0):
    """A small GAN; returns its two losses after ``steps`` alternating Adam steps (and the
    graph's op names), training both players with ``gradients_fn``."""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        z = tf.compat.v1.placeholder(tf.float32, [BATCH, NOISE], name="z")
        real = tf.compat.v1.placeholder(tf.float32, [BATCH, DATA], name="real")
        with tf.compat.v1.variable_scope("generator"):
            fake, g_vars = _dense_stack(z, [NOISE, WIDTH, WIDTH, WIDTH, DATA], "g", rng)
        with tf.compat.v1.variable_scope("discriminator"):
            stack = [DATA, WIDTH, WIDTH, WIDTH, 1]
            d_real, d_vars = _dense_stack(real, stack, "d", np.random.RandomState(1))
            # The same discriminator (same variables) applied to the fake batch.
            h = fake
            for i, w in enumerate(d_vars):
                h = tf.matmul(h, w)
                if i < len(d_vars) - 1:
                    h = tf.nn.leaky_relu(h)
            d_fake = h
        bce = tf.nn.sigmoid_cross_entropy_with_logits
        d_loss = tf.reduce_mean(bce(labels=tf.ones_like(d_real), logits=d_real)
                                + bce(labels=tf.zeros_like(d_fake), logits=d_fake))
        g_loss = tf.reduce_mean(bce(labels=tf.ones_like(d_fake), logits=d_fake))
        d_grads = gradients_fn(d_loss, d_vars)
        g_grads = gradients_fn(g_loss, g_vars)
        d_train = tf.compat.v1.train.AdamOptimizer(1e-3).apply_gradients(zip(d_grads, d_vars))
        g_train = tf.compat.v1.train.AdamOptimizer(1e-3).apply_gradients(zip(g_grads, g_vars))
        init = tf.compat.v1.global_variables_initializer()
    graph.finalize()
    data = np.random.RandomState(2)
    losses = []
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        first = sess.run(d_grads + g_grads, {z: data.randn(BATCH, NOISE),
                                             real: data.randn(BATCH, DATA) + 1.0})
        for _ in range(steps):
            feed = {z: data.randn(BATCH, NOISE), real: data.randn(BATCH, DATA) + 1.0}
            losses.append(sess.run([d_loss, d_train], feed)[0])
            losses.append(sess.run([g_loss, g_train], feed)[0])
    return first, np.array(losses), [op.name for op in graph.get_operations()]


def _ours(loss, variables):
    return mg.gradients(loss, variables, checkpoints="memory")


def test_gan_two_losses_match_and_train_identically():
    want, want_losses, _ = _gan(tf.gradients, steps=100)
    got, got_losses, _ = _gan(_ours, steps=100)
    assert_grads_close(got, want)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)


def test_gan_op_names_are_deterministic_and_calls_do_not_collide():
    _, _, names = _gan(_ours)
    _, _, again = _gan(_ours)
    assert names == again
    # Each call writes under its own "gradients" scope (gradients/, gradients_1/): the copies
    # and stitched partials of the discriminator's call never land in the generator's.
    scopes = {name.split("/")[0] for name in names if name.startswith("gradients")}
    assert {"gradients", "gradients_1"} <= scopes
    assert len(names) == len(set(names))


@pytest.mark.parametrize("outer", ["tf.gradients", "memory"])
def test_gradients_of_memsave_gradients(graph, session, outer):
    """Second order through a rewritten graph: the outer call may itself be memsave_grads."""
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(4, 8).astype(np.float32))
    w = tf.Variable((rng.randn(8, 8) / 3).astype(np.float32))
    h = x
    for _ in range(6):
        h = tf.tanh(tf.matmul(h, w))
    loss = tf.reduce_sum(h * h)
    inner = mg.gradients(loss, x, checkpoints="memory")[0]
    inner_ref = tf.gradients(loss, x)[0]
    penalty, penalty_ref = tf.reduce_sum(inner ** 2), tf.reduce_sum(inner_ref ** 2)
    if outer == "memory":
        second = mg.gradients(penalty, w, checkpoints="memory")
    else:
        second = tf.gradients(penalty, w)
    second_ref = tf.gradients(penalty_ref, w)
    session.run(tf.compat.v1.global_variables_initializer())
    assert_grads_close(session.run(second), session.run(second_ref))
