"""Scenarios and runner of the TensorFlow-semantics parity suite (tests/test_tf_semantics.py).

Each scenario mirrors one behaviour that TensorFlow's own gradient tests check
(``gradients_test.py``, ``cond_v2_test.py``, ``while_v2_test.py``, ``custom_gradient_test.py``,
parallel_for's ``gradients_test.py``),
written afresh around a small ``tanh(matmul)`` chain so that every strategy has something to
keep. A scenario builds its forward pass once and returns ``compute``, a function that builds
the gradients through the *public* names (``tf.gradients``, ``tf.compat.v1.gradients``,
``tf.hessians``...). The runner calls ``compute`` once unpatched (the reference) and once
under ``memsave_grads.patch(checkpoints=...)`` per strategy: in a ``tf.Graph``, all in the same
graph, evaluated in one step (stateful ops draw once); in ``tf.function``, one function per
strategy (a traced function cannot be extended later; random ops carry op seeds). It compares
``None``-ness, ``IndexedSlices``-ness, dtype, values (``conftest.assert_grads_close``; float64
at rtol 1e-10) and, where the scenario asks, each gradient op's ``colocation_groups()``. Where
the reference raises, the patched call must raise the same exception type, with TensorFlow's
sentence in its message (design note "TensorFlow's error sentences"). A spy on
``api.gradients`` and ``stitch.backprop`` records whether each call rewrote the graph or fell
back to ``tf.gradients``.

Modes change global TensorFlow state, so each runs in its own process::

    python tests/tf_semantics_cases.py --mode v1 --out results.jsonl   # one mode, JSON lines
    python tests/tf_semantics_cases.py                                 # all modes + counts
    python tests/tf_semantics_cases.py --representative                # the default suite's

Modes: ``tf2`` (a ``tf.Graph`` + Session, and inside ``tf.function``), ``v1``
(``disable_v2_behavior``: reference variables, TF1 control flow) and ``v1_cfv2`` (the same with
``enable_control_flow_v2``; only the scenarios with control flow, see ``Scenario.control_flow``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
import traceback
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.framework import function as framework_function  # noqa: E402
from tensorflow.python.ops import list_ops  # noqa: E402
from tensorflow.python.ops.parallel_for import gradients as pfor_gradients  # noqa: E402

MODES = ("tf2", "v1", "v1_cfv2")
CONTAINERS = ("graph", "function")
#: What each strategy hands to ``patch(checkpoints=...)``. ``"*"`` is a name pattern matching
#: every op of the forward region (select_explicit leaves out only the ops producing xs/ys).
STRATEGIES = {"memory": "memory", "speed": "speed", "every_op": ["*"]}

BATCH, WIDTH = 4, 6
RTOL = {"float32": 1e-5, "float64": 1e-10}

# Fallbacks the suite accepts, by reason (see Scenario).
TF1_CONTROL_FLOW_FALLBACK = "UnsupportedGraphError"
NOTHING_TO_REWRITE_FALLBACK = "NoCheckpointsFoundError"
#: A checkpoint pattern given to patch() that a call has nothing on the path of.
PATTERN_OFF_PATH_FALLBACK = "CheckpointNotOnPathError"


# --------------------------------------------------------------------------------------------
# Scenario registry


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    build: Callable
    #: The TensorFlow test behaviour it mirrors (for the reader; shown in failures).
    mirrors: str
    containers: tuple = CONTAINERS
    modes: tuple = MODES
    #: Builds tf.cond / tf.while_loop: TF1 control flow in mode "v1", where memsave_grads falls
    #: back by design. Mode "v1_cfv2" runs these scenarios alone: without control flow it
    #: builds exactly the graph "v1" builds (function bodies use control flow v2 in both).
    control_flow: bool = False
    #: Nothing lies between xs and ys (xs == ys, xs=[]): falling back or passing through is
    #: the right thing to do there.
    nothing_to_rewrite: bool = False
    #: Compare each returned gradient op's colocation_groups() with the reference's.
    check_colocation: bool = False
    #: Further fallbacks accepted in every mode, each with the reason in ``mirrors``.
    also_allowed_fallbacks: tuple = ()

    def runs(self):
        """(mode, container) pairs this scenario runs in; the function container is TF2 only."""
        return [(mode, container) for mode in self.modes for container in self.containers
                if (container == "graph" or mode == "tf2")
                and (mode != "v1_cfv2" or self.control_flow)]


SCENARIOS: dict[str, Scenario] = {}


def scenario(mirrors: str, **options):
    def register(build):
        SCENARIOS[build.__name__] = Scenario(build.__name__, build, mirrors, **options)
        return build
    return register


def run_id(name: str, mode: str, container: str, strategy: str) -> str:
    return f"{name}-{mode}-{container}-{strategy}"


def planned_runs() -> list[str]:
    return [run_id(s.name, mode, container, strategy)
            for s in SCENARIOS.values() for mode, container in s.runs()
            for strategy in STRATEGIES]


#: Where each (mode, container) starts the strategy rotation of :func:`representative_runs`:
#: a scenario that runs in tf2's graph and function containers and in v1 meets every strategy.
_ROTATION_START = {("tf2", "graph"): 0, ("tf2", "function"): 1, ("v1", "graph"): 2,
                   ("v1_cfv2", "graph"): 1}


def representative_runs() -> list[str]:
    """The default suite's share of the sweep: one strategy per (scenario, mode, container),
    rotated, so that every scenario runs in every mode and container it has, every (mode,
    container) under every strategy, and a scenario of three containers under all three
    strategies (each pair covered, not the product; the whole sweep is marked slow)."""
    strategies = list(STRATEGIES)
    return [run_id(s.name, mode, container,
                   strategies[(index + _ROTATION_START[mode, container]) % len(strategies)])
            for index, s in enumerate(SCENARIOS.values()) for mode, container in s.runs()]


# --------------------------------------------------------------------------------------------
# What scenarios build with


class Env:
    """Builds inputs and weights the way the current mode and container allow."""

    def __init__(self, mode: str, container: str, variables: dict | None = None):
        self.mode = mode
        self.container = container
        #: Variables by name, kept across the traces of one scenario in the function container:
        #: tf.function refuses a variable created by any trace but the first.
        self.variables = {} if variables is None else variables

    @staticmethod
    def values(shape, seed, dtype=tf.float32):
        rng = np.random.RandomState(seed)
        scale = np.sqrt(shape[0]) if len(shape) > 1 else 1.0
        return (rng.randn(*shape) / scale).astype(dtype.as_numpy_dtype)

    def constant(self, shape, seed, dtype=tf.float32, name=None):
        return tf.constant(self.values(shape, seed, dtype), name=name)

    def variable(self, shape, seed, name, kind="resource", dtype=tf.float32):
        """``kind``: "resource" or "ref" (a v1 reference variable, graph container only)."""
        init = self.values(shape, seed, dtype)
        use_resource = {"resource": True, "ref": False}[kind]
        if self.container == "function":
            # As Keras does: the variable lives outside the traced function, which captures it.
            if name not in self.variables:
                with tf.init_scope():
                    self.variables[name] = tf.Variable(init, name=name)
            return self.variables[name]
        return tf.compat.v1.Variable(init, name=name, use_resource=use_resource)

    def chain(self, h, layers, seed, name, dtype=tf.float32, weights=None):
        """``layers`` x ``tanh(h @ w)``; returns the output and the weights (constants unless
        given)."""
        if weights is None:
            weights = [self.constant((WIDTH, WIDTH), seed + i, dtype, name=f"{name}_w{i}")
                       for i in range(layers)]
        for i, w in enumerate(weights):
            h = tf.tanh(tf.matmul(h, w), name=f"{name}_{i}")
        return h, list(weights)

    def input(self, seed=1, dtype=tf.float32, name="x", batch=BATCH):
        return self.constant((batch, WIDTH), seed, dtype, name=name)


def _loss(h):
    return tf.reduce_sum(h * h)


_REGISTERED_GRADIENTS: set[str] = set()


def _scaled_tanh_gradient_name() -> str:
    """A registered gradient (three times tanh's own), for gradient_override_map scenarios;
    registered on first use, once per process (RegisterGradient refuses a second time)."""
    name = "MemsaveParityTripledTanh"
    if name not in _REGISTERED_GRADIENTS:
        @tf.RegisterGradient(name)
        def _tripled_tanh_grad(op, grad):
            return 3.0 * grad * (1.0 - op.outputs[0] * op.outputs[0])
        del _tripled_tanh_grad
        _REGISTERED_GRADIENTS.add(name)
    return name


# --------------------------------------------------------------------------------------------
# Scenarios: gradients_test.py


@scenario("GradientsTest multiple ys summed into one gradient")
def multiple_ys(env):
    x = env.input()
    h, ws = env.chain(x, 3, 10, "trunk")
    y1 = tf.reduce_sum(tf.tanh(tf.matmul(h, env.constant((WIDTH, WIDTH), 20))))
    y2 = tf.reduce_mean(h * h)
    return lambda: tf.gradients([y1, y2], [x] + ws)


@scenario("GradientsTest.testDependentYs: a y computed from another y")
def dependent_ys(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "first")
    h2, ws2 = env.chain(h, 2, 20, "second")
    return lambda: tf.gradients([h, _loss(h2)], [x] + ws + ws2)


@scenario("gradients with grad_ys given (one None among them)")
def grad_ys_given(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "first")
    h2, _ = env.chain(h, 2, 20, "second")
    gy = env.constant((BATCH, WIDTH), 30, name="grad_y")
    return lambda: tf.gradients([h2, _loss(h)], [x] + ws, grad_ys=[gy, None])


@scenario("GradientsTest.testSingletonIndexedSlices: grad_ys given as IndexedSlices")
def grad_ys_indexed_slices(env):
    x = env.input()
    h, ws = env.chain(x, 3, 10, "trunk")
    gy = tf.IndexedSlices(env.constant((2, WIDTH), 30), tf.constant([0, 2]),
                          tf.constant([BATCH, WIDTH]))
    return lambda: tf.gradients(h, [x] + ws, grad_ys=gy)


@scenario("testUnconnectedGradientsNoneUnconnectedGradients: None for unconnected xs")
def unconnected_none(env):
    x = env.input()
    other = env.input(seed=2, name="other")
    h, ws = env.chain(x, 3, 10, "trunk")
    spare = env.constant((WIDTH, WIDTH), 40, name="spare")
    return lambda: tf.gradients(_loss(h), [x, other, spare] + ws)


@scenario("testUnconnectedGradientsZerosUnconnectedGradients and testVariableDefaultGrad")
def unconnected_zero(env):
    x = env.input()
    other = env.input(seed=2, name="other")
    h, ws = env.chain(x, 3, 10, "trunk")
    unused_var = env.variable((3, 2), 41, "unused_var", kind="resource", dtype=tf.float64)
    return lambda: tf.gradients(_loss(h), [x, other, unused_var] + ws,
                                unconnected_gradients="zero")


@scenario("testPartialDerivatives: stop_gradients= on xs themselves")
def stop_gradients_on_xs(env):
    x = env.input()
    a, _ = env.chain(x, 2, 10, "a")
    b, _ = env.chain(2.0 * a, 2, 20, "b")
    z = _loss(a + b)
    return lambda: (tf.gradients(z, [x, a]) + tf.gradients(z, [x, a], stop_gradients=[x, a]))


@scenario("testStopGradients: the stop_gradients kwarg on interior tensors, and xs/stops mixed")
def stop_gradients_kwarg(env):
    x = env.input()
    a, _ = env.chain(x, 1, 10, "a")
    b, _ = env.chain(a, 1, 20, "b")
    c, _ = env.chain(a + b, 1, 30, "c")
    d, _ = env.chain(b * c, 1, 40, "d")
    loss = _loss(d)
    named = dict(x=x, a=a, b=b, c=c)
    calls = [("", "xa"), ("b", "x"), ("a", "xbc"), ("bc", "ab")]

    def compute():
        out = []
        for stops, sources in calls:
            out += tf.gradients(loss, [named[s] for s in sources],
                                stop_gradients=[named[s] for s in stops] or None)
        return out
    return compute


@scenario("StopGradientTest / testStopGradients: tf.stop_gradient ops in the forward pass")
def stop_gradient_op(env):
    x = env.input()
    a, ws = env.chain(x, 2, 10, "a")
    frozen = tf.stop_gradient(a)
    b, ws2 = env.chain(a, 2, 20, "b")
    c = tf.stop_gradient(b) * 0.5 + b * frozen
    return lambda: tf.gradients(_loss(c), [x, a] + ws + ws2)


@scenario("testStopGradient: a y that is a stop_gradient of an x gives None")
def stop_gradient_only_path(env):
    x = env.input()
    h, ws = env.chain(x, 3, 10, "trunk")
    other = env.input(seed=3, name="other")
    y = _loss(h) + tf.reduce_sum(tf.stop_gradient(other))
    return lambda: tf.gradients(y, [x, other] + ws)


@scenario("testBoundaryContinue: intermediate xs (an x computed from another x)")
def intermediate_xs(env):
    x = env.input()
    h1, _ = env.chain(x, 2, 10, "first")
    h2, ws2 = env.chain(h1, 2, 20, "second")
    h3, _ = env.chain(h2, 2, 30, "third")
    return lambda: tf.gradients(_loss(h3), [x, h1, h2] + ws2)


@scenario("testBoundaryStop: an x that is also a y")
def xs_include_a_y(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "first")
    h2, _ = env.chain(h, 2, 20, "second")
    return lambda: tf.gradients([_loss(h2), h], [h, x] + ws)


@scenario("gradients(x, x): xs == ys, nothing between them", nothing_to_rewrite=True)
def xs_equal_ys(env):
    x = env.input()
    h, _ = env.chain(x, 2, 10, "trunk")
    return lambda: tf.gradients(h, h) + tf.gradients([x, h], [x, h])


@scenario("xs=[]: tf.gradients returns []", nothing_to_rewrite=True)
def empty_xs(env):
    x = env.input()
    h, _ = env.chain(x, 2, 10, "trunk")
    return lambda: tf.gradients(_loss(h), [])


@scenario("integer tensors on the path and among xs (no gradient through them)")
def integer_on_path(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "trunk")
    as_int = tf.cast(h * 10.0, tf.int32)
    back = tf.cast(as_int, tf.float32)
    h2, _ = env.chain(h + back, 2, 20, "after")
    counts = tf.constant([1, 2, 3])
    y = _loss(h2) + tf.reduce_sum(tf.cast(counts * 2, tf.float32))
    return lambda: tf.gradients(y, [x, counts, as_int] + ws)


@scenario("embedding/gather: IndexedSlices gradients w.r.t. the table")
def gather_indexed_slices(env):
    table = env.constant((10, WIDTH), 50, name="table")
    rows = tf.gather(table, tf.constant([1, 3, 3, 7]))
    h, ws = env.chain(rows, 3, 10, "trunk")
    return lambda: tf.gradients(_loss(h), [table] + ws)


@scenario("one table gathered twice: IndexedSlices partials aggregated (stay sparse)")
def gather_twice(env):
    table = env.constant((10, WIDTH), 50, name="table")
    first = tf.gather(table, tf.constant([1, 3, 5, 7]))
    second = tf.nn.embedding_lookup(table, tf.constant([2, 3, 3, 9]))
    h, ws = env.chain(first, 2, 10, "a")
    h2, ws2 = env.chain(second + h, 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [table] + ws + ws2)


@scenario("dense and sparse partials of one tensor (densified as tf.gradients does)")
def dense_sparse_mix(env):
    table = env.constant((WIDTH, WIDTH), 50, name="table")
    rows = tf.gather(table, tf.constant([0, 2, 2, 5]))
    h, ws = env.chain(rows, 2, 10, "a")
    h2 = tf.tanh(tf.matmul(h, table))  # the same table used densely
    h3, _ = env.chain(h2, 2, 20, "b")
    return lambda: tf.gradients(_loss(h3), [table] + ws)


def _aggregation_scenario(method):
    def build(env):
        x = env.input()
        h, ws = env.chain(x, 2, 10, "trunk")
        y = h * 2.0
        z = y + y + y + y + y + y + y + y + y + y
        h2, _ = env.chain(z, 2, 20, "after")
        return lambda: tf.gradients(_loss(h2) + tf.reduce_sum(y), [x, y] + ws,
                                    aggregation_method=method)
    return build


for _method_name, _method in [("add_n", tf.AggregationMethod.ADD_N),
                              ("tree", tf.AggregationMethod.EXPERIMENTAL_TREE),
                              ("accumulate_n", tf.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N)]:
    _build = _aggregation_scenario(_method)
    _build.__name__ = f"aggregation_{_method_name}"
    scenario(f"testAggregationMethod{_method_name}: aggregation_method={_method}")(_build)


@scenario("gate_gradients=True (tuple of the gradients of a multi-input op)")
def gate_gradients(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    h2, ws2 = env.chain(h, 2, 20, "b")
    both = tf.concat([h, h2], axis=1)
    y = tf.reduce_sum(tf.tanh(tf.matmul(both, env.constant((2 * WIDTH, WIDTH), 30))))
    return lambda: tf.gradients(y, [x] + ws + ws2, gate_gradients=True)


@scenario("the name= kwarg (gradient ops under a custom scope)")
def name_kwarg(env):
    x = env.input()
    h, ws = env.chain(x, 3, 10, "trunk")
    return lambda: tf.gradients(_loss(h), [x] + ws, name="custom_scope")


@scenario("GradientsTest.testUnusedOutput: split/unstack outputs partly unused")
def unused_outputs(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    left, _ = tf.split(h, 2, axis=1)
    rows = tf.unstack(h, axis=0)
    top_values, _ = tf.math.top_k(h, k=2)
    mixed = tf.concat([left, left * 2.0], axis=1) + rows[1] + tf.reduce_sum(top_values)
    h2, _ = env.chain(mixed, 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x] + ws)


@scenario("the same weight read by every layer (partials of one x summed)")
def shared_weight(env):
    x = env.input()
    w = env.constant((WIDTH, WIDTH), 10, name="shared")
    h, _ = env.chain(x, 4, 0, "trunk", weights=[w] * 5)
    return lambda: tf.gradients(_loss(h), [x, w])


@scenario("float64 end to end (rtol 1e-10)")
def float64_chain(env):
    x = env.input(dtype=tf.float64)
    h, ws = env.chain(x, 4, 10, "trunk", dtype=tf.float64)
    return lambda: tf.gradients(tf.reduce_sum(tf.sin(h)), [x] + ws)


@scenario("a stateful random op (dropout) in the forward pass")
def dropout_stateful(env):
    x = env.input()
    h = x
    ws = []
    for i in range(4):
        w = env.constant((WIDTH, WIDTH), 10 + i, name=f"w{i}")
        ws.append(w)
        # Op seeds: the function container draws again in each strategy's own function.
        h = tf.nn.dropout(tf.tanh(tf.matmul(h, w)), rate=0.3, seed=100 + i)
    return lambda: tf.gradients(_loss(h), [x] + ws)


@scenario("PreventGradientTest: LookupError raised as tf.gradients raises it")
def prevent_gradient(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    blocked = tf.raw_ops.PreventGradient(input=h, message="parity")
    h2, _ = env.chain(blocked, 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x] + ws)


@scenario("OnlyRealGradientsTest: complex ys without grad_ys raise TypeError")
def complex_without_grad_ys(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    y = tf.square(tf.complex(h, h * 0.5))
    return lambda: tf.gradients(y, [x] + ws)


@scenario("a complex path with grad_ys given")
def complex_with_grad_ys(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    z = tf.square(tf.complex(h, h * 0.5))
    y = tf.math.real(z) + tf.math.imag(z)
    h2, _ = env.chain(y, 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x] + ws)


# --- colocation (testColocateGradients*) ----------------------------------------------------


@scenario("testColocateGradients: colocate_gradients_with_ops=True on a device-placed chain",
          check_colocation=True)
def colocate_chain(env):
    x = env.input()
    with tf.device("/device:CPU:0"):
        h, ws = env.chain(x, 3, 10, "trunk")
    return lambda: tf.compat.v1.gradients(_loss(h), [x] + ws, colocate_gradients_with_ops=True)


@scenario("testColocateGradientsWithAggregation: a weight read by two ops, colocated",
          check_colocation=True)
def colocate_aggregation(env):
    x = env.input()
    w = env.constant((WIDTH, WIDTH), 5, name="w")
    a, _ = env.chain(x, 2, 10, "a")
    b, _ = env.chain(x, 2, 20, "b")
    wa = tf.matmul(a, w)
    wb = tf.matmul(b, w)
    with tf.device("/device:CPU:0"):
        z = tf.tanh(wa + wb)
    h, ws = env.chain(z, 2, 30, "after")
    return lambda: tf.compat.v1.gradients(_loss(h), [w, x] + ws,
                                          colocate_gradients_with_ops=True)


@scenario("colocate_gradients_with_ops=True with an IndexedSlices gradient",
          check_colocation=True)
def colocate_sparse(env):
    table = env.constant((10, WIDTH), 50, name="table")
    rows = tf.gather(table, tf.constant([1, 3, 3, 7]))
    h, ws = env.chain(rows, 3, 10, "trunk")
    return lambda: tf.compat.v1.gradients(_loss(h), [table] + ws,
                                          colocate_gradients_with_ops=True)


@scenario("colocate_gradients_with_ops=True through a cond and a while loop",
          check_colocation=True, control_flow=True)
def colocate_control_flow(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    w = env.constant((WIDTH, WIDTH), 30, name="loop_w")
    pred = tf.compat.v1.placeholder_with_default(True, [])
    h = tf.cond(pred, lambda: tf.tanh(tf.matmul(h, w)), lambda: h * 2.0)
    _, h = tf.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, tf.tanh(tf.matmul(a, w))),
                         [tf.constant(0), h])
    h2, _ = env.chain(h, 2, 20, "b")
    return lambda: tf.compat.v1.gradients(_loss(h2), [x, w] + ws,
                                          colocate_gradients_with_ops=True)


# --- variables --------------------------------------------------------------------------------


@scenario("resource variables as xs (ResourceCondTest, testCapturedResourceVariable)")
def resource_variables(env):
    x = env.input()
    ws = [env.variable((WIDTH, WIDTH), 10 + i, f"rv{i}", kind="resource") for i in range(4)]
    h, _ = env.chain(x, 0, 0, "trunk", weights=ws)
    return lambda: tf.gradients(_loss(h), [x] + ws)


@scenario("reference variables as xs (testVariableRefGradient)", containers=("graph",))
def reference_variables(env):
    x = env.input()
    ws = [env.variable((WIDTH, WIDTH), 10 + i, f"refv{i}", kind="ref") for i in range(4)]
    h, _ = env.chain(x, 0, 0, "trunk", weights=ws)
    return lambda: tf.gradients(_loss(h), [x] + ws)


@scenario("testVariableReadValueGradient: a variable's read_value() among ys")
def variable_read_value(env):
    x = env.input()
    v = env.variable((WIDTH, WIDTH), 10, "rv", kind="resource")
    h, ws = env.chain(x, 2, 20, "trunk")
    h2 = tf.tanh(tf.matmul(h, v.read_value()))
    return lambda: tf.gradients([_loss(h2), v.read_value()], [v, x] + ws)


# --- custom gradients -------------------------------------------------------------------------


@scenario("CustomGradientTest.testCustomGradient: a tf.custom_gradient function in the chain")
def custom_gradient_fn(env):
    @tf.custom_gradient
    def scaled_multiply(a, b):
        def grad(dy):  # deliberately not the true gradient: it must be the one used
            return 3.0 * dy * b, 0.5 * dy * a
        return a * b, grad

    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    m = scaled_multiply(h, tf.sin(h))
    h2, ws2 = env.chain(m, 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x] + ws + ws2)


@scenario("testCustomGradientTrivial: custom gradient of an identity, applied twice")
def custom_gradient_identity(env):
    @tf.custom_gradient
    def tripled_identity(a):
        return tf.identity(a), lambda dy: 3.0 * dy

    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    h2, _ = env.chain(tripled_identity(tripled_identity(h)), 3, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x] + ws)


@scenario("testCustomGradientWithVariables: a custom gradient returning variable gradients")
def custom_gradient_variables(env):
    v = env.variable((WIDTH, WIDTH), 60, "cg_var", kind="resource")

    @tf.custom_gradient
    def layer(a):
        out = tf.tanh(tf.matmul(a, v))

        def grad(dy, variables=None):
            inner = dy * (1.0 - out * out)
            return tf.matmul(inner, v, transpose_b=True), [tf.ones_like(v) * tf.reduce_sum(dy)]
        return out, grad

    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    h2, _ = env.chain(layer(h), 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x, v] + ws)


@scenario("testRecursiveCustomGradient: a custom gradient whose grad calls tf.gradients")
def custom_gradient_calls_gradients(env):
    @tf.custom_gradient
    def block(a):
        out = tf.tanh(tf.matmul(a, tf.ones((WIDTH, WIDTH)) * 0.2))

        def grad(dy):
            return 2.0 * tf.gradients(out, a, grad_ys=dy)[0]
        return out, grad

    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    h2, _ = env.chain(block(h), 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x] + ws)


@scenario("VariablesGradientTest: tf.recompute_grad in the forward pass")
def recompute_grad_block(env):
    w = env.constant((WIDTH, WIDTH), 70, name="rg_w")
    block = tf.recompute_grad(lambda a: tf.tanh(tf.matmul(a, w)) * 2.0)
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    h2, _ = env.chain(block(h), 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x] + ws)


@scenario("GradPassThroughTest: tf.grad_pass_through around a non-differentiable op")
def grad_pass_through(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    rounded = tf.grad_pass_through(tf.round)(h * 4.0)
    h2, _ = env.chain(rounded * 0.25, 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x] + ws)


@scenario("RegisterGradient + gradient_override_map on forward ops")
def gradient_override_map(env):
    name = _scaled_tanh_gradient_name()
    graph = tf.compat.v1.get_default_graph()
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    with graph.gradient_override_map({"Tanh": name}):
        h, ws2 = env.chain(h, 2, 20, "overridden")
    h, _ = env.chain(h, 2, 30, "b")
    return lambda: tf.gradients(_loss(h), [x] + ws + ws2)


@scenario("FunctionGradientsTest: a Defun with python_grad_func in the forward pass",
          containers=("graph",))
def defun_python_grad_func(env):
    def tripled_grad(op, grad):
        return 3.0 * grad * tf.cos(op.inputs[0])

    def sine(a):
        return tf.sin(a)

    sin_fn = framework_function.Defun(tf.float32, python_grad_func=tripled_grad)(sine)
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    s = sin_fn(h)
    s.set_shape(h.shape)
    h2, _ = env.chain(s, 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x] + ws)


# --- functions: calls in the forward pass, captured xs --------------------------------------


@scenario("a nested tf.function called in the forward pass (a call op)")
def nested_function_call(env):
    @tf.function
    def block(a, w):
        return tf.tanh(tf.matmul(a, w)) + 0.5 * a

    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    extra = [env.constant((WIDTH, WIDTH), 30 + i, name=f"fw{i}") for i in range(2)]
    for w in extra:
        h = block(h, w)
    h2, _ = env.chain(h, 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x] + ws + extra)


@scenario("a tf.function(jit_compile=True) called in the forward pass")
def jit_compile_call(env):
    @tf.function(jit_compile=True)
    def block(a, w):
        return tf.tanh(tf.matmul(a, w))

    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    w = env.constant((WIDTH, WIDTH), 30, name="jw")
    h2, _ = env.chain(block(h, w), 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x, w] + ws)


@scenario("testGradientWrtCaptured: gradients in a tf.function w.r.t. outer-graph tensors",
          containers=("graph",))
def captured_outer_xs(env):
    x = env.input()
    ws = [env.constant((WIDTH, WIDTH), 10 + i, name=f"outer_w{i}") for i in range(4)]

    def compute():
        @tf.function
        def inner():
            h, _ = env.chain(x, 0, 0, "inner", weights=ws)
            return tf.gradients(_loss(h), [x] + ws)
        return inner()
    return compute


@scenario("testCapturedNested: a function inside a function, xs from the outermost graph",
          containers=("graph",))
def captured_nested(env):
    x1 = env.input(name="x1")
    x2 = env.input(seed=2, name="x2")
    x3 = x1 * x2

    def compute():
        @tf.function
        def outer():
            o1 = tf.identity(x1)

            @tf.function
            def inner():
                h, _ = env.chain(o1 + x2 * x3, 3, 10, "inner")
                return tf.gradients([_loss(h), tf.identity(x3), x1], [x1, x2])
            return inner()
        return outer()
    return compute


@scenario("testCapturedFromFunction: xs computed in an enclosing function",
          containers=("graph",))
def captured_from_function(env):
    x = env.input()

    def compute():
        @tf.function
        def outer():
            y, _ = env.chain(x, 2, 10, "outer")

            @tf.function
            def inner():
                h, _ = env.chain(y, 2, 20, "inner")
                return tf.gradients(_loss(h), [y])
            return inner()
        return outer()
    return compute


@scenario("testCapturedEagerTensors: an eager tensor captured by tf.function as an x",
          containers=("function",), modes=("tf2",))
def eager_tensor_as_x(env):
    with tf.init_scope():
        x = tf.constant(Env.values((BATCH, WIDTH), 1))
    h, ws = env.chain(x, 3, 10, "trunk")
    return lambda: tf.gradients(_loss(h), [x] + ws)


@scenario("cond_v2_test.testGradientFromInsideDefun: gradients inside a tf.function of a "
          "cond built outside", containers=("graph",), control_flow=True)
def cond_gradient_inside_function(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    pred = tf.compat.v1.placeholder_with_default(False, [])
    out = tf.cond(pred, lambda: h * 2.0, lambda: tf.tanh(tf.matmul(h, ws[0])))
    y, _ = env.chain(out, 2, 20, "b")

    def compute():
        @tf.function
        def inner():
            h2, ws2 = env.chain(y, 2, 30, "inner")
            return tf.gradients(_loss(h2), [x, y] + ws + ws2)
        return inner()
    return compute


# --- cond_v2 ----------------------------------------------------------------------------------


@scenario("cond_v2_test.testBasic: gradients w.r.t. tensors captured by both branches",
          control_flow=True)
def cond_captured(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    other = env.input(seed=2, name="other")
    pred = tf.compat.v1.placeholder_with_default(True, [])
    out = tf.cond(pred, lambda: tf.tanh(tf.matmul(h, ws[0])) * other,
                  lambda: h * 3.0)
    h2, ws2 = env.chain(out, 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x, other] + ws + ws2)


@scenario("cond_v2_test.testMultipleOutputs/testBasic2: several outputs, one unused, one "
          "constant branch", control_flow=True)
def cond_multiple_outputs(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    pred = tf.compat.v1.placeholder_with_default(False, [])
    first, unused, _ = tf.cond(
        pred, lambda: (h * 2.0, tf.sin(h), tf.constant(1.0)),
        lambda: (tf.tanh(h), h * h, tf.reduce_sum(h)))
    del unused
    h2, _ = env.chain(first, 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x] + ws)


@scenario("cond_v2_test.testNestedCond/testDoubleNestedCond", control_flow=True)
def cond_nested(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    outer_pred = tf.compat.v1.placeholder_with_default(False, [])
    inner_pred = tf.compat.v1.placeholder_with_default(True, [])

    def false_fn():
        return tf.cond(inner_pred, lambda: tf.tanh(tf.matmul(h, ws[1])) * 2.0,
                       lambda: h * 5.0)
    out = tf.cond(outer_pred, lambda: h * 0.0 + 2.0, false_fn)
    h2, _ = env.chain(out, 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x] + ws)


@scenario("a gather inside a cond branch (IndexedSlices through cond)", control_flow=True)
def cond_gather(env):
    table = env.constant((10, WIDTH), 50, name="table")
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    pred = tf.compat.v1.placeholder_with_default(True, [])
    out = tf.cond(pred, lambda: tf.gather(table, [1, 2, 2, 4]) * h, lambda: h)
    h2, _ = env.chain(out, 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [table, x] + ws)


@scenario("cond_v2_test.testSecondDerivative: gradients of gradients through a cond",
          control_flow=True)
def cond_second_order(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    pred = tf.compat.v1.placeholder_with_default(True, [])
    out = tf.cond(pred, lambda: tf.pow(h, 3), lambda: h)
    y = _loss(out)

    def compute():
        first = tf.gradients(y, [x])
        return first + tf.gradients(tf.reduce_sum(first[0] * first[0]), [x] + ws)
    return compute


# --- while_v2 ---------------------------------------------------------------------------------


@scenario("while_v2_test gradients w.r.t. loop inputs and tensors captured by the body",
          control_flow=True)
def while_captured(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    w = env.constant((WIDTH, WIDTH), 30, name="loop_w")
    _, out = tf.while_loop(lambda i, a: i < 3,
                           lambda i, a: (i + 1, tf.tanh(tf.matmul(a, w))), [tf.constant(0), h])
    h2, _ = env.chain(out, 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x, w] + ws)


@scenario("while_v2_test.testNestedWhileLoops", control_flow=True)
def while_nested(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    w = env.constant((WIDTH, WIDTH), 30, name="loop_w")

    def outer_body(i, a):
        _, inner = tf.while_loop(lambda j, b: j < 2,
                                 lambda j, b: (j + 1, tf.tanh(tf.matmul(b, w)) + 0.5 * b),
                                 [tf.constant(0), a])
        return i + 1, inner
    _, out = tf.while_loop(lambda i, a: i < 2, outer_body, [tf.constant(0), h])
    h2, _ = env.chain(out, 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x, w] + ws)


@scenario("a while loop inside a cond branch and a cond inside a loop body",
          control_flow=True)
def while_and_cond_nested(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    w = env.constant((WIDTH, WIDTH), 30, name="loop_w")
    pred = tf.compat.v1.placeholder_with_default(True, [])

    def loop(a):
        def body(i, b):
            b = tf.cond(i > 0, lambda: tf.tanh(tf.matmul(b, w)), lambda: b * 2.0)
            return i + 1, b
        return tf.while_loop(lambda i, b: i < 3, body, [tf.constant(0), a])[1]
    out = tf.cond(pred, lambda: loop(h), lambda: h)
    h2, _ = env.chain(out, 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x, w] + ws)


@scenario("testNonDifferentiableSwitchInWhileLoop: only an integer path through a loop",
          control_flow=True)
def while_integer_path(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    v = tf.compat.v1.placeholder_with_default(2.5, [])

    def body(i, acc, ta):
        acc += tf.cast(v, tf.int32)
        return i + 1, acc, ta.write(i, acc)
    i, _, ta = tf.while_loop(lambda i, *_: i < 4, body,
                             [tf.constant(0), tf.constant(0), tf.TensorArray(tf.int32, size=4)])
    target = tf.cast(ta.read(i - 1), tf.float32)
    return lambda: tf.gradients(_loss(h) + target, [x, v] + ws)


@scenario("a TensorArray written in a loop, stacked and differentiated", control_flow=True)
def while_tensor_array(env):
    x = env.input()
    h, ws = env.chain(x, 2, 10, "a")
    w = env.constant((WIDTH, WIDTH), 30, name="loop_w")

    def body(i, a, ta):
        a = tf.tanh(tf.matmul(a, w))
        return i + 1, a, ta.write(i, a)
    _, _, ta = tf.while_loop(lambda i, *_: i < 3, body,
                             [tf.constant(0), h, tf.TensorArray(tf.float32, size=3)])
    stacked = tf.reduce_sum(ta.stack(), axis=0)
    h2, _ = env.chain(stacked, 2, 20, "b")
    return lambda: tf.gradients(_loss(h2), [x, w] + ws)


@scenario("TensorListGradientsTest.testDefaultGradYs: a TensorList y with TensorList grad_ys")
def tensor_list_grad_ys(env):
    x = env.input()
    h, ws = env.chain(x, 3, 10, "a")
    shape = tf.constant([BATCH, WIDTH])
    tl = list_ops.tensor_list_push_back(
        list_ops.empty_tensor_list(element_dtype=tf.float32, element_shape=shape), h)
    grad_tl = list_ops.tensor_list_push_back(
        list_ops.empty_tensor_list(element_dtype=tf.float32, element_shape=shape),
        env.constant((BATCH, WIDTH), 40))
    return lambda: tf.gradients(tl, [x] + ws, grad_ys=grad_tl)


# --- parallel_for: jacobian and batch_jacobian ----------------------------------------------
# pfor vectorizes the gradient graph, copies of forward ops included: a copied While's TensorList
# outputs need their handle data (element dtype and shape) there, as the originals have it.


@scenario("parallel_for gradients_test (test_jacobian_fixed_shape, test_fc_jacobian): pfor "
          "jacobian of a chain w.r.t. its input and a weight")
def pfor_jacobian_of_chain(env):
    x = env.input()
    h, ws = env.chain(x, 3, 10, "trunk")
    return lambda: pfor_gradients.jacobian(h, [x, ws[0]])


@scenario("parallel_for gradients_test.test_jacobian_scan_shape: pfor jacobian of a tf.scan's "
          "states (the gradient of a recomputed While is vectorized)", control_flow=True)
def pfor_jacobian_of_scan(env):
    x = env.input(batch=2)
    h, ws = env.chain(x, 2, 10, "a")
    w = env.constant((WIDTH, WIDTH), 30, name="scan_w")
    offsets = env.constant((3,), 20, name="offsets")
    states = tf.scan(lambda a, e: tf.tanh(tf.matmul(a, w) + e), offsets, initializer=h)
    y = tf.tanh(states * 1.5)
    return lambda: pfor_gradients.jacobian(y, [x, w, ws[0]])


@scenario("parallel_for gradients_test.test_dynamic_lstm_batch_jacobian: pfor batch_jacobian "
          "of an LSTM's final state, stepped by a while loop with per-example sequence lengths",
          control_flow=True)
def pfor_batch_jacobian_of_lstm_loop(env):
    x = env.input()
    h, _ = env.chain(x, 2, 10, "a")
    sequence = tf.stack([h, tf.sin(h), h * h], axis=1)  # [batch, time, width]
    lengths = tf.constant([3, 1, 2, 0][:BATCH])
    kernel = env.constant((2 * WIDTH, 4 * WIDTH), 40, name="lstm_kernel")

    def step(t, cell, out):
        gates = tf.matmul(tf.concat([tf.gather(sequence, t, axis=1), out], axis=1), kernel)
        i, f, o, g = tf.split(gates, 4, axis=1)
        new_cell = tf.sigmoid(f + 1.0) * cell + tf.sigmoid(i) * tf.tanh(g)
        new_out = tf.sigmoid(o) * tf.tanh(new_cell)
        running = (t < lengths)[:, None]  # finished sequences keep their state
        return t + 1, tf.where(running, new_cell, cell), tf.where(running, new_out, out)

    zeros = tf.zeros([BATCH, WIDTH])
    _, cell, _ = tf.while_loop(lambda t, *_: t < 3, step, [tf.constant(0), zeros, zeros])
    y, _ = env.chain(cell, 1, 50, "b")
    return lambda: [pfor_gradients.batch_jacobian(y, x)]


@scenario("parallel_for gradients_test (use_pfor=False): jacobian rows taken by gradients "
          "calls inside a while loop body. The body's only op between the captured chain and "
          "its y is a gather: nothing to keep there", control_flow=True,
          also_allowed_fallbacks=(NOTHING_TO_REWRITE_FALLBACK, PATTERN_OFF_PATH_FALLBACK))
def while_loop_jacobian(env):
    x = env.input()
    h, ws = env.chain(x, 3, 10, "trunk")
    return lambda: pfor_gradients.jacobian(h, [x, ws[1]], use_pfor=False)


# --- second order -----------------------------------------------------------------------------


@scenario("HessianTest: tf.hessians through a chain. Its second-order calls run in a while "
          "body whose only op between the captured xs and gradient[j] is a slice: nothing to "
          "keep there", control_flow=True,
          also_allowed_fallbacks=(NOTHING_TO_REWRITE_FALLBACK, PATTERN_OFF_PATH_FALLBACK))
def hessians(env):
    x = env.constant((2, 3), 1, name="x")
    ws = [env.constant((3, 3), 10 + i, name=f"w{i}") for i in range(3)]
    h, _ = env.chain(x, 0, 0, "trunk", weights=ws)
    return lambda: tf.hessians(_loss(h), [x, ws[0]])


@scenario("gradients of gradients (a gradient penalty) w.r.t. inputs and weights")
def gradient_of_gradient(env):
    x = env.input()
    h, ws = env.chain(x, 3, 10, "trunk")
    loss = _loss(h)

    def compute():
        first = tf.gradients(loss, [x] + ws[:1])
        penalty = tf.reduce_sum(first[0] * first[0]) + tf.reduce_sum(first[1])
        return first + tf.gradients(penalty, [x] + ws)
    return compute


# --------------------------------------------------------------------------------------------
# Runner (one mode per process)


def set_up_mode(mode: str) -> None:
    if mode in ("v1", "v1_cfv2"):
        tf.compat.v1.disable_v2_behavior()
    if mode == "v1_cfv2":
        tf.compat.v1.enable_control_flow_v2()


class CallLog:
    """Spies on memsave_grads: every call a patched tf.gradients makes into ``api.gradients``,
    and whether it reached the rewrite (``stitch.backprop``) or fell back."""

    def __init__(self):
        from memsave_grads._tf import stitch  # pylint: disable=import-outside-toplevel
        from memsave_grads import api  # pylint: disable=import-outside-toplevel
        from memsave_grads import errors  # pylint: disable=import-outside-toplevel
        self.events: list[dict] = []
        self.backprop_calls = 0
        real_gradients, real_backprop = api.gradients, stitch.backprop
        real_rewritten_or_plain = api._rewritten_or_plain  # pylint: disable=protected-access
        fallback_errors = errors.FALLBACK_ERRORS
        log = self
        open_events: list[dict] = []  # the calls in progress, innermost last

        def fell_back(event, exc):
            event.update(outcome="fell_back", error=type(exc).__name__, message=str(exc)[:300])

        def gradients_spy(*args, **kwargs):
            event = {"outcome": "raised"}
            log.events.append(event)
            open_events.append(event)
            before = log.backprop_calls
            try:
                result = real_gradients(*args, **kwargs)
            except fallback_errors as exc:
                fell_back(event, exc)
                raise
            except Exception as exc:
                event.update(error=type(exc).__name__, message=str(exc)[:300])
                raise
            finally:
                open_events.pop()
            if event["outcome"] == "raised":  # not caught falling back under fallback="warn"
                event["outcome"] = "rewrote" if log.backprop_calls > before else "passthrough"
            return result

        def rewritten_or_plain_spy(*args, **kwargs):
            # Under fallback="warn" gradients() catches the strategy's errors itself and
            # computes plain tf.gradients: the fallback is seen here, where they are raised.
            try:
                return real_rewritten_or_plain(*args, **kwargs)
            except fallback_errors as exc:
                if open_events:
                    fell_back(open_events[-1], exc)
                raise

        def backprop_spy(*args, **kwargs):
            log.backprop_calls += 1
            return real_backprop(*args, **kwargs)

        api.gradients = gradients_spy
        api._rewritten_or_plain = rewritten_or_plain_spy  # pylint: disable=protected-access
        stitch.backprop = backprop_spy

    def take(self) -> list[dict]:
        events, self.events = self.events, []
        return events


def _exception_record(exc: BaseException) -> dict:
    return {"type": type(exc).__name__,
            "mro": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc),  # whole: ours quotes TensorFlow's sentence after our own
            "where": traceback.format_exception(type(exc), exc, exc.__traceback__)[-2][:400]}


def _describe_gradient(g) -> dict | None:
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        op = g.values.op
        kind = "IndexedSlices"
        dtype = g.values.dtype
    else:
        op = g.op
        kind = type(g).__name__ if not isinstance(g, tf.Tensor) else "Tensor"
        dtype = g.dtype
    groups = sorted(c.decode() for c in op.colocation_groups())
    devices = []
    for group in groups:
        try:
            devices.append(op.graph.get_operation_by_name(group[len("loc:@"):]).device)
        except (KeyError, ValueError):
            devices.append(None)
    return {"kind": kind, "dtype": dtype.name, "colocation": groups,
            "colocation_devices": devices}


def _same_placement(ours: dict, reference: dict) -> bool:
    """Colocated as tf.gradients colocates. A sum of partials is colocated with its first
    summand (``_MultiDeviceAddN``), and which partial comes first follows each walk's order,
    so we accept another forward op on the same device; never one of our recompute copies or
    gradient ops."""
    if ours["colocation"] == reference["colocation"]:
        return True
    ours_forward = all("memsave" not in g and not g.startswith("loc:@gradients")
                       for g in ours["colocation"])
    return ours_forward and ours["colocation_devices"] == reference["colocation_devices"]


def _components(g) -> list:
    """Tensors to evaluate for one gradient."""
    if g is None:
        return []
    if isinstance(g, tf.IndexedSlices):
        parts = [g.values, g.indices]
        if g.dense_shape is not None:
            parts.append(g.dense_shape)
        return parts
    return [g]


def _dense_value(g, values: list):
    """The numpy value of one gradient from its evaluated components (IndexedSlices summed
    into their dense shape)."""
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        slices, indices = np.asarray(values[0]), np.asarray(values[1])
        if len(values) > 2:
            shape = tuple(np.asarray(values[2]).tolist())
        else:
            shape = (int(indices.max()) + 1 if indices.size else 0,) + slices.shape[1:]
        dense = np.zeros(shape, slices.dtype)
        np.add.at(dense, indices, slices)
        return dense
    return np.asarray(values[0])


@dataclasses.dataclass
class Outcome:
    grads: list | None = None
    error: dict | None = None
    events: list = dataclasses.field(default_factory=list)
    build_s: float = 0.0
    #: Ops the call created under a recompute scope (copies of forward ops, boundaries).
    recompute_ops: int = 0


def _build_gradients(compute, call_log: CallLog) -> Outcome:
    """Call ``compute`` under whatever patch state is current; never raises."""
    start = time.perf_counter()
    graph = tf.compat.v1.get_default_graph()
    ops_before = len(graph.get_operations())
    try:
        outcome = Outcome(grads=list(compute()))
    except Exception as exc:  # recorded and compared: the reference may raise too
        outcome = Outcome(error=_exception_record(exc))
    outcome.events = call_log.take()
    outcome.build_s = time.perf_counter() - start
    outcome.recompute_ops = sum("/recompute_level" in op.name
                                for op in graph.get_operations()[ops_before:])
    return outcome


def _flatten(outcomes: dict) -> tuple[list, list]:
    """(tensors to evaluate, (key, gradient index, slice of the flat list))."""
    fetches, layout = [], []
    for key, outcome in outcomes.items():
        if outcome.grads is None:
            continue
        for i, g in enumerate(outcome.grads):
            parts = _components(g)
            layout.append((key, i, slice(len(fetches), len(fetches) + len(parts))))
            fetches.extend(parts)
    return fetches, layout


def _assign_values(outcomes: dict, layout, flat_values) -> dict:
    values = {key: [None] * len(o.grads) for key, o in outcomes.items() if o.grads is not None}
    for key, i, part in layout:
        values[key][i] = _dense_value(outcomes[key].grads[i], list(flat_values[part]))
    return values


def _evaluate_in_graph(graph, outcomes: dict) -> tuple[dict, dict]:
    """Values of every outcome, in one Session.run (stateful ops draw once for all); if that
    fails, per outcome, so a strategy whose graph fails at run time does not hide the others.
    Returns (values, run errors)."""
    config = tf.compat.v1.ConfigProto(allow_soft_placement=True,
                                      intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=2)
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        with graph.as_default():
            init = tf.compat.v1.global_variables_initializer()
        sess.run(init)
        fetches, layout = _flatten(outcomes)
        try:
            return _assign_values(outcomes, layout, sess.run(fetches)), {}
        except Exception:  # narrowed below, one outcome at a time
            pass
        values, run_errors = {}, {}
        for key in outcomes:
            single = {key: outcomes[key]}
            fetches, layout = _flatten(single)
            try:
                values.update(_assign_values(single, layout, sess.run(fetches)))
            except Exception as exc:  # a run-time failure of this outcome only
                run_errors[key] = _exception_record(exc)
        return values, run_errors


def _patched(checkpoints):
    import memsave_grads as mg  # pylint: disable=import-outside-toplevel
    return mg.patch(checkpoints=checkpoints, fallback="warn")


def _graph_phase(selected: list, mode: str, call_log: CallLog, wanted: Callable):
    """Yields (scenario, outcomes, values, run errors, build error) per scenario.

    Every scenario's graph and reference are built first, then each strategy is applied to all
    graphs that want it (``wanted(scenario, strategy)``) under one patch() (each patch() scans
    sys.modules, 0.05-0.2 s), then each graph is evaluated once.
    """
    prepared = {}
    for sc in selected:
        graph = tf.Graph()
        with graph.as_default():
            try:
                compute = sc.build(Env(mode, "graph"))
            except Exception as exc:  # reported as the scenario's failure
                call_log.take()
                prepared[sc.name] = (sc, None, None, None, _exception_record(exc))
                continue
            outcomes = {"reference": _build_gradients(compute, call_log)}
        prepared[sc.name] = (sc, graph, compute, outcomes, None)
    for checkpoints_key, checkpoints in STRATEGIES.items():
        if not any(wanted(sc, checkpoints_key) for sc in selected):
            continue
        with _patched(checkpoints):
            for sc, graph, compute, outcomes, build_error in prepared.values():
                if build_error is None and wanted(sc, checkpoints_key):
                    with graph.as_default():
                        outcomes[checkpoints_key] = _build_gradients(compute, call_log)
    for sc, graph, _, outcomes, build_error in prepared.values():
        if build_error is not None:
            yield sc, None, None, None, build_error
            continue
        values, run_errors = _evaluate_in_graph(graph, outcomes)
        yield sc, outcomes, values, run_errors, None


def _trace_and_run(sc: Scenario, mode: str, call_log: CallLog, variables: dict, key: str):
    """The scenario's forward pass and one gradient computation (under the current patch
    state) in a tf.function, run once: (outcome, values or None, exception)."""
    traces: list = []

    def traced():
        compute = sc.build(Env(mode, "function", variables))
        outcome = _build_gradients(compute, call_log)
        fetches, layout = _flatten({key: outcome})
        traces.append((outcome, layout))
        return fetches

    try:
        flat = [t.numpy() for t in tf.function(traced, autograph=False)()]
    except Exception as exc:  # a build error propagates; a run-time error is recorded
        if not traces:
            raise
        return traces[-1][0], None, exc
    # tf.function traces again when the first trace created variables: the last trace ran.
    outcome, layout = traces[-1]
    return outcome, _assign_values({key: outcome}, layout, flat).get(key), None


def _function_phase(selected: list, mode: str, call_log: CallLog, wanted: Callable):
    """Yields as _graph_phase does. Each (scenario, strategy) is its own tf.function (a traced
    function cannot be extended later), so random ops carry op seeds; variables are created
    once per scenario, outside the functions, and shared."""
    results = {sc.name: [sc, {}, {}, {}, None] for sc in selected}
    variables = {sc.name: {} for sc in selected}

    def one(sc, key):
        entry = results[sc.name]
        if entry[4] is not None:
            return
        try:
            outcome, values, exc = _trace_and_run(sc, mode, call_log, variables[sc.name], key)
        except Exception as build_exc:  # the scenario could not be traced at all
            call_log.take()
            entry[4] = _exception_record(build_exc)
            return
        entry[1][key] = outcome
        if exc is not None:
            entry[3][key] = _exception_record(exc)
        else:
            entry[2][key] = values

    for sc in selected:
        one(sc, "reference")
    for key, checkpoints in STRATEGIES.items():
        if not any(wanted(sc, key) for sc in selected):
            continue
        with _patched(checkpoints):
            for sc in selected:
                if wanted(sc, key):
                    one(sc, key)
    for sc, outcomes, values, run_errors, build_error in results.values():
        yield sc, outcomes, values, run_errors, build_error


def _allowed_fallbacks(sc: Scenario, mode: str) -> set[str]:
    allowed = set()
    if sc.control_flow and mode == "v1":
        allowed.add(TF1_CONTROL_FLOW_FALLBACK)
    if sc.nothing_to_rewrite:
        allowed.add(NOTHING_TO_REWRITE_FALLBACK)
    return allowed | set(sc.also_allowed_fallbacks)


def _routing(events: list) -> str:
    outcomes = {e["outcome"] for e in events}
    if not events:
        return "not_routed"
    if outcomes == {"rewrote"}:
        return "rewrote"
    if outcomes <= {"fell_back", "passthrough"}:
        return "fell_back" if "fell_back" in outcomes else "passthrough"
    if "raised" in outcomes:
        return "raised"
    return "partly_fell_back"


def compare(sc: Scenario, mode: str, reference: Outcome, ours: Outcome,
            ref_values, our_values, ref_run_error, our_run_error) -> list[str]:
    """Every way ``ours`` differs from the reference, in words (empty: parity)."""
    from conftest import assert_grads_close  # pylint: disable=import-outside-toplevel
    problems = []
    allowed = _allowed_fallbacks(sc, mode)
    for event in ours.events:
        if event["outcome"] == "fell_back" and event.get("error") not in allowed:
            problems.append(f"fell back to tf.gradients ({event.get('error')}): "
                            f"{event.get('message')}")
        if event["outcome"] == "passthrough" and not sc.nothing_to_rewrite:
            problems.append("memsave_grads returned without rewriting the graph")
    if not ours.events and reference.error is None:
        problems.append("the patched call never reached memsave_grads")
    if reference.error is not None:
        if ours.error is None:
            problems.append(f"tf.gradients raised {reference.error['type']} "
                            f"({reference.error['message'][:120]}), ours did not")
        elif reference.error["type"] not in ours.error["mro"]:
            problems.append(f"tf.gradients raised {reference.error['type']}, ours raised "
                            f"{ours.error['type']}: {ours.error['message']}")
        elif reference.error["message"] not in ours.error["message"]:
            # Code matching TensorFlow's text (its own tests' assertRaisesRegex) must match ours.
            problems.append(f"tf.gradients raised \"{reference.error['message'][:200]}\", ours "
                            f"does not say it: {ours.error['message'][:300]}")
        return problems
    if ours.error is not None:
        # The spy saw the library's own exception before tf.function's tracing wrapped it.
        raised = [e for e in ours.events if e["outcome"] == "raised"]
        if raised:
            return problems + [f"raised {raised[0]['error']}: {raised[0]['message']}"]
        return problems + [f"raised {ours.error['type']}: {ours.error['message']} "
                           f"[{ours.error['where'].strip()}]"]
    if len(ours.grads) != len(reference.grads):
        return problems + [f"{len(ours.grads)} gradients returned, tf.gradients returned "
                           f"{len(reference.grads)}"]
    for i, (a, e) in enumerate(zip(ours.grads, reference.grads)):
        da, de = _describe_gradient(a), _describe_gradient(e)
        if (da is None) != (de is None):
            problems.append(f"gradient {i}: {'None' if da is None else da['kind']}, "
                            f"tf.gradients gives {'None' if de is None else de['kind']}")
            continue
        if da is None:
            continue
        if da["kind"] != de["kind"] or da["dtype"] != de["dtype"]:
            problems.append(f"gradient {i}: {da['kind']} {da['dtype']}, tf.gradients gives "
                            f"{de['kind']} {de['dtype']}")
        if sc.check_colocation and not _same_placement(da, de):
            problems.append(f"gradient {i}: colocation_groups {da['colocation']}, tf.gradients "
                            f"gives {de['colocation']}")
    if ref_run_error is not None:
        return problems + [f"the reference failed at run time: {ref_run_error['message']}"]
    if our_run_error is not None:
        return problems + [f"failed at run time: {our_run_error['type']}: "
                           f"{our_run_error['message']}"]
    if problems:
        return problems
    for i, (a, e) in enumerate(zip(our_values, ref_values)):
        rtol = RTOL.get(np.asarray(e).dtype.name, 1e-5) if e is not None else 1e-5
        try:
            assert_grads_close([a], [e], rtol=rtol)
        except AssertionError as exc:
            problems.append(f"gradient {i}: values differ: {str(exc).strip()[:500]}")
    return problems


def _records(sc: Scenario, mode: str, container: str, outcomes, values, run_errors,
             build_error, strategies) -> list[dict]:
    """One record per strategy asked of one scenario in one mode and container."""
    base = {"scenario": sc.name, "mode": mode, "container": container}
    if build_error is not None:
        return [dict(base, id=run_id(sc.name, mode, container, s), strategy=s,
                     routing="not_run", events=[], fallbacks=[], reference_error=None,
                     recompute_ops=0,
                     problems=[f"the scenario failed to build: {build_error['type']}: "
                               f"{build_error['message']} [{build_error['where'].strip()}]"],
                     build_seconds=0.0)
                for s in strategies]
    records = []
    reference = outcomes["reference"]
    for strategy in strategies:
        ours = outcomes.get(strategy)
        if ours is None:  # the forward pass traced for the reference, not for this strategy
            ours = Outcome(error={"type": "NotRun", "mro": [], "message": "not traced",
                                  "where": ""})
        problems = compare(sc, mode, reference, ours, values.get("reference"),
                           values.get(strategy), run_errors.get("reference"),
                           run_errors.get(strategy))
        records.append(dict(
            base, id=run_id(sc.name, mode, container, strategy), strategy=strategy,
            routing=_routing(ours.events), events=ours.events,
            fallbacks=sorted({e.get("error") for e in ours.events
                              if e["outcome"] == "fell_back"}),
            reference_error=reference.error and reference.error["type"],
            recompute_ops=ours.recompute_ops,
            problems=problems, build_seconds=round(ours.build_s, 3)))
    return records


def run_mode(mode: str, out_path: str, only: list[str] | None = None,
             runs: set[str] | None = None) -> None:
    """Run every scenario of ``mode`` (``only``: these scenarios; ``runs``: only these run ids);
    one JSON line per record, flushed per scenario so that a crash loses only what was not
    evaluated yet."""
    from memsave_grads._tf import selection  # pylint: disable=import-outside-toplevel
    set_up_mode(mode)
    # The scenarios are small: the never-worse rule would hand most of them to plain
    # tf.gradients, and the suite is about the rewrite's semantics (tests/conftest.py).
    selection.NEVER_WORSE_RULE = False
    # The fallback warnings are counted, not shown.
    logging.getLogger("memsave_grads").setLevel(logging.ERROR)
    tf.get_logger().setLevel("ERROR")
    call_log = CallLog()
    phases = {"graph": _graph_phase, "function": _function_phase}
    with open(out_path, "w", encoding="utf-8") as out:
        for container, phase in phases.items():
            def wanted(sc, strategy, container=container):
                return ((not only or sc.name in only)
                        and (runs is None or run_id(sc.name, mode, container, strategy) in runs))

            selected = [sc for sc in SCENARIOS.values() if (mode, container) in sc.runs()
                        and any(wanted(sc, strategy) for strategy in STRATEGIES)]
            for sc, outcomes, values, run_errors, build_error in phase(selected, mode, call_log,
                                                                        wanted):
                strategies = [strategy for strategy in STRATEGIES if wanted(sc, strategy)]
                for record in _records(sc, mode, container, outcomes, values, run_errors,
                                       build_error, strategies):
                    out.write(json.dumps(record) + "\n")
                out.flush()


# --------------------------------------------------------------------------------------------
# All modes, and the counts


def launch_modes(out_dir: str, only: list[str] | None = None,
                 modes: tuple = MODES, runs: list[str] | None = None
                 ) -> dict[str, subprocess.Popen]:
    """Start one process per mode (they run concurrently); ``runs``: only these run ids."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    runs_path = None
    if runs is not None:
        runs_path = os.path.join(out_dir, "runs.txt")
        with open(runs_path, "w", encoding="utf-8") as f:
            f.write("\n".join(runs) + "\n")
    procs = {}
    for mode in modes:
        command = [sys.executable, os.path.abspath(__file__), "--mode", mode,
                   "--out", os.path.join(out_dir, f"{mode}.jsonl")]
        if only:
            command += ["--only", ",".join(only)]
        if runs_path is not None:
            command += ["--runs", runs_path]
        procs[mode] = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return procs


def collect(out_dir: str, procs: dict, timeout_s: float) -> tuple[dict, dict]:
    """Wait for the mode processes; (records by id, {mode: (exit code, output tail)})."""
    deadline = time.monotonic() + timeout_s
    status = {}
    for mode, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            code = "timeout"
        status[mode] = (code, output.decode(errors="replace")[-3000:])
    records = {}
    for mode in procs:
        path = os.path.join(out_dir, f"{mode}.jsonl")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        record = json.loads(line)
                        records[record["id"]] = record
    return records, status


def summary_table(records: dict) -> str:
    """Counts per (mode, container) x strategy: runs, rewrote, fell back, failed."""
    rows = {}
    for r in records.values():
        key = (r["mode"], r["container"], r["strategy"])
        row = rows.setdefault(key, {"runs": 0, "rewrote": 0, "recomputed": 0, "fell_back": 0,
                                    "fallback_ok": 0, "other": 0, "failed": 0})
        row["runs"] += 1
        row["recomputed"] += r["recompute_ops"] > 0
        routing = r["routing"]
        if routing == "rewrote":
            row["rewrote"] += 1
        elif routing in ("fell_back", "partly_fell_back"):
            row["fell_back"] += 1
            if not any(p.startswith("fell back") for p in r["problems"]):
                row["fallback_ok"] += 1
        else:
            row["other"] += 1
        if r["problems"]:
            row["failed"] += 1
    columns = ("runs", "rewrote", "recomputed", "fell_back", "fallback_ok", "other", "failed")
    lines = [f"{'mode':8} {'container':9} {'strategy':9} " + " ".join(f"{c:>11}" for c in columns)]
    total = dict.fromkeys(columns, 0)
    for (mode, container, strategy), row in sorted(rows.items()):
        lines.append(f"{mode:8} {container:9} {strategy:9} "
                     + " ".join(f"{row[c]:11}" for c in columns))
        for c in columns:
            total[c] += row[c]
    lines.append(f"{'total':28} " + " ".join(f"{total[c]:11}" for c in columns))
    scenarios = len({r["scenario"] for r in records.values()})
    lines.append(
        f"{scenarios} scenarios. rewrote: every call went through the rewrite; recomputed: "
        "it copied forward ops; fallback_ok: fell back where allowed (TF1 control flow in v1, "
        "nothing between xs and ys); other: raised (as tf.gradients did, or not), "
        "passthrough, not run; failed: any difference from tf.gradients")
    return "\n".join(lines)


def failures_text(records: dict) -> str:
    lines = []
    for r in sorted(records.values(), key=lambda r: r["id"]):
        if r["problems"]:
            lines.append(f"{r['id']}: {r['problems'][0][:300]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, help="run one mode in this process")
    parser.add_argument("--out", help="JSON lines output (with --mode)")
    parser.add_argument("--only", help="comma-separated scenario names")
    parser.add_argument("--runs", help="a file of run ids, one a line: only these")
    parser.add_argument("--representative", action="store_true",
                        help="only the default suite's runs (one strategy per scenario, mode "
                             "and container, rotated)")
    parser.add_argument("--failures", action="store_true", help="list every failing run")
    parser.add_argument("--keep", help="keep the JSON lines of every mode in this folder")
    args = parser.parse_args(argv)
    only = args.only.split(",") if args.only else None
    runs = representative_runs() if args.representative else None
    if args.runs:
        with open(args.runs, encoding="utf-8") as f:
            runs = [line.strip() for line in f if line.strip()]
    if args.mode:
        run_mode(args.mode, args.out, only, None if runs is None else set(runs))
        return 0
    import tempfile  # pylint: disable=import-outside-toplevel
    with tempfile.TemporaryDirectory() as temporary_dir:
        out_dir = args.keep or temporary_dir
        os.makedirs(out_dir, exist_ok=True)
        start = time.perf_counter()
        records, status = collect(out_dir, launch_modes(out_dir, only, runs=runs),
                                  timeout_s=900)
        elapsed = time.perf_counter() - start
    for mode, (code, output) in status.items():
        if code != 0:
            sys.stdout.write(f"mode {mode}: exit {code}\n{output}\n")
    sys.stdout.write(summary_table(records) + f"\n{elapsed:.0f} s\n")
    if args.failures:
        sys.stdout.write(failures_text(records) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
