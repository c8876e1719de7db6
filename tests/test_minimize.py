"""minimize(): early per-variable updates give optimizer.minimize's values with one weight
gradient alive at a time (docs/minimize.md, design note "early release").

Peaks are CPU BFC allocator byte counts: deterministic for a given graph once the control
dependencies fix the order, so the bounds are measurements with headroom, not timings.
"""

import numpy as np
import pytest
import tensorflow as tf

from memsave_grads import errors
from memsave_grads import measure
from memsave_grads._tf import early_release
from memsave_grads._tf import graph as tf_graph
from memsave_grads.optimize import minimize
from tf_builders import updates_that_copied

MIB = measure.MIB

V1_OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.05),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.01),
    "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.05, momentum=0.9),
}


def _weights(width, depth, seed=0):
    rng = np.random.RandomState(seed)
    return [(rng.randn(width, width) / np.sqrt(width)).astype(np.float32) for _ in range(depth)]


def _data(width, batch, seed=1):
    rng = np.random.RandomState(seed)
    return rng.randn(batch, width).astype(np.float32), rng.randn(batch, width).astype(np.float32)


def _v1_mlp(width, depth, batch, tied=False):
    """tanh MLP in the default graph; ``tied``: the first weight is used again last."""
    x, y = (tf.constant(a) for a in _data(width, batch))
    ws = [tf.compat.v1.get_variable(f"w{i}", initializer=w, use_resource=True)
          for i, w in enumerate(_weights(width, depth))]
    h = x
    for w in ws + (ws[:1] if tied else []):
        h = tf.tanh(tf.matmul(h, w))
    return tf.reduce_mean(tf.square(h - y)), ws


def _train_v1(opt_name, ours, steps=20, tied=False, checkpoints="memory"):
    graph = tf.Graph()
    with graph.as_default():
        loss, ws = _v1_mlp(64, 8, 16, tied=tied)
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = V1_OPTIMIZERS[opt_name]()
        if ours:
            before = {op: list(op.control_inputs) for op in graph.get_operations()}
            train = minimize(loss, opt, checkpoints=checkpoints, global_step=step)
            assert all(op.control_inputs == c for op, c in before.items()), \
                "minimize() must not add control inputs to ops that existed before it"
        else:
            train = opt.minimize(loss, global_step=step)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [sess.run([loss, train])[0] for _ in range(steps)]
            values = sess.run(ws)
            extra = {"global_step": sess.run(step)}
            if opt_name == "adam":
                powers = sorted((v for v in opt.variables() if "_power" in v.name),
                                key=lambda v: v.name)  # beta1_power, beta2_power
                extra["beta_powers"] = sess.run(powers)
    return losses, values, extra


@pytest.mark.parametrize("opt_name", sorted(V1_OPTIMIZERS))
def test_same_trained_values_as_optimizer_minimize(opt_name):
    want_losses, want, want_extra = _train_v1(opt_name, ours=False)
    got_losses, got, got_extra = _train_v1(opt_name, ours=True)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())
    # Optimizer-wide state moves once per step, after the variable updates.
    assert got_extra["global_step"] == want_extra["global_step"] == 20
    if opt_name == "adam":
        np.testing.assert_allclose(got_extra["beta_powers"], [0.9 ** 21, 0.999 ** 21],
                                   rtol=1e-5)
    assert want_losses[-1] < want_losses[0]


def test_tied_weights_train_like_optimizer_minimize():
    """A weight used by the first and last layer: its update must wait for both gradients; the
    ordering edges that would close a cycle are left out and nothing deadlocks."""
    want_losses, want, _ = _train_v1("adam", ours=False, steps=5, tied=True)
    got_losses, got, _ = _train_v1("adam", ours=True, steps=5, tied=True)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


@pytest.mark.parametrize("make_opt", [
    pytest.param(lambda k: k.optimizers.legacy.Adam(0.01), id="legacy_adam"),
    pytest.param(lambda k: k.optimizers.Adam(0.01), id="adam"),
    pytest.param(lambda k: k.optimizers.SGD(0.05, momentum=0.9), id="sgd_momentum"),
    pytest.param(lambda k: k.optimizers.AdamW(0.01, weight_decay=0.1), id="adamw"),
    # The global norm combines every gradient: the ordering edges would close cycles and are
    # left out (values still right, nothing deadlocks).
    pytest.param(lambda k: k.optimizers.SGD(0.05, global_clipnorm=0.1), id="global_clipnorm"),
    # Every update reads and writes one shared u_product: tf.function chains the updates in
    # the order apply_gradients made them, the reverse of the release order.
    pytest.param(lambda k: k.optimizers.Nadam(0.01), id="nadam"),
])
def test_keras2_optimizer_inside_tf_function(make_opt):
    tf_keras = pytest.importorskip("tf_keras")
    x, y = (tf.constant(a) for a in _data(64, 16))

    def train(ours, steps=10):
        ws = [tf.Variable(w) for w in _weights(64, 8)]
        opt = make_opt(tf_keras)

        @tf.function
        def step():
            if ours:
                h = x
                for w in ws:
                    h = tf.tanh(tf.matmul(h, w))
                loss = tf.reduce_mean(tf.square(h - y))
                minimize(loss, opt, var_list=ws, checkpoints="memory")
            else:
                with tf.GradientTape() as tape:
                    h = x
                    for w in ws:
                        h = tf.tanh(tf.matmul(h, w))
                    loss = tf.reduce_mean(tf.square(h - y))
                opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
            return loss

        losses = [float(step()) for _ in range(steps)]
        return losses, [w.numpy() for w in ws], int(opt.iterations.numpy())

    want_losses, want, want_iterations = train(False)
    got_losses, got, got_iterations = train(True)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())
    assert got_iterations == want_iterations == 10


# --- memory: a wide MLP whose weights dominate (4 x 16 MiB weights, batch 8) -------------------

WIDE, WIDE_DEPTH, WIDE_BATCH = 2048, 4, 8
GRAD_MIB = WIDE * WIDE * 4 / MIB  # one weight gradient: 16 MiB


def _wide_peak_mib(build_train_op, opt_name="adam", runs=3):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(_data(WIDE, WIDE_BATCH)[0])
        ws = [tf.compat.v1.get_variable(f"w{i}", initializer=w, use_resource=True)
              for i, w in enumerate(_weights(WIDE, WIDE_DEPTH))]
        h = x
        for w in ws:
            h = tf.nn.relu(tf.matmul(h, w))
        loss = tf.reduce_mean(tf.square(h))
        train = build_train_op(loss, ws, V1_OPTIMIZERS[opt_name]())
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train)  # the first step also copies each weight off its initial value
            return max(measure.peak_bytes_of(lambda: sess.run(train))[0] / MIB
                       for _ in range(runs))


@pytest.mark.parametrize("opt_name", [
    "sgd", pytest.param("adam", marks=pytest.mark.slow)])  # ~10 s each
def test_one_weight_gradient_alive_at_a_time(opt_name):
    ours = _wide_peak_mib(lambda loss, ws, opt: minimize(loss, opt, checkpoints="memory"),
                          opt_name)
    # One gradient plus scratch: 16-17 MiB on an idle machine. With the other core busy the
    # allocator may serve the 16 MiB from a larger free chunk it does not split (21.5 MiB with
    # Adam once, 26.7 with SGD once, both in a full test run): bounded by what is ruled out,
    # two live gradients (32 MiB).
    assert ours < 2 * GRAD_MIB, f"minimize peaked at {ours:.1f} MiB"
    all_grads = _wide_peak_mib(
        lambda loss, ws, opt: opt.minimize(loss, gate_gradients=opt.GATE_GRAPH), opt_name)
    assert all_grads >= WIDE_DEPTH * GRAD_MIB, f"GATE_GRAPH peaked at {all_grads:.1f} MiB"


def test_without_ordering_edges_gradients_pile_up(monkeypatch):
    """Dataflow alone runs the backward pass ahead of the updates (design note "early
    release"): the control dependencies are what keeps one gradient alive."""
    monkeypatch.setattr(early_release, "order_updates",
                        lambda updates, grad_floor, release_order=True: {"skipped_cycles": 0})
    peak = _wide_peak_mib(lambda loss, ws, opt: minimize(loss, opt, checkpoints=None), "sgd")
    assert peak >= 1.9 * GRAD_MIB, f"expected several live gradients, got {peak:.1f} MiB"


def test_update_does_not_copy_the_weight():
    """Writes wait for the backward ops that read the forward value of the weight, so no
    update finds its buffer shared (which would make TensorFlow copy the whole weight)."""
    graph = tf.Graph()
    with graph.as_default():
        loss, ws = _v1_mlp(512, 4, 8)
        train = minimize(loss, V1_OPTIMIZERS["sgd"](), checkpoints=None)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train)  # first step: the initializers' constants still share the buffers
            copies = updates_that_copied(sess, train, 6)
    assert not copies, f"updates copied their weight: {copies}"


# --- bad input: our own errors, raised before anything is added ------------------------------

def _small_graph():
    w = tf.compat.v1.get_variable("w", initializer=np.eye(4, dtype=np.float32),
                                  use_resource=True)
    x = tf.constant(np.ones((2, 4), np.float32))
    return w, tf.reduce_sum(tf.tanh(tf.matmul(x, w)))


@pytest.mark.parametrize("case, error", [
    ("not_an_optimizer", errors.InvalidTypeError),
    ("optimizer_class", errors.InvalidTypeError),
    ("tensor_in_var_list", errors.InvalidTypeError),
    ("ref_variable", errors.InvalidTypeError),
    ("var_list_not_a_list", errors.InvalidTypeError),
    ("duplicate_variable", errors.InvalidArgumentError),
    ("empty_var_list", errors.InvalidArgumentError),
    ("loss_not_scalar", errors.InvalidArgumentError),
    ("loss_integer", errors.NotDifferentiableError),
    ("loss_callable", errors.InvalidTypeError),
    ("unconnected", errors.InvalidArgumentError),
])
def test_bad_input_raises_our_errors_before_adding_ops(graph, case, error):
    w, loss = _small_graph()
    opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    args = {"loss": loss, "optimizer": opt, "var_list": [w]}
    if case == "not_an_optimizer":
        args["optimizer"] = 0.1
    elif case == "optimizer_class":
        args["optimizer"] = tf.compat.v1.train.AdamOptimizer
    elif case == "tensor_in_var_list":
        args["var_list"] = [w, tf.constant(1.0)]
    elif case == "ref_variable":
        args["var_list"] = [tf.compat.v1.Variable(1.0, use_resource=False)]
    elif case == "var_list_not_a_list":
        args["var_list"] = w
    elif case == "duplicate_variable":
        args["var_list"] = [w, w]
    elif case == "empty_var_list":
        args["var_list"] = []
    elif case == "loss_not_scalar":
        args["loss"] = tf.tanh(tf.matmul(tf.ones((2, 4)), w))
    elif case == "loss_integer":
        args["loss"] = tf.constant(3)
    elif case == "loss_callable":
        args["loss"] = lambda: loss
    elif case == "unconnected":
        other = tf.compat.v1.get_variable("other", initializer=1.0, use_resource=True)
        args["var_list"] = [other]
    before = len(graph.get_operations())
    with pytest.raises(error) as info:
        minimize(args.pop("loss"), args.pop("optimizer"), checkpoints=None, **args)
    assert isinstance(info.value, errors.MemsaveGradsError)
    assert len(graph.get_operations()) == before, "ops were added before the error"


def test_eager_loss_raises_eager_execution_error():
    with pytest.raises(errors.EagerExecutionError):
        minimize(tf.constant(1.0), tf.compat.v1.train.GradientDescentOptimizer(0.1),
                 var_list=[tf.Variable(1.0)])


def test_keras3_optimizer_and_keras_global_step_are_refused():
    keras = pytest.importorskip("keras")
    tf_keras = pytest.importorskip("tf_keras")
    w = tf.Variable(np.eye(4, dtype=np.float32))
    captured = {}

    @tf.function
    def step(opt, global_step=None):
        loss = tf.reduce_sum(tf.tanh(tf.matmul(tf.ones((2, 4)), w)))
        try:
            minimize(loss, opt, var_list=[w], checkpoints=None, global_step=global_step)
        except errors.MemsaveGradsError as exc:
            captured["error"] = exc
        return loss

    if keras.__version__.startswith("3"):
        step(keras.optimizers.Adam())
        assert isinstance(captured.pop("error"), errors.InvalidTypeError)
    step(tf_keras.optimizers.SGD(), tf.Variable(0, dtype=tf.int64))
    assert isinstance(captured.pop("error"), errors.InvalidArgumentError)


def test_var_list_required_inside_tf_function():
    w = tf.Variable(1.0)

    @tf.function
    def step():
        minimize(w * w, tf.compat.v1.train.GradientDescentOptimizer(0.1), checkpoints=None)

    with pytest.raises(errors.InvalidArgumentError, match="var_list"):
        step()


def test_variable_from_another_graph_is_refused(graph):
    other = tf.Graph()
    with other.as_default():
        foreign = tf.compat.v1.get_variable("foreign", initializer=1.0, use_resource=True)
    w, loss = _small_graph()
    with pytest.raises(errors.InvalidArgumentError, match="another graph"):
        minimize(loss, tf.compat.v1.train.GradientDescentOptimizer(0.1), var_list=[w, foreign],
                 checkpoints=None)


def test_predicted_automatic_control_edges_are_the_ones_tf_function_adds():
    """The early-release ordering checks its edges for cycles during the trace, before
    tf.function adds its automatic control dependencies; ``automatic_control_edges`` predicts
    those. Read inside a trace, it must name exactly the edges TensorFlow then adds among the
    same ops: reads after writes, writes after reads, a cond that writes a variable (tf_keras'
    Nadam), and stateful ops that take no resource."""
    v, w = tf.Variable(1.0), tf.Variable(2.0)
    traced = {}

    def body(x):
        a = v.read_value() * x
        w.assign(a)
        b = w.read_value() + v.read_value()
        v.assign_add(b)
        tf.print("first")
        c = tf.cond(x > 0, lambda: w.assign_add(1.0), lambda: tf.identity(w.read_value()))
        tf.print("second")
        ops = tf.compat.v1.get_default_graph().get_operations()
        traced["ops"] = {op.name for op in ops}
        traced["predicted"] = {(before.name, after.name)
                               for before, after in tf_graph.automatic_control_edges(ops)}
        return b + c + w.read_value()

    graph = tf.function(body).get_concrete_function(tf.TensorSpec((), tf.float32)).graph
    added = {(c.name, op.name) for op in graph.get_operations() if op.name in traced["ops"]
             for c in op.control_inputs if c.name in traced["ops"]}
    assert traced["predicted"] == added
    assert len(added) >= 6, added   # the case really orders something


def test_outside_a_function_nothing_is_predicted():
    with tf.Graph().as_default() as graph:
        v = tf.compat.v1.Variable(1.0, use_resource=True)
        v.assign_add(v.read_value())
        assert tf_graph.automatic_control_edges(graph.get_operations()) == []


def test_tf1_control_flow_in_a_function_is_not_predicted():
    """A function graph holding TF1 control flow (Switch/Merge, which tf.cond no longer builds
    inside tf.function but raw ops can): the automatic control dependencies rewire it in ways
    not emulated, so 'cannot say' (None), and the early-release ordering then adds no edge
    rather than risk a cycle."""
    seen = {}

    def body(x):
        false_branch, true_branch = tf.raw_ops.Switch(data=x, pred=x > 0)
        merged, _ = tf.raw_ops.Merge(inputs=[false_branch * 2.0, true_branch])
        seen["edges"] = tf_graph.automatic_control_edges(
            tf.compat.v1.get_default_graph().get_operations())
        return merged

    tf.function(body).get_concrete_function(tf.TensorSpec((), tf.float32))
    assert seen["edges"] is None
