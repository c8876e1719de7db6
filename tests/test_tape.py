"""Tape routing (design note "tape routing"): ``tf.GradientTape`` inside a graph, computed with
memsave_grads, against the unrouted tape.

Every case builds its tapes in a ``tf.function`` and returns gradients; it runs once with
TensorFlow's own tape (the reference) and once per way in (``patch()``, ``route_tapes()``,
``memsave_grads.GradientTape``) and strategy. The results must match the reference: values
(float64, rtol 1e-10), None where it gives None, ``IndexedSlices`` where it gives them, the
structure of the sources. Each routed run must also have gone through
``memsave_grads.gradients`` (the ``spy`` fixture) and, under ``"speed"``, which recomputes
everything but the matmuls, have copied forward ops: no case passes because the tape was left
to TensorFlow.
"""

import functools
import logging
from contextlib import nullcontext

import numpy as np
import pytest
import tensorflow as tf

import children
import memsave_grads as mg
from memsave_grads import api
from memsave_grads import tape as tape_routing
from memsave_grads._tf import function_ops
from memsave_grads._tf import ordering
from memsave_grads._tf import tape_record
# TensorFlow's thread-wide stop, which its own code uses (tf.recompute_grad's forward pass).
from tensorflow.python.eager import record as tensorflow_record

DTYPE = tf.float64
RTOL = 1e-10
WIDTH, DEPTH = 6, 6
WAYS = ["patch", "route_tapes", "GradientTape"]
#: Each way in and each strategy at least once: the hooks (patch, route_tapes) and the class
#: run the same gradient code, so the whole product would only triple the module's time.
ROUTES = [("memory", "patch"), ("memory", "GradientTape"), ("speed", "route_tapes"),
          ("budget:70%", "patch")]

_rng = np.random.RandomState(0)
WS = [tf.Variable(_rng.randn(WIDTH, WIDTH) / np.sqrt(WIDTH), dtype=DTYPE, name=f"w{i}")
      for i in range(DEPTH)]
FROZEN = tf.Variable(_rng.randn(WIDTH, WIDTH) / np.sqrt(WIDTH), dtype=DTYPE, trainable=False)
UNUSED = tf.Variable(_rng.randn(WIDTH), dtype=DTYPE, name="unused")
EMBEDDING = tf.Variable(_rng.randn(20, WIDTH), dtype=DTYPE, name="embedding")
BATCH = 32  # activations outweigh the weights, so that "memory" recomputes
X = tf.constant(_rng.randn(BATCH, WIDTH), dtype=DTYPE)
IDS = tf.constant(_rng.randint(0, 20, BATCH))


def chain(h, weights):
    for w in weights:
        h = h + tf.tanh(tf.matmul(h, w))
    return h


def loss_of(h):
    return tf.reduce_sum(tf.tanh(h) * h)


# --------------------------------------------------------------------------------------------
# The cases: (Tape, x) -> nested gradients. ``Tape`` is tf.GradientTape or the routed class.
# --------------------------------------------------------------------------------------------

def before_the_with_block(Tape, x):
    a = chain(x, WS[:2])  # not recorded: its weights get None
    with Tape() as tape:
        loss = loss_of(chain(a, WS[2:]))
    return tape.gradient(loss, WS)


def stop_recording(Tape, x):
    with Tape() as tape:
        h = chain(x, WS[:2])
        with tape.stop_recording():
            unrecorded = chain(h, WS[2:4])
        loss = loss_of(h + chain(unrecorded, WS[4:]))
    return tape.gradient(loss, WS)


def watched_input(Tape, x):
    with Tape() as tape:
        tape.watch(x)
        loss = loss_of(chain(x, WS))
    return tape.gradient(loss, {"x": x, "weights": WS})


def unwatched_input(Tape, x):
    with Tape() as tape:
        y = x * 2.0  # x is not watched: nothing here is recorded
        loss = loss_of(chain(y, WS))
    return tape.gradient(loss, WS)


def watched_leaf(Tape, x):
    h = chain(x, WS[:2])
    with Tape() as tape:
        tape.watch(h)
        loss = loss_of(chain(h, WS[2:]))
    return tape.gradient(loss, [h, WS])


def watched_intermediate(Tape, x):
    with Tape() as tape:
        tape.watch(x)
        h = chain(x, WS[:3])
        tape.watch(h)  # already recorded: the watch changes nothing
        loss = loss_of(chain(h, WS[3:]))
    return tape.gradient(loss, [x, h, WS])


def watched_after_stop(Tape, x):
    with Tape() as tape:
        tape.watch(x)
        with tape.stop_recording():
            h = chain(x, WS[:2])
        tape.watch(h)  # a leaf: its op was made while the tape was stopped
        loss = loss_of(chain(h, WS[2:]))
    return tape.gradient(loss, [x, h, WS])


def watched_after_a_thread_wide_stop(Tape, x):
    with Tape() as tape:
        tape.watch(x)
        with tensorflow_record.stop_recording():  # every tape of the thread, not this one's
            h = x + chain(x, WS[:2])
        tape.watch(h)  # a leaf: no tape recorded its op, though it reads the watched x
        loss = loss_of(chain(h, WS[2:]))
    return tape.gradient(loss, [x, h, WS])


def watch_accessed_variables_off(Tape, x):
    with Tape(watch_accessed_variables=False) as tape:
        tape.watch(WS[::2])
        loss = loss_of(chain(x, WS) @ FROZEN)
    return tape.gradient(loss, WS + [FROZEN])


def persistent_twice(Tape, x):
    with Tape(persistent=True) as tape:
        h = chain(x, WS[:3])
        first = loss_of(h)
        second = loss_of(chain(h, WS[3:]))
    return [tape.gradient(first, WS), tape.gradient(second, WS[1:])]


def persistent_inside_its_context(Tape, x):
    with Tape(persistent=True) as tape:
        loss = loss_of(chain(x, WS))
        grads = tape.gradient(loss, WS)  # recorded on the tape itself
        penalty = tf.add_n([tf.reduce_sum(g * g) for g in grads])
    return [grads, tape.gradient(penalty, WS)]


def output_gradients(Tape, x):
    with Tape() as tape:
        h = chain(x, WS)
        loss = loss_of(h)
    half = tf.fill(tf.shape(h), tf.constant(0.5, DTYPE))
    return tape.gradient([h, loss], WS, output_gradients=[half, tf.constant(2.0, DTYPE)])


def unconnected_zero(Tape, x):
    with Tape() as tape:
        loss = loss_of(chain(x, WS))
    return tape.gradient(loss, WS + [UNUSED], unconnected_gradients="zero")


def gradient_penalty(Tape, x):
    """WGAN-GP: the outer tape differentiates the inner tape's gradient."""
    fake = chain(x * 0.5, WS[:2])
    alpha = tf.constant(np.linspace(0.1, 0.9, BATCH).reshape(BATCH, 1), DTYPE)
    with Tape() as outer:
        interpolated = alpha * x + (1.0 - alpha) * fake
        with Tape() as inner:
            inner.watch(interpolated)
            critic = loss_of(chain(interpolated, WS[2:]))
        slope = tf.sqrt(tf.reduce_sum(tf.square(inner.gradient(critic, interpolated)), axis=1))
        penalty = tf.reduce_mean(tf.square(slope - 1.0))
    return outer.gradient(penalty, WS)


def third_order(Tape, x):
    v = x[0]
    with Tape() as t3:
        t3.watch(v)
        with Tape() as t2:
            t2.watch(v)
            with Tape() as t1:
                t1.watch(v)
                f = loss_of(chain(v[None, :], WS))
            g1 = t1.gradient(f, v)
            s1 = tf.reduce_sum(g1 * tf.sin(v))
        g2 = t2.gradient(s1, [v, WS[0]])
        s2 = tf.reduce_sum(g2[0] * g2[0]) + tf.reduce_sum(g2[1])
    return [g1, g2, t3.gradient(s2, [v, WS])]


def reset(Tape, x):
    with Tape() as tape:
        first = loss_of(chain(x, WS[:3]))  # forgotten: only `second` reaches WS[:3]
        tape.reset()
        total = first + loss_of(chain(x * 0.5, WS))
    return tape.gradient(total, WS)


def sparse(Tape, x):
    with Tape() as tape:
        h = tf.gather(EMBEDDING, IDS) + x
        loss = loss_of(chain(h, WS))
    return tape.gradient(loss, [EMBEDDING] + WS)


def nested_structures(Tape, x):
    with Tape(persistent=True) as tape:
        tape.watch(x)
        h = chain(x, WS[:3])
        targets = {"a": loss_of(h), "b": [loss_of(chain(h, WS[3:]))]}
    return tape.gradient(targets, {"x": x, "w": (WS[0], [WS[4]])})


def ragged_source(Tape, x):
    values = tf.reshape(x, [-1])
    ragged = tf.RaggedTensor.from_row_lengths(values, [WIDTH * BATCH // 2, 0, WIDTH * BATCH // 2])
    with Tape() as tape:
        tape.watch(ragged)
        h = tf.reshape(tf.tanh(ragged.values), [BATCH, WIDTH])
        loss = loss_of(chain(h, WS))
    return tape.gradient(loss, ragged)


def target_made_after_the_block(Tape, x):
    with Tape() as tape:
        loss = loss_of(chain(x, WS))
    return tape.gradient(loss * 2.0, WS, unconnected_gradients="zero")  # not recorded: zeros


@tf.function
def _inner_block(h, w):
    return h + tf.tanh(tf.matmul(h, w))


@tf.custom_gradient
def _scaled_tanh(h):
    y = tf.tanh(h)
    return y, lambda dy: dy * (1.0 - y * y) * 0.5  # half the true derivative, on purpose


def control_flow_and_calls(Tape, x):
    """cond, while_loop, a nested tf.function, a custom gradient and tf.recompute_grad (whose
    gradient opens a tape of its own) in the recorded forward pass; two tapes, so cond_v2
    wraps its If for higher-order tape gradients."""
    with Tape(persistent=True) as tape:
        h = chain(x, WS[:1])
        h = tf.cond(tf.reduce_sum(h) > -1e9, lambda: tf.tanh(h) * 2.0, lambda: h)
        _, h = tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, h + tf.tanh(h @ WS[1])),
                             [tf.constant(0), h])
        h = _inner_block(h, WS[2])
        h = _scaled_tanh(h)
        h = tf.recompute_grad(lambda h: chain(h, WS[3:5]))(h)
        loss = loss_of(chain(h, WS[5:]))
    return [tape.gradient(loss, WS), tape.gradient(loss, x, unconnected_gradients="zero")]


@tf.function
def _frozen_encoder(h):
    return chain(h, WS[:2])  # reads two variables: a StatefulPartitionedCall


def call_before_the_with_block(Tape, x):
    """A nested function called before the tape: its output is a constant to the tape, its
    variables get None, and ``x``, which it reads too, gets only the path the tape recorded
    (``tf.gradients`` differentiates a call named in ``stop_gradients`` all the same)."""
    encoded = _frozen_encoder(x)
    with Tape() as tape:
        tape.watch(x)
        loss = loss_of(chain(encoded + x, WS[2:]))
    return tape.gradient(loss, [x, WS])


def gradient_inside_a_cond_branch(Tape, x):
    """The tape and its target outside, the gradient in a branch ("skip the update when the
    loss is not finite")."""
    with Tape() as tape:
        loss = loss_of(chain(x, WS))
    return tf.cond(tf.math.is_finite(loss), lambda: tape.gradient(loss, WS),
                   lambda: [tf.zeros_like(w) for w in WS])


def gradient_inside_a_while_body(Tape, x):
    with Tape(persistent=True) as tape:
        loss = loss_of(chain(x, WS))

    def body(i, total):
        return i + 1, total + tape.gradient(loss, WS[0]) * tf.cast(i + 1, DTYPE)

    return tf.while_loop(lambda i, _: i < 2, body, [tf.constant(0), tf.zeros_like(WS[0])])[1]


def gradient_inside_a_nested_function(Tape, x):
    with Tape() as tape:
        loss = loss_of(chain(x, WS))
    return tf.function(lambda: tape.gradient(loss, WS))()


CASES = [target_made_after_the_block, before_the_with_block, stop_recording, watched_input,
         unwatched_input, watched_leaf, watched_intermediate, watched_after_stop,
         watched_after_a_thread_wide_stop, watch_accessed_variables_off,
         persistent_twice, persistent_inside_its_context, output_gradients, unconnected_zero,
         gradient_penalty, third_order, reset, sparse, nested_structures, ragged_source,
         control_flow_and_calls, call_before_the_with_block, gradient_inside_a_cond_branch,
         gradient_inside_a_while_body, gradient_inside_a_nested_function]


# --------------------------------------------------------------------------------------------
# Running a case
# --------------------------------------------------------------------------------------------

def _run(case, way: str | None, checkpoints: str = "memory", fallback: str = "error",
         jit_compile: bool = False):
    """The case's gradients with TensorFlow's tape (``way`` None) or routed; and the graph."""
    tape_class = tf.GradientTape
    if way == "GradientTape":
        tape_class = functools.partial(mg.GradientTape, checkpoints=checkpoints,
                                       fallback=fallback)
    function = tf.function(lambda x: case(tape_class, x), jit_compile=jit_compile)
    if way == "patch":
        with mg.patch(checkpoints, fallback=fallback):
            concrete = function.get_concrete_function(X)
    elif way == "route_tapes":
        with mg.route_tapes(checkpoints, fallback=fallback):
            concrete = function.get_concrete_function(X)
    else:
        concrete = function.get_concrete_function(X)
    return concrete(X), concrete.graph


def _fallback_for(checkpoints: str) -> str:
    # A budget below what any plan of these small graphs reaches plans at the smallest peak.
    return "warn" if checkpoints.startswith("budget") else "error"


def assert_same_gradients(got, want, rtol=RTOL):
    """Same structure, None where ``want`` has None, the same composite types, values close."""
    tf.nest.assert_same_structure(got, want, expand_composites=False)
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        if w is None:
            assert g is None, f"expected None, got {g!r}"
            continue
        assert g is not None, f"got None where the tape gives {w!r}"
        assert type(g) is type(w), (type(g), type(w))
        if isinstance(w, tf.IndexedSlices):
            g, w = tf.convert_to_tensor(g), tf.convert_to_tensor(w)
        elif isinstance(w, tf.RaggedTensor):
            np.testing.assert_array_equal(g.row_splits, w.row_splits)
            g, w = g.flat_values, w.flat_values
        w = np.asarray(w)
        np.testing.assert_allclose(np.asarray(g), w, rtol=rtol,
                                   atol=rtol * max(1.0, float(np.abs(w).max(initial=0.0))))


def _copies(graph) -> int:
    """Ops the rewrite copied (recomputed), in ``graph`` and the functions it calls."""
    return sum(1 for op in graph.get_operations() if "_memsave" in op.name)


_REFERENCE = {}


def _reference(case):
    if case not in _REFERENCE:
        _REFERENCE[case] = _run(case, None)[0]
    return _REFERENCE[case]


@pytest.mark.parametrize("checkpoints,way", ROUTES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_same_gradients_as_the_tape(case, checkpoints, way, spy):
    got, graph = _run(case, way, checkpoints, _fallback_for(checkpoints))
    assert_same_gradients(got, _reference(case))
    assert spy, "the tape was not routed through memsave_grads.gradients"
    if checkpoints == "speed" and case is not target_made_after_the_block:
        # "speed" keeps the matmuls and recomputes the rest of what the tape recorded
        assert _copies(graph) > 0, "nothing was recomputed"


#: Cases where plain tf.gradients with the tape's stops was not the tape: the gradient taken
#: inside a branch, a loop body or a nested function gave None for the tape's target outside,
#: and a call the tape did not record was differentiated.
_NOT_PLAIN_GRADIENTS = [gradient_inside_a_cond_branch, gradient_inside_a_while_body,
                        gradient_inside_a_nested_function, call_before_the_with_block]


def _computed_by_tensorflow_s_tape(case, checkpoints, spy, messages, said: str):
    got, graph = _run(case, "route_tapes", checkpoints, fallback="warn")
    assert_same_gradients(got, _reference(case))
    assert spy and _copies(graph) == 0
    assert any(said in m and "TensorFlow's own tape" in m for m in messages()), messages()


@pytest.mark.never_worse
@pytest.mark.parametrize("case", _NOT_PLAIN_GRADIENTS, ids=lambda c: c.__name__)
def test_where_the_plan_saves_nothing_tensorflow_s_tape_computes(case, spy, caplog,
                                                                 monkeypatch):
    """On these small graphs the never-worse rule leaves "speed"'s gradient unrewritten:
    TensorFlow's tape computes it, not plain tf.gradients, with the strategy's warning."""
    monkeypatch.setattr(api, "_WARNED_PLAIN", set())  # said once per kind of graph
    caplog.set_level(logging.WARNING)
    _computed_by_tensorflow_s_tape(case, "speed", spy, lambda: caplog.messages,
                                   "saves no memory")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_where_the_strategy_falls_back_tensorflow_s_tape_computes(case, spy, caplog):
    """A name pattern that matches nothing falls back (``fallback="warn"``) on every case:
    TensorFlow's tape computes, and its results come back as the tape gives them (None,
    zeros for unconnected variables, IndexedSlices, composite sources, structures)."""
    caplog.set_level(logging.WARNING)
    _computed_by_tensorflow_s_tape(case, ["no_such_op*"], spy, lambda: caplog.messages,
                                   "falling back to")


@pytest.mark.parametrize("case", ["plain", "gradient_penalty"])
def test_under_xla(case, spy):
    case = {"plain": lambda T, x: _plain(T, x), "gradient_penalty": gradient_penalty}[case]
    want = _run(case, None, jit_compile=True)[0]
    got, graph = _run(case, "patch", "speed", jit_compile=True)
    assert_same_gradients(got, want)
    assert spy and _copies(graph) > 0


def test_a_training_loop_inside_one_function(spy):
    """``for i in tf.range(n)`` around the tape and the update: the tape lives in a while
    loop's body, and reads the variables through that body's captures."""
    def train(route: bool):
        weights = [tf.Variable(w) for w in WS]
        optimizer = tf.keras.optimizers.SGD(0.01)

        @tf.function
        def loop(x):
            loss = tf.constant(0.0, DTYPE)
            for _ in tf.range(3):
                with tf.GradientTape() as tape:
                    loss = loss_of(chain(x, weights))
                grads = tape.gradient(loss, weights)
                optimizer.apply_gradients(zip(grads, weights))
            return loss

        with mg.route_tapes("speed", fallback="error") if route else nullcontext():
            loop.get_concrete_function(X)
        return float(loop(X)), [w.numpy() for w in weights]

    want_loss, want_weights = train(route=False)
    assert not spy
    got_loss, got_weights = train(route=True)
    assert spy
    np.testing.assert_allclose(got_loss, want_loss, rtol=RTOL)
    for got, want in zip(got_weights, want_weights):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * np.abs(want).max())


# --------------------------------------------------------------------------------------------
# Errors are TensorFlow's own
# --------------------------------------------------------------------------------------------

def _error_of(fn):
    try:
        fn()
    except Exception as e:  # pylint: disable=broad-except
        return type(e), str(e)
    return None


def _second_call(Tape, x):
    with Tape() as tape:
        loss = loss_of(chain(x, WS))
    tape.gradient(loss, WS)
    return tape.gradient(loss, WS)


def _none_target(Tape, x):
    with Tape() as tape:
        chain(x, WS)
    return tape.gradient(None, WS)


def _bad_unconnected(Tape, x):
    with Tape() as tape:
        loss = loss_of(chain(x, WS))
    return tape.gradient(loss, WS, unconnected_gradients="nonsense")


@pytest.mark.parametrize("case", [_second_call, _none_target, _bad_unconnected],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("way", WAYS)
def test_errors_are_the_tape_s_own(case, way):
    want = _error_of(lambda: _run(case, None))
    assert want is not None
    got = _error_of(lambda: _run(case, way))
    assert got is not None and issubclass(got[0], want[0]), (got, want)
    assert want[1].splitlines()[-1] in got[1], (got[1], want[1])


# --------------------------------------------------------------------------------------------
# What TensorFlow's tape computes, with one notice per kind
# --------------------------------------------------------------------------------------------

@pytest.fixture
def notices(caplog, monkeypatch):
    monkeypatch.setattr(tape_routing, "_NOTICED", set())
    caplog.set_level(logging.WARNING)
    return lambda: [r.getMessage() for r in caplog.records
                    if "TensorFlow's own tape" in r.getMessage()]


def test_eager_gradient_is_tensorflow_s_with_one_notice(notices):
    with mg.route_tapes("memory"):
        results = [watched_input(tf.GradientTape, X) for _ in range(2)]
    for got in results:
        assert_same_gradients(got, _reference(watched_input))
    assert len(notices()) == 1 and "eagerly" in notices()[0]


def test_jacobian_is_tensorflow_s_with_one_notice(notices, spy):
    def jacobians(Tape, x):
        with Tape(persistent=True) as tape:
            tape.watch(x)
            h = chain(x, WS[:2])
        return [tape.jacobian(h, x), tape.batch_jacobian(h, x)]

    want = _run(jacobians, None)[0]
    got = _run(jacobians, "route_tapes")[0]
    assert_same_gradients(got, want)
    assert not spy
    assert len(notices()) == 2, notices()


def test_a_tape_entered_before_routing_is_tensorflow_s(notices, spy):
    @tf.function
    def late(x):
        with tf.GradientTape() as tape:
            loss = loss_of(chain(x, WS))
        with mg.route_tapes("memory"):
            return tape.gradient(loss, WS)

    assert_same_gradients(late(X), _run(lambda T, x: _plain(T, x), None)[0])
    assert not spy
    assert len(notices()) == 1 and "before routing" in notices()[0]


def test_an_outer_tape_left_to_tensorflow_differentiates_a_routed_inner_gradient(notices, spy):
    """The outer tape was entered before routing began, so TensorFlow's tape computes its
    gradient, through the routed inner gradient: it must have recorded the rewrite's copies
    (``rewrite.record_on_tapes``) and gradient ops."""
    def nested(route: bool):
        @tf.function
        def penalty_gradient(x):
            with tf.GradientTape() as outer:
                outer.watch(x)
                with mg.route_tapes("speed", fallback="error") if route else nullcontext():
                    with tf.GradientTape() as inner:
                        loss = loss_of(chain(x, WS))
                    grads = inner.gradient(loss, WS)
                penalty = tf.add_n([tf.reduce_sum(g * g) for g in grads])
            return outer.gradient(penalty, [x] + WS)
        return penalty_gradient(X), penalty_gradient.get_concrete_function(X).graph

    want, _ = nested(route=False)
    got, graph = nested(route=True)
    assert_same_gradients(got, want)
    assert spy and _copies(graph) > 0
    assert not notices()  # the outer tape's gradient was taken outside any routing


def _plain(Tape, x):
    with Tape() as tape:
        loss = loss_of(chain(x, WS))
    return tape.gradient(loss, WS)


def test_an_untracked_source_read_by_a_recorded_op_is_tensorflow_s(notices):
    def untracked_source(Tape, x):
        a = chain(x, WS[:2])
        with Tape() as tape:
            loss = loss_of(chain(a, WS[2:]))
        return tape.gradient(loss, [a] + WS)

    got = _run(untracked_source, "patch")[0]
    assert_same_gradients(got, _run(untracked_source, None)[0])
    assert len(notices()) == 1 and "does not track" in notices()[0]


@tf.RegisterGradient("MemsaveGradsTestHalfGradient")
def _half_gradient(op, grad):
    return 0.5 * grad * (1.0 - op.outputs[0] * op.outputs[0])


def _overridden_tanh(Tape, x):
    """TF1-style guided backprop: ``tf.gradients`` follows ``gradient_override_map``, the tape
    looks gradient functions up by op type and does not."""
    with Tape() as tape:
        h = chain(x, WS[:3])
        with tf.compat.v1.get_default_graph().gradient_override_map(
                {"Tanh": "MemsaveGradsTestHalfGradient"}):
            h = tf.tanh(h)
        loss = loss_of(chain(h, WS[3:]))
    return tape.gradient(loss, WS)


def test_a_gradient_override_is_tensorflow_s_with_one_notice(notices, spy):
    got = _run(_overridden_tanh, "patch")[0]
    assert_same_gradients(got, _run(_overridden_tanh, None)[0])
    assert not spy
    assert len(notices()) == 1 and "gradient_override_map" in notices()[0], notices()


def test_each_reason_for_tensorflow_s_tape_is_noticed_once(notices):
    def untracked_source(Tape, x):
        a = chain(x, WS[:2])
        with Tape() as tape:
            loss = loss_of(chain(a, WS[2:]))
        return tape.gradient(loss, [a] + WS)

    for case in [untracked_source, _overridden_tanh] * 2:
        _run(case, "route_tapes")
    said = notices()
    assert len(said) == 2, said
    assert "does not track" in said[0] and "gradient_override_map" in said[1], said


def test_a_call_tensorflow_s_tape_refuses_uses_up_no_notice(notices):
    """A call that goes to TensorFlow's tape and raises there (a source that is not a tensor)
    computed nothing: it says nothing, and the one notice of its kind is left for a call that
    does compute (outside review: the notice was said, then TensorFlow's TypeError raised)."""
    def not_a_source(Tape, x):
        with Tape() as tape:
            tape.watch(x)
            loss = loss_of(chain(x, WS))
        return tape.gradient(loss, "not a tensor")

    def integer_source(Tape, x):
        n = tf.constant(3)
        with Tape() as tape:
            tape.watch(x)
            loss = loss_of(chain(x, WS)) * tf.cast(n, x.dtype)
        return tape.gradient(loss, [x, n])

    with pytest.raises(Exception) as refused:
        _run(not_a_source, "route_tapes")
    with pytest.raises(type(refused.value)):
        _run(not_a_source, None)
    assert notices() == []
    _run(integer_source, "route_tapes")
    said = notices()
    assert len(said) == 1 and "neither a floating-point tensor nor a variable" in said[0], said


def test_a_persistent_tape_s_gradient_inside_its_context_warns_as_tensorflow_s(monkeypatch):
    warned = []
    monkeypatch.setattr(tape_record.tf_logging, "log_first_n",
                        lambda level, message, n, *args: warned.append(message))
    _run(persistent_inside_its_context, "route_tapes")
    assert len(warned) == 1 and "persistent tape inside its context" in warned[0], warned


# --------------------------------------------------------------------------------------------
# v1 graphs
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("way", WAYS)
def test_v1_graph_session(way, spy):
    def build(Tape):
        rng = np.random.RandomState(1)
        ws = [tf.Variable(rng.randn(WIDTH, WIDTH) / np.sqrt(WIDTH), dtype=DTYPE)
              for _ in range(DEPTH)]
        x = tf.constant(rng.randn(4, WIDTH), dtype=DTYPE)
        with Tape(persistent=True) as tape:
            tape.watch(x)
            h = chain(x, ws[:3])
            with tape.stop_recording():
                skipped = chain(h, ws[3:4])
            loss = loss_of(chain(h + skipped, ws[4:]))
        return [tape.gradient(loss, [x] + ws), tape.gradient(loss_of(h), ws[:3])]

    def run(routed):
        with tf.Graph().as_default():
            if way == "GradientTape" and routed:
                grads = build(functools.partial(mg.GradientTape, checkpoints="memory",
                                                fallback="error"))
            elif routed:
                context = (mg.patch("memory", fallback="error") if way == "patch"
                           else mg.route_tapes("memory", fallback="error"))
                with context:
                    grads = build(tf.GradientTape)
            else:
                grads = build(tf.GradientTape)
            flat = tf.nest.flatten(grads)
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                values = iter(session.run([g for g in flat if g is not None]))
            return tf.nest.pack_sequence_as(grads, [None if g is None else next(values)
                                                    for g in flat])

    want = run(False)
    got = run(True)
    assert any(g is None for g in tf.nest.flatten(want))  # the stopped block's weight
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        assert (g is None) == (w is None)
        if w is not None:
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * np.abs(w).max())
    assert spy


# --------------------------------------------------------------------------------------------
# The API's own errors
# --------------------------------------------------------------------------------------------

def test_bad_arguments_are_refused_where_given():
    with pytest.raises(mg.UnknownStrategyError, match="checkpoints"):
        mg.GradientTape(checkpoints="fastest")
    with pytest.raises(mg.InvalidArgumentError, match="fallback"):
        mg.route_tapes(fallback="maybe")
    with pytest.raises(mg.InvalidTypeError, match="checkpoints"):
        mg.route_tapes(checkpoints=3)
    with pytest.raises(mg.InvalidTypeError, match="tapes"):
        mg.patch("memory", tapes="yes")
    assert not mg.is_patched() and not tape_routing.is_routing()


@pytest.mark.parametrize("args, remedy", [
    (("memory",), "checkpoints='memory'"), ((False, "speed"), "checkpoints='speed'"),
    ((1,), "persistent=True"), ((False, np.False_), "watch_accessed_variables=False")])
def test_a_flag_that_is_not_a_bool_is_refused(args, remedy):
    """``tf.GradientTape`` takes any ``persistent``: ``GradientTape("memory")`` would make a
    persistent tape of the default strategy, and an int or NumPy bool a tape that TensorFlow's
    C++ side does not keep (a second ``gradient`` raises InternalError). Refused, naming the
    remedy; a bool passes."""
    with pytest.raises(mg.InvalidTypeError, match=r"must be True or False") as raised:
        mg.GradientTape(*args)
    assert remedy in str(raised.value)
    x = tf.constant(2.0)
    with mg.GradientTape(True, False) as tape:
        tape.watch(x)
        y = x * x
    assert float(tape.gradient(y, x)) == 4.0 and float(tape.gradient(y, x)) == 4.0


def test_routing_ends_with_its_block_and_restores_tensorflow_s_methods():
    before = {name: getattr(tf.GradientTape, name) for name in ("gradient", "watch")}
    with mg.route_tapes("memory"):
        with mg.patch("speed"):
            assert tape_routing._innermost().checkpoints == "speed"
        assert tape_routing._innermost().checkpoints == "memory"
        assert tf.GradientTape.gradient is not before["gradient"]
    assert not tape_routing.is_routing()
    assert {name: getattr(tf.GradientTape, name) for name in before} == before


def test_route_tapes_decorates_a_function(spy):
    @tf.function
    @mg.route_tapes("memory", fallback="error")
    def step(x):
        return _plain(tf.GradientTape, x)

    assert_same_gradients(step(X), _run(_plain, None)[0])
    assert spy and not tape_routing.is_routing()


def test_patch_without_tapes_leaves_them_to_tensorflow(spy):
    with mg.patch("memory", tapes=False):
        got = tf.function(lambda x: _plain(tf.GradientTape, x))(X)
    assert_same_gradients(got, _run(_plain, None)[0])
    assert not spy


# --------------------------------------------------------------------------------------------
# Control flow that TensorFlow wraps for higher-order tape gradients
# --------------------------------------------------------------------------------------------

def _conds_inputs(seed):
    rng = np.random.RandomState(seed)
    return (tf.constant(rng.randn(8, 16)), tf.Variable(rng.randn(16, 16) * 0.3),
            tf.constant(True))


def _blocks_in_conds(h, w, flag):
    for _ in range(3):
        h = tf.cond(flag, lambda h=h: h + tf.tanh(h @ w), lambda h=h: h)
    _, h = tf.while_loop(lambda i, h: i < 2, lambda i, h: (i + 1, h + tf.tanh(h @ w)), [0, h])
    return h


def test_control_flow_a_persistent_tape_wraps_is_named_once(monkeypatch, caplog):
    """A persistent tape makes TensorFlow build each cond and loop in a function call of its
    own (``cflow_gradient_wrapper``), which the plan cannot look into: one warning per process
    says so and names the remedy; a non-persistent tape gets none. Gradients as TensorFlow's."""
    monkeypatch.setattr(ordering, "_warned", set())
    caplog.set_level(logging.WARNING, logger="memsave_grads")
    x, w, flag = _conds_inputs(0)

    def gradient(persistent):
        @tf.function
        def step():
            with tf.GradientTape(persistent=persistent) as tape:
                loss = tf.reduce_sum(_blocks_in_conds(x, w, flag) ** 2)
            return tape.gradient(loss, w)
        return step()

    expected = gradient(False)
    with mg.patch("memory"):
        routed = gradient(False)
        assert not [m for m in caplog.messages if "cflow_gradient_wrapper" in m
                    or "wrapped" in m]
        first, second = gradient(True), gradient(True)
    warned = [m for m in caplog.messages if "TensorFlow wrapped" in m]
    assert len(warned) == 1, caplog.messages
    assert "wrapped 4 control-flow op(s)" in warned[0], warned
    assert "memsave_grads.gradients" in warned[0], warned
    # The loop was built while tapes were routed: it reads its variable once (below).
    assert "per iteration" not in warned[0], warned
    for g in (routed, first, second):
        np.testing.assert_allclose(g.numpy(), expected.numpy(), rtol=1e-10)


def test_a_gradient_penalty_s_inner_gradient_by_memsave_grads_is_exact_to_second_order():
    """The remedy the warning names, for nested tapes: the inner gradient by
    ``memsave_grads.gradients`` (it records nothing, so TensorFlow wraps nothing) and the outer
    tape differentiating it; against TensorFlow's nested tapes, conds and a loop included."""
    x, w, flag = _conds_inputs(1)

    def penalty(inner):
        @tf.function
        def step():
            with tf.GradientTape() as outer:
                if inner == "tape":
                    with tf.GradientTape() as tape:
                        tape.watch(x)
                        y = tf.reduce_sum(_blocks_in_conds(x, w, flag) ** 2)
                    gx = tape.gradient(y, x)
                else:
                    y = tf.reduce_sum(_blocks_in_conds(x, w, flag) ** 2)
                    (gx,) = mg.gradients(y, [x], checkpoints="memory")
                p = tf.reduce_sum(gx ** 2)
            return outer.gradient(p, w)
        return step()

    expected = penalty("tape")
    with mg.patch("memory"):
        ours = penalty("memsave_grads")
    np.testing.assert_allclose(ours.numpy(), expected.numpy(), rtol=1e-10)


def _loop_reading_variables(h, w, v):
    _, h = tf.while_loop(lambda i, h: i < 3,
                         lambda i, h: (i + 1, tf.tanh(h @ w) * tf.sigmoid(h @ v) + h), [0, h],
                         maximum_iterations=3)  # XLA's gradient needs the bound
    return h


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_a_loop_a_tape_makes_tensorflow_wrap_reads_its_variables_once_and_exactly(jit_compile):
    """While tapes are routed, a loop TensorFlow builds in a function call for a persistent
    tape or two tapes reads each variable once, before the loop, inside that function (design
    note "tape routing"): the loop's body reads none. Gradients are TensorFlow's unrouted
    tapes' (float64), to second order: a gradient penalty, a persistent tape's gradient of its
    own gradient, nested persistent tapes, two tapes at once."""
    x, w, _ = _conds_inputs(2)
    v = tf.Variable(np.random.RandomState(3).randn(16, 16) * 0.3)

    def loss():
        return tf.reduce_sum(_loop_reading_variables(x, w, v) ** 2)

    def penalty():
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                inner.watch(x)
                y = loss()
            p = tf.reduce_sum(inner.gradient(y, x) ** 2)
        return outer.gradient(p, [w, v])

    def own_second():
        with tf.GradientTape(persistent=True) as tape:
            y = loss()
            s = tf.reduce_sum(tape.gradient(y, w) ** 2)
        return tape.gradient(s, [w, v]) + tape.gradient(y, [v])

    def nested_persistent():
        with tf.GradientTape(persistent=True) as t2:
            with tf.GradientTape(persistent=True) as t1:
                y = loss()
            g = t1.gradient(y, [w, v])
            s = tf.reduce_sum(g[0] * g[1])
        return t2.gradient(s, [w, v])

    def two_tapes():
        with tf.GradientTape() as a, tf.GradientTape() as b:
            y = loss()
        return [a.gradient(y, w), b.gradient(y, v)]

    for program in (penalty, own_second, nested_persistent, two_tapes):
        expected = tf.function(program, jit_compile=jit_compile)()
        with mg.patch("memory"):
            step = tf.function(program, jit_compile=jit_compile)
            ours = step()
        for got, want in zip(ours, expected):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10,
                                       err_msg=program.__name__)
        assert _wrapped_loops_read_no_variable(step.get_concrete_function().graph), \
            program.__name__


def _wrapped_loops_read_no_variable(graph):
    calls = [op for op in graph.get_operations() if function_ops.tape_wrapped(op)]
    return bool(calls) and not any(function_ops.loop_reads_variables(op) for op in calls)


def test_a_persistent_memsave_grads_tape_s_loops_read_once_and_the_builder_comes_back():
    """``memsave_grads.GradientTape`` routes without a patch: while it records, TensorFlow's
    wrapped loops read their variables once too; once every routing and routed tape is done,
    TensorFlow's own builder is back (nothing of ours is left behind)."""
    from tensorflow.python.ops import control_flow_util_v2  # pylint: disable=import-outside-toplevel
    builder = control_flow_util_v2.run_as_function_for_tape_gradients
    x, w, _ = _conds_inputs(4)
    v = tf.Variable(np.random.RandomState(5).randn(16, 16) * 0.3)

    def gradients(tape_class):
        @tf.function
        def step():
            with tape_class(persistent=True) as tape:
                y = tf.reduce_sum(_loop_reading_variables(x, w, v) ** 2)
            return tape.gradient(y, [w, v]) + tape.gradient(y, [w])
        return step, step()

    _, expected = gradients(tf.GradientTape)
    step, ours = gradients(mg.GradientTape)
    for got, want in zip(ours, expected):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10)
    assert _wrapped_loops_read_no_variable(step.get_concrete_function().graph)
    assert control_flow_util_v2.run_as_function_for_tape_gradients is builder
    with mg.patch("memory"):
        assert control_flow_util_v2.run_as_function_for_tape_gradients is not builder
    assert control_flow_util_v2.run_as_function_for_tape_gradients is builder


_PERSISTENT_LSTM_STEP = """
import json, sys
import tensorflow as tf
import memsave_grads as mg
from memsave_grads import measure
steps, batch, units = 100, 16, 128
rng = tf.random.Generator.from_seed(0)
x = rng.normal([steps, batch, units])
kernel = tf.Variable(rng.normal([units, 4 * units]) * 0.05)
recurrent = tf.Variable(rng.normal([units, 4 * units]) * 0.05)
if sys.argv[1] == "patched":
    mg.patch("memory")

def cell(t, h, c):
    i, f, g, o = tf.split(x[t] @ kernel + h @ recurrent, 4, axis=1)
    c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
    return t + 1, tf.sigmoid(o) * tf.tanh(c), c

@tf.function
def step():
    with tf.GradientTape(persistent=True) as tape:
        _, h, _ = tf.while_loop(lambda t, h, c: t < steps, cell,
                                [0, tf.zeros([batch, units]), tf.zeros([batch, units])])
        loss = tf.reduce_sum(h * h)
    grads = tape.gradient(loss, [kernel, recurrent])
    for var, g in zip([kernel, recurrent], grads):
        var.assign_sub(1e-3 * g)
    return loss

step()
peaks = sorted(measure.peak_bytes_of(lambda: step().numpy())[0] for _ in range(3))
print(json.dumps({"peak": peaks[1], "kernel": float(tf.reduce_sum(kernel))}))
"""


def test_a_loop_under_a_persistent_tape_peaks_far_lower_when_routed():
    """TensorFlow's gradient of the wrapped loop stores both kernels (0.5 MiB together) per
    step, 100 steps; read once, the loop stores its activations (about 8 KiB a step). Each a
    fresh process; the weights after two steps as unrouted."""
    plain, patched = (children.run_json(_PERSISTENT_LSTM_STEP, kind)
                      for kind in ("plain", "patched"))
    assert patched["peak"] <= 0.5 * plain["peak"], (plain, patched)
    assert patched["kernel"] == pytest.approx(plain["kernel"], rel=1e-5)


def test_a_wrapped_loop_whose_condition_writes_keeps_its_reads():
    """A condition that writes a variable at each test (``c.assign_add``) changes what the
    body reads: the loop is left as it is (rebuilt, the condition had lost its write, and the
    loop computed zeros). Values and gradients as TensorFlow's, the write's effect included."""
    w = tf.Variable(tf.eye(3, dtype=tf.float64))
    counter = tf.Variable(0.0, dtype=tf.float64)
    x = tf.ones([2, 3], tf.float64)

    def step():
        with tf.GradientTape(persistent=True) as tape:
            def condition(i, h):
                counter.assign_add(1.0)
                return i < 3
            _, h = tf.while_loop(condition, lambda i, h: (i + 1, tf.tanh(h @ w) * counter),
                                 [0, x])
            y = tf.reduce_sum(h)
        return tape.gradient(y, w), y, counter.read_value()

    counter.assign(0.0)
    expected = tf.function(step)()
    with mg.patch("memory"):
        counter.assign(0.0)
        ours = tf.function(step)()
    for got, want in zip(ours, expected):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10)


def test_the_builder_stand_in_never_calls_itself(monkeypatch):
    """Another patcher of TensorFlow's builder that starts inside a routing and ends after it
    puts our stand-in back as it found it: the stand-in then runs TensorFlow's builder (it
    had called itself without end), and a later routing does not take it for TensorFlow's:
    it ends by putting TensorFlow's back."""
    from tensorflow.python.ops import control_flow_util_v2  # pylint: disable=import-outside-toplevel
    from memsave_grads._tf import loops  # pylint: disable=import-outside-toplevel
    builder = control_flow_util_v2.run_as_function_for_tape_gradients
    x, w, _ = _conds_inputs(6)
    v = tf.Variable(np.random.RandomState(7).randn(16, 16) * 0.3)

    def gradient():
        @tf.function
        def step():
            with tf.GradientTape(persistent=True) as tape:
                y = tf.reduce_sum(_loop_reading_variables(x, w, v) ** 2)
            return tape.gradient(y, [w, v])
        return step()

    expected = gradient()
    patched = mg.patch("memory")
    other = control_flow_util_v2.run_as_function_for_tape_gradients  # ours, as another saw it
    mg.unpatch()
    monkeypatch.setattr(control_flow_util_v2, "run_as_function_for_tape_gradients", other)
    assert patched is not None
    for got, want in zip(gradient(), expected):  # the stand-in, with no routing active
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10)
    with mg.patch("memory"):
        for got, want in zip(gradient(), expected):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10)
    # That routing ended by putting TensorFlow's builder back, not the stand-in it found.
    assert control_flow_util_v2.run_as_function_for_tape_gradients is builder
    assert loops._tape_wrapper_builder is None  # pylint: disable=protected-access
