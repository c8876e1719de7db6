"""explain(): the plan report, with nothing added to the graph."""

import pytest
import tensorflow as tf

import memsave_grads as mg


def _chain(n=64, width=32, batch=16):
    graph = tf.Graph()
    with graph.as_default():
        h = tf.random.stateless_normal([batch, width], seed=[0, 0])
        weights = []
        for i in range(n):
            w = tf.Variable(tf.random.stateless_normal([width, width], seed=[i, 1]) * 0.1,
                            name=f"w{i}")
            weights.append(w)
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h * h)
    return graph, loss, weights


def test_report_adds_no_ops_and_predicts_the_chain_saving():
    graph, loss, weights = _chain()
    before = len(graph.get_operations())
    report = mg.explain(loss, weights, checkpoints="memory")
    assert len(graph.get_operations()) == before
    assert 4 <= len(report.checkpoint_names) <= 24
    assert report.predicted_saving > 3
    assert report.predicted_peak_bytes < report.predicted_plain_peak_bytes
    assert report.levels and sum(lv.recomputed_ops for lv in report.levels) > 0
    text = str(report)
    assert "predicted peak" in text and "checkpoints chosen" in text
    assert not report.unknown_dimensions


def test_report_of_an_explicit_list_matches_what_gradients_keeps():
    graph, loss, weights = _chain(n=8)
    with graph.as_default():
        tanhs = [op.outputs[0] for op in graph.get_operations() if op.type == "Tanh"]
        report = mg.explain(loss, weights, checkpoints=[tanhs[3]])
    assert report.checkpoint_names == (tanhs[3].name,)


def test_explain_raises_what_gradients_raises():
    graph, loss, weights = _chain(n=4)
    before = len(graph.get_operations())
    with pytest.raises(mg.UnknownStrategyError, match="unknown strategy 'fastest'"):
        mg.explain(loss, weights, checkpoints="fastest")
    assert len(graph.get_operations()) == before


def test_a_complex_y_is_explained_with_its_grad_ys():
    """A complex y has no default initial gradient: gradients() needs grad_ys, and so does
    explain(), which took no grad_ys and blamed gradients() for the keyword (outside review)."""
    graph = tf.Graph()
    with graph.as_default():
        h = tf.complex(tf.random.stateless_normal([16, 16], seed=[0, 0]), 0.0)
        weights = [tf.Variable(tf.random.stateless_normal([16, 16], seed=[i, 1]) * 0.1)
                   for i in range(16)]
        for w in weights:
            h = tf.signal.fft(tf.matmul(h, tf.complex(tf.tanh(w), 0.0))) / 4.0
        y = tf.reduce_sum(h * h)
        grad_y = tf.ones([], tf.complex64)
        before = len(graph.get_operations())
        with pytest.raises(mg.InvalidTypeError, match=r"grad_ys\[0\]: .* is complex"):
            mg.explain(y, weights)
        report = mg.explain(y, weights, grad_ys=grad_y)
        assert len(graph.get_operations()) == before
        assert report.rewrite and report.predicted_saving > 1
        with pytest.raises(mg.InvalidTypeError, match=r"^unexpected keyword argument"):
            mg.explain(y, weights, grad_ys=grad_y, gradient_ys=grad_y)


def test_unknown_batch_is_flagged():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 16])
        h = x
        for i in range(12):
            h = tf.tanh(h * float(i + 1))
        report = mg.explain(tf.reduce_sum(h), x)
    assert report.unknown_dimensions
    assert "unknown dimensions" in str(report)


@pytest.mark.parametrize("batch,reads_values", [(4, False), (None, True)])
def test_a_select_s_gradient_reads_its_values_only_through_a_dynamic_shape(batch, reads_values):
    """Dropout's ``tf.where(mask, h * scale, 0)``: the gradient reads the mask, and the values'
    shapes only where they are not static (``tf.shape`` then keeps the values alive)."""
    from memsave_grads import api

    graph = tf.Graph()
    with graph.as_default():
        w = tf.Variable(tf.ones([8, 8]))
        x = tf.compat.v1.placeholder(tf.float32, [batch, 8])
        h = tf.matmul(x, w, name="h")
        mask = tf.greater(h, 0.5, name="mask")
        scaled = tf.multiply(h, 1.25, name="scaled")
        dropped = tf.where(mask, scaled, tf.zeros([], tf.float32), name="dropped")
        loss = tf.reduce_sum(tf.tanh(dropped))
        model = api.prepare(loss, [w], None, [], {}, select=False).selection.model
    node = {name: i for i, name in enumerate(model.names)}
    assert model.gradient_reads_input(node["dropped"], node["scaled"]) == reads_values
    # The comparison passes no gradient back, so nothing it reads is held for backprop.
    assert not model.gradient_reads_input(node["mask"], node["h"])


def test_model_reads_inputs_per_edge():
    """`0.5 * h` and `h / 2` keep no `h` (only the constant's pruned gradient reads it); `h * w`
    keeps both; relu6's gradient reads its output, and elementwise ops may write in place."""
    from memsave_grads import api

    graph = tf.Graph()
    with graph.as_default():
        w = tf.Variable(tf.ones([8, 8]))
        h = tf.matmul(tf.ones([4, 8]), w, name="h")
        half = tf.multiply(h, 0.5, name="half")
        quarter = tf.divide(half, 2.0, name="quarter")
        scaled = tf.multiply(quarter, w[0], name="scaled")
        loss = tf.reduce_sum(tf.nn.relu6(scaled, name="relu6"))
        model = api.prepare(loss, [w], None, [], {}, select=False).selection.model
    node = {name: i for i, name in enumerate(model.names)}
    assert not model.gradient_reads_input(node["half"], node["h"])
    assert not model.gradient_reads_input(node["quarter"], node["half"])
    assert model.gradient_reads_input(node["scaled"], node["quarter"])
    assert model.gradient_reads_output(node["relu6"])
    assert not model.gradient_reads_inputs(node["relu6"])
    assert model.forwards_buffer(node["half"]) and not model.forwards_buffer(node["h"])


def test_explain_shows_nested_levels(graph):
    """A budget below every single-level plan nests (solver "revolve"): the report says which
    levels have checkpoints of their own, and how deep."""
    x = tf.compat.v1.placeholder(tf.float32, [64, 256])
    h = x
    for i in range(60):
        h = tf.tanh(h * (1.0 + 0.01 * i))
    loss = tf.reduce_sum(h)
    single = mg.explain(loss, [x], checkpoints="memory")
    assert all(lv.depth == 1 for lv in single.levels) and "nested:" not in str(single)
    budget = mg.Budget(bytes=int(0.6 * single.predicted_peak_bytes), solver="revolve")
    report = mg.explain(loss, [x], checkpoints=budget)
    assert max(lv.depth for lv in report.levels) >= 2, str(report)
    assert "nested:" in str(report) and "recomputation levels deep" in str(report)
    assert report.predicted_peak_bytes <= budget.bytes
