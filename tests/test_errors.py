"""Bad input gets our own exception type, a message naming the argument and the remedy, and
leaves no new op in the graph."""

import numpy as np
import pytest
import tensorflow as tf

import memsave_grads as mg
from conftest import assert_grads_close


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
            lambda: mg.gradients(y, x, checkpoints=[off_path], fallback="error"))


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
                  lambda: mg.gradients(ys, xs, checkpoints="memory", fallback="error"))
    assert isinstance(err, ValueError)
    # Patched, it falls back to tf.gradients, which returns None for it, like unpatched code.
    with mg.patch(checkpoints="memory"):
        assert tf.gradients(ys, xs) == [None]


def test_empty_ys_give_none_as_in_tf_gradients(chain):
    """tf.gradients([], xs) is None per x: patched (or falling back), so is ours."""
    graph, x, _, _ = chain
    _raises(graph, mg.NotDifferentiableError, "ys: got an empty list",
            lambda: mg.gradients([], [x], checkpoints="memory", fallback="error"))
    assert tf.compat.v1.gradients([], [x]) == [None]
    with mg.patch(checkpoints="memory"):
        assert tf.gradients([], [x]) == [None]


def test_empty_xs_is_not_an_error(chain):
    """tf.gradients(y, []) is []; so is ours, and it adds nothing to the graph."""
    graph, _, _, y = chain
    before = len(graph.get_operations())
    assert mg.gradients(y, [], checkpoints="memory") == []
    assert len(graph.get_operations()) == before


def test_empty_checkpoint_list(chain):
    graph, x, _, y = chain
    _raises(graph, mg.InvalidArgumentError, "empty list",
            lambda: mg.gradients(y, x, checkpoints=[]))


def test_xs_from_another_graph(chain):
    graph, _, _, y = chain
    with tf.Graph().as_default():
        foreign = tf.constant(1.0)
    _raises(graph, mg.InvalidArgumentError, r"xs\[0\].*neither is nor encloses the graph of ys",
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
            lambda: mg.gradients(y, x, checkpoints=["no_such_op*"], fallback="error"))


def test_non_tensor_checkpoint(chain):
    graph, x, _, y = chain
    _raises(graph, mg.InvalidTypeError, r"checkpoints\[0\]: expected a tf.Tensor",
            lambda: mg.gradients(y, x, checkpoints=[3.0]))


def test_empty_collection(chain):
    graph, x, _, y = chain
    _raises(graph, mg.NoCheckpointsFoundError, "add_to_collection",
            lambda: mg.gradients(y, x, checkpoints="collection", fallback="error"))


def test_speed_without_expensive_ops(graph):
    x = tf.constant([1.0, 2.0])
    y = tf.reduce_sum(tf.tanh(tf.sin(x)))
    _raises(graph, mg.NoCheckpointsFoundError, "no matmul",
            lambda: mg.gradients(y, x, checkpoints="speed", fallback="error"))


def test_memory_without_a_useful_cut(graph):
    x = tf.constant([1.0, 2.0])
    y = tf.reduce_sum(x)  # the only forward op is the one producing y
    _raises(graph, mg.NoCheckpointsFoundError, "no cut of the 1 forward ops",
            lambda: mg.gradients(y, x, checkpoints="memory", fallback="error"))


@pytest.mark.parametrize("checkpoints", ["collection", ["no_such_op*"]])
def test_by_default_a_strategy_with_nothing_to_keep_warns_and_computes_tf_gradients(
        chain, checkpoints, caplog):
    graph, x, _, y = chain
    with caplog.at_level("WARNING"):
        got = mg.gradients(y, x, checkpoints=checkpoints)
    assert "memsave_grads.gradients: falling back to tf.gradients" in caplog.text
    with tf.compat.v1.Session(graph=graph) as session:
        np.testing.assert_allclose(session.run(got), session.run(tf.gradients(y, x)))


def test_the_same_fallback_warns_once(chain, caplog):
    """A fallback says why once per message: a patched tf.hessians asks once per element, a
    model once per trace (outside review: the same advice at every inner call)."""
    graph, x, _, y = chain
    with caplog.at_level("WARNING"):
        for _ in range(3):
            mg.gradients(y, x, checkpoints=["no_such_op*"])
    said = [r for r in caplog.records if "falling back to tf.gradients" in r.getMessage()]
    assert len(said) == 1, caplog.text


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
            lambda: mg.gradients(y, x, checkpoints=[h], fallback="error"))


# --------------------------------------------------------------------------------------------
# Every argument is checked before any op is added (issue 14, item 5)
# --------------------------------------------------------------------------------------------


def _raises_builtin(graph, exc_type, builtin, match, fn):
    err = _raises(graph, exc_type, match, fn)
    assert isinstance(err, builtin), f"{type(err).__name__} is not a {builtin.__name__}"
    return err


@pytest.mark.parametrize("make_grad_y, exc_type, builtin, match", [
    (lambda: tf.ones([1, 2], tf.float64), mg.InvalidTypeError, TypeError,
     r"grad_ys\[0\]: expected float32 .*got float64.*tf.cast"),
    (lambda: np.ones([1, 2]), mg.InvalidTypeError, TypeError,  # NumPy's default is float64
     r"grad_ys\[0\]: expected float32 .*got float64"),
    (lambda: [[1, 2]], mg.InvalidTypeError, TypeError, r"grad_ys\[0\]: expected float32.*int32"),
    (lambda: tf.ones([3]), mg.InvalidArgumentError, ValueError,
     r"grad_ys\[0\]: expected a shape compatible with ys\[0\] 'h3:0', \(1, 2\), got \(3,\)"),
    # tf.gradients broadcasts this one silently into a wrong gradient.
    (lambda: tf.ones([1, 2, 1]), mg.InvalidArgumentError, ValueError,
     r"grad_ys\[0\]: expected a shape compatible"),
    (lambda: tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([4, 2])),
     mg.InvalidArgumentError, ValueError, r"grad_ys\[0\]: expected a shape compatible"),
    (lambda: object(), mg.InvalidTypeError, TypeError, r"grad_ys\[0\]: expected a tf.Tensor"),
])
def test_bad_grad_ys(chain, make_grad_y, exc_type, builtin, match):
    graph, x, (_, _, h3), _ = chain
    grad_y = make_grad_y()
    _raises_builtin(graph, exc_type, builtin, match,
                    lambda: mg.gradients(h3, x, grad_ys=[grad_y], checkpoints="memory"))


def test_grad_ys_from_another_graph(chain):
    graph, x, _, y = chain
    with tf.Graph().as_default():
        foreign = tf.constant(1.0)
    _raises_builtin(graph, mg.InvalidArgumentError, ValueError,
                    r"grad_ys\[0\]: the tensor 'Const:0' belongs to a graph",
                    lambda: mg.gradients(y, x, grad_ys=[foreign], checkpoints="memory"))


def test_eager_grad_ys_in_a_tf_graph():
    assert tf.executing_eagerly()
    eager = tf.constant(1.0)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant([1.0, 2.0])
        y = tf.reduce_sum(tf.tanh(tf.tanh(x)))
        _raises_builtin(graph, mg.EagerExecutionError, RuntimeError,
                        r"grad_ys\[0\]: got an eager",
                        lambda: mg.gradients(y, x, grad_ys=[eager], checkpoints="memory"))


def test_complex_y_needs_an_explicit_grad_y(chain):
    graph, x, (_, _, h3), _ = chain
    z = tf.complex(h3, h3)
    _raises_builtin(graph, mg.InvalidTypeError, TypeError, r"grad_ys\[0\]: ys\[0\].*complex64",
                    lambda: mg.gradients(z, x, checkpoints="memory"))


def test_bad_grad_ys_is_blamed_before_an_empty_collection(chain):
    graph, x, (_, _, h3), _ = chain
    assert not graph.get_collection("checkpoints")
    wrong = tf.ones([3])
    _raises(graph, mg.InvalidArgumentError, r"grad_ys\[0\]: expected a shape",
            lambda: mg.gradients(h3, x, grad_ys=[wrong]))  # checkpoints="collection"


def test_bad_grad_ys_under_patch_is_our_error(chain):
    graph, x, (_, _, h3), _ = chain
    wrong = tf.ones([1, 2], tf.float64)
    with mg.patch("memory"):
        _raises(graph, mg.InvalidTypeError, r"grad_ys\[0\]", lambda: tf.gradients(h3, x, wrong))


@pytest.mark.parametrize("method, match", [
    (999, r"aggregation_method: expected None or one of tf.AggregationMethod.ADD_N \(0\).*999"),
    ("add_n", "aggregation_method: .*'add_n'"),
])
def test_bad_aggregation_method(chain, method, match):
    graph, x, _, y = chain
    _raises_builtin(graph, mg.InvalidArgumentError, ValueError, match,
                    lambda: mg.gradients(y, x, checkpoints="memory", aggregation_method=method))


@pytest.mark.parametrize("name, exc_type, builtin, match", [
    ("a b", mg.InvalidArgumentError, ValueError, "name: expected a valid name scope.*'a b'"),
    ("_hidden", mg.InvalidArgumentError, ValueError, "name: .*'_hidden'"),  # root rule
    (5, mg.InvalidTypeError, TypeError, "name: expected a string.*int"),
])
def test_bad_name(chain, name, exc_type, builtin, match):
    graph, x, _, y = chain
    _raises_builtin(graph, exc_type, builtin, match,
                    lambda: mg.gradients(y, x, checkpoints="memory", name=name))


def test_stop_gradients_from_another_graph(chain):
    graph, x, _, y = chain
    with tf.Graph().as_default():
        foreign = tf.constant(1.0)
    _raises_builtin(graph, mg.InvalidArgumentError, ValueError,
                    r"stop_gradients\[0\]: the tensor 'Const:0' belongs to a graph",
                    lambda: mg.gradients(y, x, checkpoints="memory", stop_gradients=[foreign]))


def test_finalized_graph(chain):
    graph, x, _, y = chain
    graph.finalize()
    err = _raises_builtin(graph, mg.errors.FinalizedGraphError, RuntimeError,
                          "ys: the graph of ys is finalized.*before",
                          lambda: mg.gradients(y, x, checkpoints="memory"))
    assert "optimizer.minimize" in str(err)
    # tf.gradients cannot add ops there either: the patched path raises too, not falls back.
    with mg.patch("memory"):
        _raises(graph, mg.errors.FinalizedGraphError, "finalized", lambda: tf.gradients(y, x))


# --------------------------------------------------------------------------------------------
# Where tf.gradients raises for the same input, our message quotes its sentence (issue 35)
# --------------------------------------------------------------------------------------------


def _foreign(shape=()):
    with tf.Graph().as_default():
        return tf.ones(shape, name="foreign")


def _tensor_list(x):
    from tensorflow.python.ops import list_ops  # pylint: disable=import-outside-toplevel
    return list_ops.tensor_list_push_back(
        list_ops.empty_tensor_list(element_dtype=tf.float32, element_shape=[1, 2]), x)


#: name -> (ys, xs, keyword arguments) built from the chain fixture's (x, h3, y); each is an
#: input tf.gradients itself refuses.
TENSORFLOW_REFUSES = {
    "unconnected_nonsense": lambda x, h3, y: (y, x, {"unconnected_gradients": "nonsense"}),
    "unconnected_number": lambda x, h3, y: (y, x, {"unconnected_gradients": 5}),
    "complex_y_without_grad_ys": lambda x, h3, y: (tf.complex(h3, h3), x, {}),
    "grad_ys_length": lambda x, h3, y: (y, x, {"grad_ys": [None, None]}),
    "complex_grad_y_for_float_y": lambda x, h3, y: (
        h3, x, {"grad_ys": tf.complex(tf.ones([1, 2]), tf.ones([1, 2]))}),
    "bool_grad_y_for_float_y": lambda x, h3, y: (h3, x, {"grad_ys": tf.constant([[True, False]])}),
    "string_grad_y_for_float_y": lambda x, h3, y: (y, x, {"grad_ys": "abc"}),
    "float_grad_y_for_complex_y": lambda x, h3, y: (
        tf.complex(h3, h3), x, {"grad_ys": tf.ones([1, 2])}),
    "float_grad_y_for_variant_y": lambda x, h3, y: (
        _tensor_list(h3), x, {"grad_ys": tf.ones([1, 2])}),
    "grad_y_for_boolean_y": lambda x, h3, y: (
        [y, tf.less(h3, 0.5)], x, {"grad_ys": [None, tf.constant([[True, True]])]}),
    "unconvertible_grad_y": lambda x, h3, y: (y, x, {"grad_ys": object()}),
    "aggregation_number": lambda x, h3, y: (y, x, {"aggregation_method": 7}),
    "aggregation_string": lambda x, h3, y: (y, x, {"aggregation_method": "ADD_N"}),
    "root_scope_name": lambda x, h3, y: (y, x, {"name": "_hidden"}),
    "scope_name_not_a_string": lambda x, h3, y: (y, x, {"name": 5}),
    "unknown_keyword": lambda x, h3, y: (y, x, {"gate": True}),
    "x_of_another_graph": lambda x, h3, y: (y, _foreign(), {}),
    "ys_of_two_graphs": lambda x, h3, y: ([y, _foreign()], x, {}),
    "grad_y_of_another_graph": lambda x, h3, y: (y, x, {"grad_ys": _foreign()}),
    "stop_gradients_of_another_graph": lambda x, h3, y: (
        y, x, {"stop_gradients": [_foreign()]}),
    "ys_none": lambda x, h3, y: (None, x, {}),
    "none_among_ys": lambda x, h3, y: ([y, None], x, {}),
    "xs_none": lambda x, h3, y: (y, None, {}),
    "none_among_xs": lambda x, h3, y: (y, [x, None], {}),
    "unconvertible_y": lambda x, h3, y: ([y, object()], x, {}),
    "unconvertible_x": lambda x, h3, y: (y, [x, object()], {}),
}


def _ours_then_tensorflows(graph, ys, xs, kwargs):
    """Our error (adding no op), then unpatched tf.gradients' own for the same arguments, in
    the same graph (its sentence may name the graphs)."""
    before = len(graph.get_operations())
    with pytest.raises(mg.MemsaveGradsError) as ours:
        mg.gradients(ys, xs, checkpoints="memory", **kwargs)
    assert len(graph.get_operations()) == before, "the failed call left ops in the graph"
    with pytest.raises(Exception) as theirs:
        tf.compat.v1.gradients(ys, xs, **kwargs)
    return ours.value, theirs.value


@pytest.mark.parametrize("case", sorted(TENSORFLOW_REFUSES))
def test_our_error_quotes_tensorflows_sentence(chain, case):
    graph, x, (_, _, h3), y = chain
    ys, xs, kwargs = TENSORFLOW_REFUSES[case](x, h3, y)
    ours, theirs = _ours_then_tensorflows(graph, ys, xs, kwargs)
    assert isinstance(ours, type(theirs)), f"ours {type(ours)}, TensorFlow's {type(theirs)}"
    assert f"TensorFlow's message: {theirs}" in str(ours)
    assert str(ours).index("TensorFlow's message") > 40, "our own message comes first"


def test_a_list_holding_a_variable_among_xs_is_refused_as_tensorflow_refuses_it():
    """tf.gradients converts xs as references; a list holding a variable has none, and it
    raises NotImplementedError (inside a tf.function). Ours is that too."""
    w = tf.Variable(tf.ones([2, 2]))
    errors_raised = []

    @tf.function
    def step():
        y = tf.reduce_sum(tf.tanh(tf.ones([1, 2]) @ w))
        for gradients in (mg.gradients, tf.gradients):
            try:
                gradients(y, [[w], w])
            except Exception as error:  # pylint: disable=broad-except
                errors_raised.append(error)
        return y

    step()
    ours, theirs = errors_raised
    assert isinstance(ours, mg.InvalidTypeError) and isinstance(ours, NotImplementedError)
    assert isinstance(ours, type(theirs)) and "xs[0]: expected a tensor" in str(ours)
    assert f"TensorFlow's message: {theirs}" in str(ours)


def test_our_error_quotes_tensorflows_nested_scope_sentence(chain):
    graph, x, _, y = chain
    with tf.name_scope("outer"):
        ours, theirs = _ours_then_tensorflows(graph, y, x, {"name": "a b"})
    assert "is not a valid scope name" in str(theirs)
    assert str(theirs) in str(ours) and isinstance(ours, ValueError)


def test_finalized_graph_quotes_tensorflows_sentence(chain):
    graph, x, _, y = chain
    graph.finalize()
    ours, theirs = _ours_then_tensorflows(graph, y, x, {})
    assert isinstance(ours, RuntimeError) and str(theirs) in str(ours)


def test_a_number_among_ys_of_a_finalized_graph_is_the_finalized_graph_error(chain):
    graph, x, _, y = chain
    graph.finalize()
    with pytest.raises(mg.FinalizedGraphError):
        mg.gradients([y, 0.0], [x, 1.0], checkpoints="memory")


def test_combined_error_types_pickle():
    """Errors cross processes (multiprocessing, test runners): the type made to be
    TensorFlow's too survives a pickle round trip."""
    import pickle  # pylint: disable=import-outside-toplevel
    from memsave_grads import errors  # pylint: disable=import-outside-toplevel
    error = errors.like_tensorflows(errors.InvalidTypeError("xs[0]: a list"),
                                    NotImplementedError("numpy()"))
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and again.args == error.args
    assert isinstance(again, NotImplementedError) and isinstance(again, mg.InvalidTypeError)
    # Only builtins are combined: TensorFlow's own error types have constructors of their own.
    kept = errors.InvalidTypeError("x")
    assert errors.like_tensorflows(kept, tf.errors.InvalidArgumentError(None, None, "m")) is kept


def test_eager_execution_quotes_tensorflows_sentence():
    assert tf.executing_eagerly()
    x = tf.constant(1.0)
    with pytest.raises(mg.EagerExecutionError) as ours:
        mg.gradients(x * x, x, checkpoints="memory")
    with pytest.raises(RuntimeError) as theirs:
        tf.gradients(x * x, x)
    assert str(theirs.value) in str(ours.value)


def test_no_sentence_where_tensorflow_raises_nothing_there(chain):
    """A float64 grad_y for a float32 y: tf.gradients fails later, in an op's gradient, with
    that op's text; ours has no TensorFlow sentence to quote."""
    graph, x, (_, _, h3), _ = chain
    wider = tf.ones([1, 2], tf.float64)
    err = _raises(graph, mg.InvalidTypeError, r"grad_ys\[0\]: expected float32",
                  lambda: mg.gradients(h3, x, grad_ys=wider, checkpoints="memory"))
    assert "TensorFlow's message" not in str(err)


def test_no_aggregation_sentence_where_tensorflow_accepts_the_value(chain):
    """tf.gradients lets 1.0 through (it equals EXPERIMENTAL_TREE); we refuse a float, without
    quoting a sentence TensorFlow does not say."""
    graph, x, _, y = chain
    err = _raises(graph, mg.InvalidArgumentError, "aggregation_method: .*1.0",
                  lambda: mg.gradients(y, x, checkpoints="memory", aggregation_method=1.0))
    assert "TensorFlow's message" not in str(err)


def test_tensorflows_sentence_under_patch(chain):
    """TensorFlow's own tests (OnlyRealGradientsTest, testUnknownUnconnectedGradientsValueGiven)
    match these regular expressions; so must the patched tf.gradients."""
    graph, x, (_, _, h3), y = chain
    with mg.patch("memory"):
        with pytest.raises(TypeError, match=r"Gradients of complex tensors .* must set grad_ys "
                                            r"\(y\.dtype = complex64\)"):
            tf.gradients(tf.complex(h3, h3), x)
        with pytest.raises(ValueError,
                           match="Unknown value for unconnected_gradients: 'nonsense'"):
            tf.gradients(y, x, unconnected_gradients="nonsense")


@pytest.mark.parametrize("budget, match", [
    ("budget:1e999B", "checkpoints: budget 'budget:1e999B' is larger than the largest"),
    ("budget:1e300TiB", "is larger than the largest"),
])
def test_huge_budget_strings(chain, budget, match):
    graph, x, _, y = chain
    _raises_builtin(graph, mg.InvalidArgumentError, ValueError, match,
                    lambda: mg.gradients(y, x, checkpoints=budget))
    with pytest.raises(mg.InvalidArgumentError, match=match):
        mg.patch(budget)
    assert not mg.is_patched()


@pytest.mark.parametrize("kwargs, match", [
    ({"bytes": 10**400}, "Budget.bytes: expected a positive number of bytes up to"),
    ({"bytes": float("inf")}, "Budget.bytes: .*inf"),
    ({"bytes": 0.5}, "Budget.bytes: .*0.5"),  # rounds down to no byte at all
    ({"bytes": "4GiB"}, "Budget.bytes: .*str"),
    ({"bytes": np.bool_(True)}, "Budget.bytes"),
    ({"fraction": np.float64("nan")}, "Budget.fraction"),
    ({"fraction": 0.5, "solver": ["dp"]}, "Budget.solver: unknown solver"),
    ({"fraction": 0.5, "op_seconds": [("MatMul", 1.0)]}, "Budget.op_seconds: expected a mapping"),
    ({"fraction": 0.5, "op_seconds": {"MatMul": -1.0}}, "Budget.op_seconds"),
])
def test_bad_budget_values(kwargs, match):
    with pytest.raises(mg.InvalidArgumentError, match=match) as info:
        mg.Budget(**kwargs)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("kwargs, expected", [
    ({"fraction": np.float32(0.5)}, mg.Budget(fraction=0.5)),
    ({"fraction": np.float64(0.25)}, mg.Budget(fraction=0.25)),
    ({"bytes": np.int64(4096)}, mg.Budget(bytes=4096)),
    ({"bytes": np.uint32(4096)}, mg.Budget(bytes=4096)),
    ({"bytes": np.float32(4096.0)}, mg.Budget(bytes=4096)),
])
def test_numpy_scalars_are_budgets(kwargs, expected):
    budget = mg.Budget(**kwargs)
    assert budget == expected
    value = budget.bytes if budget.bytes is not None else budget.fraction
    assert type(value) in (int, float)  # builtin, so repr and arithmetic are plain


# --------------------------------------------------------------------------------------------
# ... and what tf.gradients accepts, we accept, with its values
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [
    "nested_list", "numpy_float32", "indexed_slices", "none_entry", "unknown_shape",
    "aggregation_tree", "bytes_name", "reused_scope_name"])
def test_accepted_like_tf_gradients(graph, session, case):
    x = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3) / 5, name="x")
    w = tf.constant(np.linspace(-1, 1, 9, dtype=np.float32).reshape(3, 3), name="w")
    h = x
    for i in range(4):
        h = tf.tanh(tf.matmul(h, w), name=f"h{i}")
    picked = tf.gather(h, [1, 0, 1], name="picked")
    ys, grad_ys, kwargs = [h], None, {}
    if case == "nested_list":
        grad_ys = [[[1.0, -2.0, 3.0], [0.5, 0.25, -1.0]]]
    elif case == "numpy_float32":
        grad_ys = [np.full([2, 3], 0.5, np.float32)]
    elif case == "indexed_slices":
        grad_ys = [tf.IndexedSlices(tf.ones([1, 3]), tf.constant([1]), tf.constant([2, 3]))]
    elif case == "none_entry":
        ys, grad_ys = [h, picked], [None, np.ones([3, 3], np.float32)]
    elif case == "unknown_shape":
        grad_ys = [tf.compat.v1.placeholder_with_default(tf.ones([2, 3]), shape=None)]
    elif case == "aggregation_tree":
        ys, kwargs = [h, picked], {"aggregation_method": tf.AggregationMethod.EXPERIMENTAL_TREE}
    elif case == "bytes_name":
        kwargs = {"name": b"grads_bytes"}
    elif case == "reused_scope_name":
        kwargs = {"name": "outer/"}
    got = mg.gradients(ys, [x, w], grad_ys=grad_ys, checkpoints="memory", **kwargs)
    want = tf.gradients(ys, [x, w], grad_ys=grad_ys, **kwargs)
    assert any("_memsave/recompute" in op.name for op in graph.get_operations())
    assert_grads_close(*session.run([got, want]))


def test_grad_ys_from_an_enclosing_function_are_captured():
    @tf.function
    def outer():
        grad_y = tf.fill([2, 3], 0.5)

        @tf.function
        def inner():
            x = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3) / 5)
            h = x
            for _ in range(4):
                h = tf.tanh(1.5 * h)
            return (mg.gradients(h, x, grad_ys=[grad_y], checkpoints="memory"),
                    tf.gradients(h, x, grad_ys=[grad_y]))

        return inner()

    got, want = outer()
    assert_grads_close(got, want)
