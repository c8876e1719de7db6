"""recompute(fn): recurrent steps inside tf.while_loop store their inputs, not their internals.

Also: forward graphs with while loops and Keras 2 recurrent layers give tf.gradients' values
under every strategy (the 2018 tool crashed on them).
"""

import re

import numpy as np
import pytest
import tensorflow as tf

import memsave_grads as mg
from conftest import assert_grads_close
from memsave_grads import measure
from memsave_grads.recomputation import recompute

B, D, H = 4, 3, 5


def _lstm_params(steps, batch=B, features=D, units=H):
    x = tf.constant(np.random.RandomState(1).randn(steps, batch, features).astype(np.float32))
    w = tf.Variable((np.random.RandomState(2).randn(features + units, 4 * units) * 0.3)
                    .astype(np.float32), name="W")
    b = tf.Variable(np.zeros(4 * units, np.float32), name="b")
    return w, b, x


def _lstm_loss(step_wrapper, steps, batch=B, features=D, units=H, dropout=0.0, params=None):
    """A hand-written LSTM over ``steps`` steps in a tf.while_loop; returns (loss, [W, b, x])."""
    w, b, x = params or _lstm_params(steps, batch, features, units)

    def cell(x_t, h, c):
        z = tf.matmul(tf.concat([x_t, h], 1), w) + b
        i, f, g, o = tf.split(z, 4, axis=1)
        c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
        h = tf.sigmoid(o) * tf.tanh(c)
        if dropout:
            h = tf.nn.dropout(h, rate=dropout)
        return h, c

    step = step_wrapper(cell)

    def body(t, h, c, total):
        h, c = step(x[t], h, c)
        return t + 1, h, c, total + tf.reduce_sum(h * h)

    zeros = tf.zeros([batch, units])
    _, _, c, total = tf.while_loop(lambda t, *_: t < steps, body, [0, zeros, zeros, 0.0])
    return total + tf.reduce_sum(c), [w, b, x]


def _plain(fn):
    return fn


def _v1_values(build, gradients_fn=tf.gradients):
    graph = tf.Graph()
    with graph.as_default():
        loss, xs = build()
        grads = gradients_fn(loss, xs)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            return sess.run([loss] + grads)


@pytest.mark.parametrize("gradients_fn", [tf.gradients,
                                          lambda y, x: mg.gradients(y, x, checkpoints="memory")],
                         ids=["tf.gradients", "memsave_memory"])
def test_lstm_in_a_while_loop_matches_in_a_v1_graph(gradients_fn):
    want = _v1_values(lambda: _lstm_loss(_plain, 20))
    got = _v1_values(lambda: _lstm_loss(recompute, 20), gradients_fn)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert_grads_close(got[1:], want[1:])


def test_lstm_under_gradient_tape_in_a_tf_function():
    params = _lstm_params(20)  # variables created outside the function, as Keras does
    results = {}
    for name, wrapper in [("plain", _plain), ("recompute", recompute)]:

        @tf.function
        def step(wrapper=wrapper):
            with tf.GradientTape() as tape:
                tape.watch(params[2])
                loss, xs = _lstm_loss(wrapper, 20, params=params)
            return loss, tape.gradient(loss, xs)

        results[name] = step()
    assert_grads_close([r.numpy() for r in results["recompute"][1]],
                       [r.numpy() for r in results["plain"][1]])


@pytest.mark.parametrize("jit_compile", [False, True], ids=["plain", "xla"])
def test_a_gathered_variable_gets_its_gradient(jit_compile):
    """A step reading rows of a variable (``tf.gather``: ``ResourceGather``, an embedding
    lookup, a layer of stacked weights) keeps the rows it read and sends their gradient on to
    the variable, as ``IndexedSlices``. Until 2026-11-27 that gradient was dropped: the
    variable's gradient came out wrong (max error 8.8 on a 3-step loop), silently."""
    table = tf.Variable(np.random.RandomState(0).randn(3, 4, 4).astype(np.float32) * 0.5)
    x = tf.constant(np.random.RandomState(1).randn(2, 4).astype(np.float32))

    def step(i, h):
        return h + tf.tanh(tf.matmul(h, tf.gather(table, i)))

    def gradient(fn):
        @tf.function(jit_compile=jit_compile, autograph=False)
        def run():
            with tf.GradientTape() as tape:
                _, h = tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, fn(i, h)),
                                     [tf.constant(0), x], maximum_iterations=3)
                loss = tf.reduce_sum(h * h)
            return tf.convert_to_tensor(tape.gradient(loss, table))
        return run()

    assert_grads_close([gradient(recompute(step))], [gradient(step)])


def test_autograph_leaves_the_recomputed_step_alone(caplog):
    # The step is called from a function AutoGraph converts; it converted our helpers too and
    # warned "AutoGraph could not transform ... Please report this to the TensorFlow team".
    params = _lstm_params(3)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss, xs = _lstm_loss(recompute, 3, params=params)
        return tape.gradient(loss, xs)

    with caplog.at_level("WARNING", logger="tensorflow"):
        step()
    assert not [r for r in caplog.records if "AutoGraph" in r.getMessage()], caplog.text


def test_dropout_is_not_redrawn():
    """The gradient of a dropout layer in a loop must use the forward pass's masks. The exact
    gradient follows from the forward outputs; tf.recompute_grad, which calls the function
    again, draws new masks and fails this check (asserted below, so the check can fail)."""
    steps, units = 6, 5

    def error_of(wrapper):
        graph = tf.Graph()
        with graph.as_default():
            x = tf.constant(np.random.RandomState(1).randn(steps, B, D).astype(np.float32))
            r = tf.constant(np.random.RandomState(3).randn(steps, B, units).astype(np.float32))
            w = tf.Variable(np.random.RandomState(2).randn(D, units).astype(np.float32))
            step = wrapper(lambda x_t: tf.nn.dropout(tf.matmul(x_t, w), rate=0.5))

            def body(t, total, outputs):
                h = step(x[t])
                return t + 1, total + tf.reduce_sum(h * r[t]), outputs.write(t, h)

            _, loss, outputs = tf.while_loop(lambda t, *_: t < steps, body,
                                             [0, 0.0, tf.TensorArray(tf.float32, steps)])
            grad = tf.gradients(loss, w)[0]
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                h, got, xv, rv = sess.run([outputs.stack(), grad, x, r])
        # d loss / d w = sum_t x_t^T (r_t * mask_t / keep); the forward output reveals mask_t.
        expected = sum(xv[t].T @ (rv[t] * 2.0 * (h[t] != 0)) for t in range(steps))
        return float(np.abs(got - expected).max() / np.abs(expected).max())

    assert error_of(recompute) < 1e-5
    assert error_of(tf.recompute_grad) > 1e-2, "the check should catch redrawn masks"


def test_unrolled_steps_wait_for_their_gradient(graph, session):
    """Outside a loop the copies are in the same graph: they must depend on the incoming
    gradient, or TensorFlow runs them during the forward pass and nothing is saved."""
    x = tf.constant(np.random.RandomState(0).randn(B, D).astype(np.float32))
    w = tf.Variable(np.random.RandomState(1).randn(D, D).astype(np.float32))
    block = recompute(lambda h: tf.tanh(tf.matmul(h, w)) * 2.0)
    h = x
    for _ in range(4):
        h = block(h)
    loss = tf.reduce_sum(h * h)
    grads = tf.gradients(loss, [w, x])
    h_ref = x
    for _ in range(4):
        h_ref = tf.tanh(tf.matmul(h_ref, w)) * 2.0
    want = tf.gradients(tf.reduce_sum(h_ref * h_ref), [w, x])
    replayed = [op for op in graph.get_operations()
                if re.search(r"memsave_recompute_\d+/replay/(?!.*_grad/)", op.name)]
    assert replayed
    for op in replayed:
        reads_a_copy = any(t.op in replayed for t in op.inputs)
        assert reads_a_copy or op.control_inputs, f"{op.name} could run in the forward pass"
    session.run(tf.compat.v1.global_variables_initializer())
    assert_grads_close(session.run(grads), session.run(want))


def test_lstm_t1000_peak_is_lower():
    """The measured saving on a long sequence (CPU BFC allocator byte counts)."""
    steps, batch, units = 300, 16, 128

    def peak(wrapper):
        graph = tf.Graph()
        with graph.as_default():
            loss, xs = _lstm_loss(wrapper, steps, batch=batch, features=32, units=units)
            grads = tf.gradients(loss, xs[:2])
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                sess.run(grads)
                return measure.peak_bytes_of(lambda: sess.run(grads))[0]

    plain, ours = peak(_plain), peak(recompute)
    # Per step, the plain loop stores ~10 [batch, units] tensors (gates, their activations,
    # c, tanh(c)); recompute stores x_t, h and c. 300 steps x 8 KiB x 10 = 23 MiB.
    assert plain >= 15 * measure.MIB, plain / measure.MIB
    assert ours <= 0.5 * plain, (ours / measure.MIB, plain / measure.MIB)


@pytest.mark.parametrize("layer", ["LSTM", "GRU", "SimpleRNN"])
@pytest.mark.parametrize("strategy", ["memory", "speed", "collection"])
def test_keras2_recurrent_layers_match(layer, strategy, graph, session):
    keras = pytest.importorskip("tf_keras")
    tf.compat.v1.set_random_seed(0)
    x = tf.constant(np.random.RandomState(1).randn(4, 12, 6).astype(np.float32))
    cls = getattr(keras.layers, layer)
    h = cls(8, return_sequences=True)(x)
    h = cls(8)(h)
    tf.compat.v1.add_to_collection("checkpoints", h)
    y = keras.layers.Dense(3)(h)
    loss = tf.reduce_sum(y * y)
    xs = tf.compat.v1.trainable_variables() + [x]
    got = mg.gradients(loss, xs, checkpoints=strategy)
    want = tf.gradients(loss, xs)
    assert any("recompute" in op.name for op in graph.get_operations())
    session.run(tf.compat.v1.global_variables_initializer())
    assert_grads_close(session.run(got), session.run(want))


def test_eager_call_runs_the_function():
    assert float(recompute(lambda a: a * 2.0)(tf.constant(3.0))) == 6.0


def test_bad_input(graph):
    with pytest.raises(mg.InvalidTypeError, match="fn: expected a callable"):
        recompute(3)
    with pytest.raises(mg.InvalidTypeError, match="functools.partial"):
        recompute(lambda a, training: a)(tf.constant(1.0), training=True)
    x = tf.constant([1.0, 2.0])

    def logs_activations(a):
        h = tf.tanh(a)
        return tf.py_function(lambda v: v, [h], tf.float32) * 2.0

    before = len(graph.get_operations())
    with pytest.raises(mg.UnsupportedGraphError, match="stateless"):
        recompute(logs_activations)(x)
    assert len(graph.get_operations()) > before  # the forward ops exist; nothing else ran


def test_a_value_captured_from_outside_the_loop_is_read_not_copied():
    """A loop body captures a value of the enclosing function (Keras 3 makes its dropout masks
    so) as a placeholder of the body graph; a copy of that placeholder would be an unfed input
    ("You must feed a value for placeholder tensor"). It is read, never replayed."""
    rng = np.random.RandomState(3)
    x = tf.constant(rng.randn(4, 8).astype(np.float32))
    w = tf.Variable(rng.randn(8, 8).astype(np.float32) / 3)

    @tf.function
    def gradients_of(wrapper):
        mask = tf.cast(tf.random.stateless_uniform([8], seed=[1, 2]) > 0.5, tf.float32)
        step = wrapper(lambda h: tf.tanh(tf.matmul(h, w) * mask))
        _, h = tf.while_loop(lambda i, h: i < 5, lambda i, h: (i + 1, step(h)),
                             (tf.constant(0), x))
        return tf.gradients(tf.reduce_sum(h * h), [x, w])

    assert_grads_close(gradients_of(recompute), gradients_of(lambda fn: fn))


def test_checks_inside_the_function_are_replayed(graph, session):
    """tf.debugging.check_numerics and asserts are stateful only so that TensorFlow keeps
    them: a recomputed function holding them gives tf.gradients' values (they used to be
    refused as stateful ops reading the inputs), and the replay holds copies of both."""
    x = tf.compat.v1.placeholder(tf.float32, [3, 4])
    w = tf.Variable(np.random.RandomState(0).randn(4, 4).astype(np.float32))

    def step(v):
        h = tf.debugging.check_numerics(tf.tanh(tf.matmul(v, w)), "replayed check")
        with tf.control_dependencies([tf.debugging.assert_less(h, 2.0, name="replayed_assert")]):
            return tf.sin(h)

    def checks():
        return ([op for op in graph.get_operations() if op.type == "CheckNumerics"
                 and op.get_attr("message") == b"replayed check"],
                [op for op in graph.get_operations()
                 if op.type == "If" and "replayed_assert" in op.name])

    y = tf.reduce_sum(recompute(step)(x))
    before = [len(found) for found in checks()]
    ours = tf.gradients(y, [x, w])
    after = [len(found) for found in checks()]
    assert after == [2 * n for n in before] and before == [1, 1], (before, after)
    plain = tf.gradients(tf.reduce_sum(step(x)), [x, w])
    session.run(tf.compat.v1.global_variables_initializer())
    feed = {x: np.random.RandomState(1).randn(3, 4).astype(np.float32)}
    assert_grads_close(session.run(ours, feed), session.run(plain, feed))


@pytest.mark.parametrize("jit_compile", [False, True])
def test_second_order_through_recompute_under_nested_tapes(jit_compile):
    """A gradient penalty through recompute() in a tf.function: the outer tape must see that
    the replayed values depend on the inputs (the copies are recorded on it, as TensorFlow's
    own op wrappers record theirs). Unrecorded, d/dx came out None and d/dw wrong by ~10."""
    w = tf.Variable(np.random.RandomState(0).randn(4, 4).astype(np.float32))
    x = tf.constant(np.random.RandomState(1).randn(3, 4).astype(np.float32))

    def step(v):
        h = tf.debugging.check_numerics(tf.tanh(tf.matmul(v, w)), "h")
        with tf.control_dependencies([tf.debugging.assert_less(h, 2.0)]):
            return tf.sin(h)

    def penalty_gradients(fn):
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                y = tf.reduce_sum(fn(x))
            g = inner.gradient(y, x)
            penalty = tf.reduce_sum(g * g)
        return outer.gradient(penalty, [x, w])

    ours = tf.function(lambda: penalty_gradients(recompute(step)), jit_compile=jit_compile)()
    plain = tf.function(lambda: penalty_gradients(step), jit_compile=jit_compile)()
    assert all(g is not None for g in ours)
    assert_grads_close([g.numpy() for g in ours], [g.numpy() for g in plain])
