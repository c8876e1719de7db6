"""Every strategy gives tf.gradients' values on every graph shape of the catalogue."""

import numpy as np
import pytest
import tensorflow as tf

import memsave_grads as mg
from conftest import assert_grads_close
import graphs
from graphs import BUILDERS

STRATEGIES = ["collection", "speed", "memory", "explicit", "patterns"]


def _checkpoints(strategy, case):
    if strategy == "explicit":
        return case.interior[::2]
    if strategy == "patterns":
        return [t.op.name for t in case.interior[1::2]] or [case.interior[0].name]
    return strategy


def _dense(values):
    return [tf.convert_to_tensor(v) if isinstance(v, tf.IndexedSlices) else v for v in values]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_graph_mode_parity(builder, strategy, graph, session):
    case = BUILDERS[builder]()
    expected = tf.gradients(case.ys, case.xs, case.grad_ys, **case.kwargs)
    actual = mg.gradients(case.ys, case.xs, case.grad_ys,
                          checkpoints=_checkpoints(strategy, case), **case.kwargs)
    assert [type(a) for a in actual] == [type(e) for e in expected]
    assert [None if a is None else a.dtype for a in actual] == \
        [None if e is None else e.dtype for e in expected]
    session.run(tf.compat.v1.global_variables_initializer())
    fetch_actual = [a for a in _dense(actual) if a is not None]
    fetch_expected = [e for e in _dense(expected) if e is not None]
    # One run: stateful ops (dropout masks) draw once and both gradients must agree on it.
    got, want = session.run([fetch_actual, fetch_expected], case.feed)
    assert_grads_close(got, want)


@pytest.mark.parametrize("strategy", ["speed", "memory", "collection"])
@pytest.mark.parametrize("builder", sorted(set(BUILDERS) - {"unknown_batch"}))
def test_tf_function_parity(builder, strategy, monkeypatch):
    """Inside tf.function (a FuncGraph), against tf.gradients in the same trace."""
    monkeypatch.setattr(graphs, "make_weight", lambda init, name: tf.constant(init, name=name))

    @tf.function
    def step():
        case = BUILDERS[builder]()
        ours = mg.gradients(case.ys, case.xs, case.grad_ys, checkpoints=strategy, **case.kwargs)
        theirs = tf.gradients(case.ys, case.xs, case.grad_ys, **case.kwargs)
        return ([g for g in _dense(ours) if g is not None],
                [g for g in _dense(theirs) if g is not None])

    ours, theirs = step()
    assert_grads_close([o.numpy() for o in ours], [t.numpy() for t in theirs])


@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_tf_function_with_variables_created_outside(strategy):
    """The usual TF2 training step: variables outside, gradients w.r.t. them inside."""
    rng = np.random.RandomState(0)
    ws = [tf.Variable(rng.randn(8, 8).astype(np.float32) / 3) for _ in range(6)]
    x = tf.constant(rng.randn(4, 8).astype(np.float32))

    @tf.function
    def step():
        h = x
        for w in ws:
            h = h + tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h * h)
        return mg.gradients(loss, ws, checkpoints=strategy), tf.gradients(loss, ws)

    ours, theirs = step()
    assert_grads_close([o.numpy() for o in ours], [t.numpy() for t in theirs])


@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_unknown_batch_with_large_weights(graph, session, strategy):
    """Unknown batch counts as 1: weights dwarf activations, yet separators are still kept."""
    x = tf.compat.v1.placeholder(tf.float32, [None, 256])
    ws = [tf.Variable(np.eye(256, dtype=np.float32) * 0.5) for _ in range(16)]
    h = x
    for w in ws:
        h = h + tf.tanh(tf.matmul(h, w))
    loss = tf.reduce_mean(tf.square(h))
    ours = mg.gradients(loss, ws, checkpoints=strategy)
    assert any("recompute" in op.name for op in graph.get_operations())
    theirs = tf.gradients(loss, ws)
    session.run(tf.compat.v1.global_variables_initializer())
    feed = {x: np.random.RandomState(0).randn(5, 256).astype(np.float32)}
    got, want = session.run([ours, theirs], feed)
    assert_grads_close(got, want)
