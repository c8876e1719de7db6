"""The one graph walk (``_tf.graph.walk``) and the one ``checkpoints=`` validation
(``_validate.check_checkpoints``), which every entry point runs before any graph exists."""

import pytest
import tensorflow as tf

import memsave_grads as mg
from memsave_grads import _validate
from memsave_grads._tf import graph as tf_graph


def test_walk_visits_each_reachable_node_once_within_include():
    edges = {1: [2, 3], 2: [4], 3: [4, 5], 4: [1], 5: [6], 6: []}
    assert sorted(tf_graph.walk([1], edges.__getitem__)) == [1, 2, 3, 4, 5, 6]
    # A rejected node is neither yielded nor crossed: 6 lies beyond 5.
    assert sorted(tf_graph.walk([1], edges.__getitem__, include=lambda n: n != 5)) == [1, 2, 3, 4]
    # Empty neighbours: yielded, not crossed.
    assert sorted(tf_graph.walk([1, 3], lambda n: [] if n == 3 else edges[n])) == [1, 2, 3, 4]


def test_walk_is_lazy_and_keys_unhashable_nodes():
    expanded = []

    def neighbours(node):
        expanded.append(node["id"])
        return [{"id": node["id"] + 1}]

    walked = tf_graph.walk([{"id": 0}], neighbours, key=lambda node: node["id"])
    assert next(n for n in walked if n["id"] == 3)["id"] == 3
    assert expanded == [0, 1, 2], "the walk went on after the caller stopped"


def test_walk_upstream_and_downstream_of_graph_ops(graph):
    x = tf.constant(1.0, name="x")
    a = tf.sin(x, name="a")
    b = tf.cos(a, name="b")
    with tf.control_dependencies([b]):
        c = tf.identity(a, name="c")
    assert {op.name for op in tf_graph.walk([c.op], tf_graph.input_ops)} == {"c", "a", "x"}
    assert ({op.name for op in tf_graph.walk([c.op], tf_graph.dependency_ops)}
            == {"c", "b", "a", "x"})
    assert ({op.name for op in tf_graph.walk([x.op], tf_graph.consumer_ops)}
            == {"x", "a", "b", "c"})
    assert tf_graph.creation_index(x.op) < tf_graph.creation_index(a.op)


@pytest.mark.parametrize("checkpoints,error,match", [
    ("fastest", mg.UnknownStrategyError, "unknown strategy 'fastest'"),
    ("budget:lots", mg.InvalidArgumentError, "lots"),
    ([], mg.InvalidArgumentError, "empty list"),
    (["has space"], mg.InvalidArgumentError, r"checkpoints\[0\]: malformed name pattern"),
    (["ok*", 3.0], mg.InvalidTypeError, r"checkpoints\[1\]: expected a tf.Tensor"),
    ([tf.constant(1.0)], mg.InvalidTypeError, r"checkpoints\[0\]: got an eager tensor"),
    (3, mg.InvalidTypeError, "checkpoints: expected a strategy name"),
])
def test_patch_refuses_bad_checkpoints_before_any_gradient(checkpoints, error, match):
    with pytest.raises(error, match=match):
        mg.patch(checkpoints)
    assert not mg.is_patched()


def test_without_tensors_a_list_must_hold_patterns():
    reason = "Tensors of that graph do not exist yet."
    with pytest.raises(mg.InvalidTypeError, match=r"checkpoints\[0\]: .*name pattern.*exist yet"):
        _validate.check_checkpoints([tf.constant(1.0)], tensors_unavailable=reason)
    with pytest.raises(mg.InvalidTypeError, match="or a list of name patterns, got"):
        _validate.check_checkpoints(tf.constant(1.0), tensors_unavailable=reason)
    _validate.check_checkpoints(["block*/add:0"], tensors_unavailable=reason)


@pytest.mark.parametrize("checkpoints, error", [
    ("fastest", mg.UnknownStrategyError), ([], mg.InvalidArgumentError),
    (3, mg.InvalidTypeError), (["bad pattern"], mg.InvalidArgumentError)])
def test_bad_checkpoints_are_refused_even_where_ys_do_not_depend_on_xs(graph, checkpoints,
                                                                        error):
    """tf.gradients would return [None] here; a bad argument is still a bad argument, refused
    before any op is added (before the redesign it slipped through when the region was
    empty)."""
    x = tf.compat.v1.placeholder(tf.float32, [2])
    unrelated = tf.compat.v1.placeholder(tf.float32, [2])
    y = tf.reduce_sum(tf.tanh(x))
    before = len(graph.get_operations())
    with pytest.raises(error):
        mg.gradients(y, [unrelated], checkpoints=checkpoints)
    assert len(graph.get_operations()) == before
    assert mg.gradients(y, [unrelated], checkpoints="memory") == [None]
