"""Bad input gets our own exception type, a message naming the argument and the remedy, and
leaves no new op in the graph."""

import pytest
import tensorflow as tf

import memsave_grads as mg


@pytest.fixture
def chain(graph):
    x = tf.constant([[1.0, 2.0]], name="x")
    w = tf.constant([[0.5, -1.0], [2.0, 0.1]], name="w")
    h1 = tf.tanh(tf.matmul(x, w), name="h1")
    h2 = tf.tanh(tf.matmul(h1, w), name="h2")
    h3 = tf.tanh(tf.matmul(h2, w), name="h3")
    y = tf.reduce_sum(h3, name="y")
    return graph, x, (h1, h2, h3), y


def _raises(graph, exc_type, match, fn):
    before = len(graph.get_operations())
    with pytest.raises(exc_type, match=match) as info:
        fn()
    assert isinstance(info.value, mg.MemsaveGradsError)
    assert len(graph.get_operations()) == before, "the failed call left ops in the graph"
    return info.value


def test_unknown_strategy(chain):
    graph, x, _, y = chain
    err = _raises(graph, mg.UnknownStrategyError, "unknown strategy 'fastest'",
                  lambda: mg.gradients(y, x, checkpoints="fastest"))
    assert isinstance(err, ValueError) and "memory" in str(err)


def test_checkpoints_wrong_type(chain):
    graph, x, _, y = chain
    _raises(graph, mg.InvalidTypeError, "checkpoints: expected a strategy name",
            lambda: mg.gradients(y, x, checkpoints=42))


def test_checkpoint_from_another_graph(chain):
    graph, x, _, y = chain
    with tf.Graph().as_default():
        foreign = tf.constant(1.0)
    _raises(graph, mg.InvalidArgumentError, r"checkpoints\[0\].*another graph",
            lambda: mg.gradients(y, x, checkpoints=[foreign]))


def test_checkpoint_not_between_xs_and_ys(chain):
    graph, x, _, y = chain
    off_path = tf.sin(tf.constant([1.0, 2.0]), name="off_path")
    _raises(graph, mg.CheckpointNotOnPathError, "not on any path from xs to ys",
            lambda: mg.gradients(y, x, checkpoints=[off_path]))


@pytest.mark.parametrize("which", ["x", "y"])
def test_checkpoint_equal_to_x_or_y(chain, which):
    graph, x, _, y = chain
    tensor = x if which == "x" else y
    _raises(graph, mg.InvalidArgumentError, f"is one of {which}s",
            lambda: mg.gradients(y, x, checkpoints=[tensor]))


def test_integer_checkpoint(chain):
    graph, x, _, y = chain
    n = tf.shape(x)[0]
    y2 = y * tf.cast(n, tf.float32)
    _raises(graph, mg.InvalidArgumentError, "dtype int32",
            lambda: mg.gradients(y2, x, checkpoints=[n]))


def test_boolean_checkpoint(chain):
    graph, x, (h1, _, _), y = chain
    positive = h1 > 0
    y2 = y + tf.reduce_sum(tf.where(positive, h1, -h1))
    _raises(graph, mg.InvalidArgumentError, "dtype bool.*Remove it",
            lambda: mg.gradients(y2, x, checkpoints=[positive]))


@pytest.mark.parametrize("which", ["ys", "xs"])
@pytest.mark.parametrize("dtype", [tf.int32, tf.bool])
def test_integer_or_boolean_ys_and_xs(chain, which, dtype):
    graph, x, (h1, _, _), y = chain
    discrete = tf.cast(h1 > 0, dtype)
    ys, xs = (discrete, x) if which == "ys" else (y, discrete)
    err = _raises(graph, mg.NotDifferentiableError,
                  rf"{which}: expected at least one floating-point.*{dtype.name}.*tf.cast",
                  lambda: mg.gradients(ys, xs, checkpoints="memory"))
    assert isinstance(err, ValueError)
    # Patched, it falls back to tf.gradients, which returns None for it, like unpatched code.
    with mg.patch(checkpoints="memory"):
        assert tf.gradients(ys, xs) == [None]


def test_empty_xs(chain):
    graph, _, _, y = chain
    _raises(graph, mg.InvalidArgumentError, "xs: got an empty list",
            lambda: mg.gradients(y, [], checkpoints="memory"))


def test_empty_checkpoint_list(chain):
    graph, x, _, y = chain
    _raises(graph, mg.InvalidArgumentError, "empty list",
            lambda: mg.gradients(y, x, checkpoints=[]))


def test_xs_from_another_graph(chain):
    graph, _, _, y = chain
    with tf.Graph().as_default():
        foreign = tf.constant(1.0)
    _raises(graph, mg.InvalidArgumentError, r"xs\[0\].*another graph",
            lambda: mg.gradients(y, foreign, checkpoints="memory"))


def test_eager_tensors_outside_a_function():
    assert tf.executing_eagerly()
    x = tf.constant(1.0)
    with pytest.raises(mg.EagerExecutionError, match="tf.function") as info:
        mg.gradients(x * x, x, checkpoints="memory")
    assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("pattern", ["", "has space", "a:0:1", "block[1"])
def test_malformed_name_pattern(chain, pattern):
    graph, x, _, y = chain
    _raises(graph, mg.InvalidArgumentError, "malformed name pattern",
            lambda: mg.gradients(y, x, checkpoints=[pattern]))


def test_pattern_matching_nothing(chain):
    graph, x, _, y = chain
    _raises(graph, mg.CheckpointNotOnPathError, "matches no forward op",
            lambda: mg.gradients(y, x, checkpoints=["no_such_op*"]))


def test_non_tensor_checkpoint(chain):
    graph, x, _, y = chain
    _raises(graph, mg.InvalidTypeError, r"checkpoints\[0\]: expected a tf.Tensor",
            lambda: mg.gradients(y, x, checkpoints=[3.0]))


def test_empty_collection(chain):
    graph, x, _, y = chain
    _raises(graph, mg.NoCheckpointsFoundError, "add_to_collection",
            lambda: mg.gradients(y, x, checkpoints="collection"))


def test_speed_without_expensive_ops(graph):
    x = tf.constant([1.0, 2.0])
    y = tf.reduce_sum(tf.tanh(tf.sin(x)))
    _raises(graph, mg.NoCheckpointsFoundError, "no matmul",
            lambda: mg.gradients(y, x, checkpoints="speed"))


def test_memory_without_a_useful_cut(graph):
    x = tf.constant([1.0, 2.0])
    y = tf.reduce_sum(x)  # the only forward op is the one producing y
    _raises(graph, mg.NoCheckpointsFoundError, "no cut of the 1 forward ops",
            lambda: mg.gradients(y, x, checkpoints="memory"))


def test_unknown_keyword(chain):
    graph, x, _, y = chain
    _raises(graph, mg.InvalidTypeError, "unexpected keyword",
            lambda: mg.gradients(y, x, checkpoints="memory", gate=True))


def test_bad_unconnected_gradients(chain):
    graph, x, _, y = chain
    _raises(graph, mg.InvalidArgumentError, "unconnected_gradients",
            lambda: mg.gradients(y, x, checkpoints="memory", unconnected_gradients="ones"))


def test_grad_ys_length_mismatch(chain):
    graph, x, _, y = chain
    _raises(graph, mg.InvalidArgumentError, "grad_ys: expected one entry per y",
            lambda: mg.gradients(y, x, grad_ys=[None, None], checkpoints="memory"))


def test_v1_control_flow_is_refused(graph):
    from tensorflow.python.ops import control_flow_v2_toggles
    from tensorflow.python.ops import cond as cond_lib
    x = tf.constant([1.0, 2.0])
    h = tf.tanh(x)
    was_enabled = control_flow_v2_toggles.control_flow_v2_enabled()
    control_flow_v2_toggles.disable_control_flow_v2()
    try:
        z = cond_lib.cond(tf.constant(True), lambda: tf.sin(h), lambda: tf.cos(h))
    finally:
        if was_enabled:
            control_flow_v2_toggles.enable_control_flow_v2()
    y = tf.reduce_sum(tf.tanh(z))
    _raises(graph, mg.UnsupportedGraphError, "enable_control_flow_v2",
            lambda: mg.gradients(y, x, checkpoints=[h]))
