"""Second-order gradients through the rewrite (issue 14 item 1).

The copies read ``tf.identity`` boundaries of the kept tensors (design note "boundaries"), so an
outer derivative flows through a rewritten first-order gradient back into the forward pass.
Every case differentiates a gradient again and compares with ``tf.gradients`` in the same
``session.run`` (or the same ``tf.function`` call): Hessian-vector products, Hessians, a
gradient penalty, a while loop and a cond, dropout, and patched code (``tf.hessians``, a MAML
step), with respect to variables, placeholders (function arguments) and constants, under every
strategy.

Every memsave call is checked to have copied forward ops (copy names contain
``_memsave/recompute_level``; nested copies ``/nested/`` where the plan nests), so no case
passes because nothing was rewritten.

The worst relative error per case and strategy is collected: ``pytest -s`` prints the table
when the module ends, and :func:`error_table` returns it.
"""

import collections
import dataclasses
import re

import numpy as np
import pytest
import tensorflow as tf

import memsave_grads as mg
from conftest import assert_grads_close
from memsave_grads._tf import stitch
from memsave_grads import api
from memsave_grads.core import budgets
from memsave_grads.core import multilevel

DTYPE = tf.float64
RTOL = {tf.float64: 1e-10, tf.float32: 1e-5}
#: "revolve": the revolve solver at a budget below the "memory" plan's peak where it can go
#: there (it nests where it finds that worth it); "nested": a 2-level plan forced on any graph
#: (tests/test_multilevel.py's recipe), so nested copies are differentiated again everywhere.
STRATEGIES = ["memory", "speed", "explicit", "collection", "budget:80%", "revolve", "nested"]
MODES = ["session", "function"]
#: Which of the two calls is memsave_grads: (first order, second order).
COMPOSITIONS = {"tf_of_mg": (True, False), "mg_of_tf": (False, True), "mg_of_mg": (True, True)}

#: (case, strategy) -> worst relative error seen.
_WORST = collections.defaultdict(float)
#: How many memsave calls under "revolve" got a nested plan (True) or a single-level one.
_REVOLVE_NESTED = collections.Counter()


def error_table() -> str:
    """The worst relative error per case and strategy so far: max |ours - tf| / max |tf| per
    compared gradient tensor, the worst over modes, compositions and xs."""
    strategies = [s for s in STRATEGIES + ["patched"] if any(k[1] == s for k in _WORST)]
    lines = ["second-order max relative error vs tf.gradients (max |diff| / max |tf|)",
             f"{'case':<24}" + "".join(f"{s:>12}" for s in strategies)]
    for case in sorted({case for case, _ in _WORST}):
        lines.append(f"{case:<24}" + "".join(
            f"{_WORST[(case, s)]:>12.1e}" if (case, s) in _WORST else f"{'-':>12}"
            for s in strategies))
    lines.append(f"{'worst':<24}" + "".join(
        f"{max(v for k, v in _WORST.items() if k[1] == s):>12.1e}" for s in strategies))
    if _REVOLVE_NESTED:
        lines.append(f"revolve: {_REVOLVE_NESTED[True]} of {sum(_REVOLVE_NESTED.values())} "
                     "memsave calls got a nested plan")
    return "\n".join(lines)


@pytest.fixture(scope="module", autouse=True)
def _print_error_table():
    yield
    if _WORST:
        print("\n" + error_table())


def _compare(case: str, strategy: str, got, want, dtype=DTYPE):
    """assert_grads_close at the project's tolerance, recording the worst relative error."""
    for a, e in zip(got, want):
        if a is None or e is None:
            continue
        a, e = np.asarray(a), np.asarray(e)
        scale = float(np.max(np.abs(e))) if e.size else 0.0
        if scale > 0 and a.shape == e.shape:
            key = (case, strategy)
            _WORST[key] = max(_WORST[key], float(np.max(np.abs(a - e))) / scale)
    assert_grads_close(got, want, rtol=RTOL[dtype])


# --------------------------------------------------------------------------------------------
# memsave calls, each checked to have rewritten something
# --------------------------------------------------------------------------------------------

#: A forward op copied by a rewrite (not one of the boundary identities).
_COPY = re.compile(r"_memsave(_\d+)?/recompute_level[^/]*/(?!boundary/)")


def _copies_since(graph, first_op_index: int) -> list:
    return [op for op in graph.get_operations()[first_op_index:] if _COPY.search(op.name)]


def _graph_of(ys):
    return (ys[0] if isinstance(ys, (list, tuple)) else ys).graph


def _plan_levels(ys, xs, budget) -> int:
    plan = api.prepare(ys, xs, None, budget, {}).plan
    return plan.levels


def _revolve_budget(ys, xs) -> tuple:
    """(budget, nests): a revolve byte budget, nesting where some budget between revolve's
    smallest peak and the "memory" plan's does (on these small graphs it does for first-order
    chains, not for graphs that hold a backward pass)."""
    single = api.prepare(ys, xs, None, "memory", {}).plan.predicted_peak_bytes
    try:
        api.prepare(ys, xs, None, mg.Budget(bytes=1, solver="revolve"), {})
    except mg.InfeasibleBudgetError as exc:
        smallest = exc.min_feasible_bytes
    else:
        pytest.fail("revolve met a 1-byte budget")
    feasible = None
    for budget_bytes in sorted({smallest + (single - smallest) // 2, smallest, single},
                               reverse=True):
        budget = mg.Budget(bytes=budget_bytes, solver="revolve")
        try:
            levels = _plan_levels(ys, xs, budget)
        except mg.InfeasibleBudgetError:
            continue
        if levels >= 2:
            _REVOLVE_NESTED[True] += 1
            return budget, True
        feasible = feasible or budget
    assert feasible is not None, f"revolve: no budget in {smallest}..{single} bytes is met"
    _REVOLVE_NESTED[False] += 1
    return feasible, False


def _forced_nested_gradients(ys, xs, name):
    """Gradients under a balanced 2-level plan, through the rewrite itself
    (tests/test_multilevel.py's recipe: no budget makes the solver nest on every graph)."""
    prepared = api.prepare(ys, xs, None, "memory", {}, select=False)
    ctx = prepared.selection
    candidates, must_keep, not_replayed = ctx.node_sets()
    plan = multilevel.balanced_plan(ctx.model, must_keep, candidates, 2, not_replayed)
    assert plan.levels == 2, f"{name}: no 2-level plan on {len(ctx.region)} ops"
    prepared.arguments = dataclasses.replace(prepared.arguments, scope=name)
    return api.run_plan(prepared, plan)


def _checkpoints(strategy, ys, xs, interior):
    """(checkpoints argument, whether the plan nests)."""
    if strategy == "explicit":
        return interior[::2], False
    if strategy == "collection":
        if not _graph_of(ys).get_collection("checkpoints"):
            for t in interior:
                tf.compat.v1.add_to_collection("checkpoints", t)
        return "collection", False
    if strategy == "revolve":
        return _revolve_budget(ys, xs)
    return strategy, False


def _budget_gradients(ys, xs, budget, name):
    """mg.gradients with a budget. A fraction of a small graph's peak can be below every plan's;
    then the budget is raised to what the error states, or the "memory" plan's peak where that
    is more: on the outer graph of an HVP, the stated minimum was not met when asked for (a
    second error stated a larger one)."""
    try:
        return mg.gradients(ys, xs, checkpoints=budget, name=name)
    except mg.InfeasibleBudgetError as exc:
        memory_peak = api.prepare(ys, xs, None, "memory", {}).plan.predicted_peak_bytes
        raised = mg.Budget(bytes=max(exc.min_feasible_bytes, memory_peak),
                           solver=getattr(budget, "solver", budgets.DEFAULT_SOLVER))
        return mg.gradients(ys, xs, checkpoints=raised, name=name)


def _mg(ys, xs, strategy, interior, name):
    """memsave gradients under ``strategy``, asserting that forward ops were copied (and copied
    at depth where the plan nests)."""
    graph = _graph_of(ys)
    start = len(graph.get_operations())
    if strategy == "nested":
        grads, nests = _forced_nested_gradients(ys, xs, name), True
    else:
        checkpoints, nests = _checkpoints(strategy, ys, xs, interior)
        if isinstance(checkpoints, mg.Budget) or budgets.is_budget_string(checkpoints):
            grads = _budget_gradients(ys, xs, checkpoints, name)
        else:
            grads = mg.gradients(ys, xs, checkpoints=checkpoints, name=name)
    copies = _copies_since(graph, start)
    assert copies, f"{name}: {strategy!r} copied no forward op"
    if nests:
        assert any("/nested/" in op.name for op in copies), f"{name}: nothing copied at depth"
    return grads


def _gradients_fn(use_mg: bool, strategy=None, interior=()):
    if not use_mg:
        return lambda ys, xs, name: tf.gradients(ys, xs, name=name)
    return lambda ys, xs, name: _mg(ys, xs, strategy, interior, name)


@pytest.fixture
def backprop_calls(monkeypatch):
    """Spy on ``stitch.backprop`` (the patched paths): one entry per call, the forward ops it
    copied; nested levels recurse through it and count as calls of their own."""
    calls = []
    original = stitch.backprop

    def spy(ys, *args, **kwargs):
        graph = _graph_of(ys)
        start = len(graph.get_operations())
        result = original(ys, *args, **kwargs)
        calls.append(_copies_since(graph, start))
        return result

    monkeypatch.setattr(stitch, "backprop", spy)
    return calls


# --------------------------------------------------------------------------------------------
# Where a case runs: a v1 Session graph (placeholder input) or a tf.function (argument input)
# --------------------------------------------------------------------------------------------


def _weights(shapes, seed=0):
    rng = np.random.RandomState(seed)
    return [(rng.randn(*s) / np.sqrt(np.prod(s[:-1]))).astype(DTYPE.as_numpy_dtype)
            for s in shapes]


def _run(mode, build, input_shape, weight_shapes, seeds=(1,)):
    """``build(x, ws) -> (ours, want)`` in ``mode``, both evaluated in one step, once per input
    seed (one graph, one trace); returns [(ours, want) per seed].

    ``x`` is a placeholder (session) or the function's argument (tf.function); ``ws`` are
    resource variables (in tf.function mode created outside it, so they are captured).
    """
    inputs = [np.random.RandomState(seed).randn(*input_shape).astype(DTYPE.as_numpy_dtype)
              for seed in seeds]
    if mode == "session":
        graph = tf.Graph()
        with graph.as_default():
            x = tf.compat.v1.placeholder(DTYPE, input_shape, name="x")
            ws = [tf.Variable(w, name=f"w{i}") for i, w in enumerate(_weights(weight_shapes))]
            ours, want = build(x, ws)
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                return [_run_keeping_none(sess, [ours, want], {x: value}) for value in inputs]
    ws = [tf.Variable(w, name=f"w{i}") for i, w in enumerate(_weights(weight_shapes))]

    # autograph off: converting these helpers costs more time than the rest of a test.
    @tf.function(input_signature=[tf.TensorSpec(input_shape, DTYPE)], autograph=False)
    def step(x):
        return build(x, ws)

    as_numpy = lambda gs: [None if g is None else g.numpy() for g in gs]  # noqa: E731
    return [tuple(as_numpy(gs) for gs in step(tf.constant(value))) for value in inputs]


def _run_keeping_none(sess, lists, feed):
    """One ``sess.run`` of lists of gradients that may hold None (Session cannot fetch None)."""
    fetches = [[g for g in gs if g is not None] for gs in lists]
    values = sess.run(fetches, feed)
    out = []
    for gs, vs in zip(lists, values):
        vs = iter(vs)
        out.append([None if g is None else next(vs) for g in gs])
    return out


def _constant(shape, seed, scale=0.3, name="c"):
    return tf.constant(scale * np.random.RandomState(seed).randn(*shape), dtype=DTYPE,
                       name=name)


def _hvp(first, second, loss, xs, probe, name):
    """The gradient of ``<first(loss, xs), probe>`` w.r.t. ``xs``: Hessian-vector products."""
    grads = first(loss, xs, f"{name}_inner")
    inner = tf.add_n([tf.reduce_sum(g * v) for g, v in zip(grads, probe) if g is not None])
    return second(inner, xs, f"{name}_outer")


def _probe_like(xs, seed):
    rng = np.random.RandomState(seed)
    return [tf.constant(rng.randn(*x.shape.as_list()), dtype=DTYPE) for x in xs]


# --------------------------------------------------------------------------------------------
# Hessian-vector products and Hessians of an MLP
# --------------------------------------------------------------------------------------------

BATCH, WIDTH, DEPTH = 3, 4, 5
MLP_SHAPES = [(WIDTH, WIDTH)] * DEPTH


def _mlp_layers(x, ws, bias) -> list:
    """The activations of a tanh MLP, the output last."""
    h, interior = x, []
    for w in ws:
        h = tf.tanh(tf.matmul(h, w) + bias)
        interior.append(h)
    return interior


def _mlp(x, ws, bias, offset):
    """A tanh MLP's loss; ``offset`` enters linearly, so its second derivatives are None."""
    interior = _mlp_layers(x, ws, bias)
    h = interior[-1]
    loss = tf.reduce_sum(h * h) + tf.reduce_sum(tf.sin(h)) + 2.0 * tf.reduce_sum(offset)
    return loss, interior


def _mlp_xs(x, ws):
    """The MLP's loss and xs: variables, the input, constants (one linear, one unused)."""
    bias = _constant([WIDTH], seed=5, name="bias")
    offset = _constant([2], seed=6, name="offset")
    unused = _constant([2], seed=7, name="unused")
    loss, interior = _mlp(x, ws, bias, offset)
    return loss, [*ws, x, bias, offset, unused], interior


#: Every strategy in both modes with both calls rewritten; the one-sided compositions where
#: the plans differ most in kind (a cut search, nested copies).
HVP_CASES = ([(s, m, "mg_of_mg") for s in STRATEGIES for m in MODES]
             + [(s, m, c) for s, m in (("memory", "session"), ("memory", "function"),
                                       ("nested", "session")) for c in ("tf_of_mg", "mg_of_tf")])


@pytest.mark.parametrize("strategy,mode,composition", HVP_CASES)
def test_hessian_vector_product(strategy, mode, composition):
    first_mg, second_mg = COMPOSITIONS[composition]

    def build(x, ws):
        loss, xs, interior = _mlp_xs(x, ws)
        probe = _probe_like(xs, seed=8)
        ours = _hvp(_gradients_fn(first_mg, strategy, interior),
                    _gradients_fn(second_mg, strategy, interior), loss, xs, probe, "hvp")
        want = _hvp(_gradients_fn(False), _gradients_fn(False), loss, xs, probe, "ref")
        return ours, want

    (got, want), = _run(mode, build, (BATCH, WIDTH), MLP_SHAPES)
    assert [g is None for g in got] == [False] * (DEPTH + 2) + [True, True]
    _compare(f"hvp/{composition}", strategy, got, want)


def _hessian_rows(first, second, loss, x, name):
    """The Hessian of ``loss`` w.r.t. the vector ``x``, one gradient call per row."""
    grad = first(loss, [x], f"{name}_inner")[0]
    rows = [second(grad[j], [x], f"{name}_row{j}")[0] for j in range(x.shape[0])]
    return tf.stack(rows)


@pytest.mark.parametrize("strategy,mode", [(s, "session") for s in STRATEGIES
                                           if s not in ("budget:80%", "revolve")]
                         + [("memory", "function")])
def test_hessian_wrt_a_constant(strategy, mode):
    """Every row of the Hessian goes through a memsave call of its own (the budgets are left to
    the HVP tests: a solver run per row costs seconds)."""

    def build(x, ws):
        loss, xs, interior = _mlp_xs(x, ws)
        bias = xs[DEPTH + 1]
        fn = _gradients_fn(True, strategy, interior)
        return [_hessian_rows(fn, fn, loss, bias, "hessian")], tf.hessians(loss, bias)

    (got, want), = _run(mode, build, (BATCH, WIDTH), MLP_SHAPES)
    _compare("hessian/mg_of_mg", strategy, got, want)


# --------------------------------------------------------------------------------------------
# A gradient penalty (WGAN-GP): |d D(x_hat) / d x_hat| differentiated w.r.t. D's weights
# --------------------------------------------------------------------------------------------

IMAGE = (2, 5, 5, 2)
CONV_SHAPES = [(3, 3, 2, 3), (3, 3, 3, 3), (3, 3, 3, 3), (5 * 5 * 3, 1)]


def _critic(image, ws):
    h, interior = image, []
    for kernel in ws[:-1]:
        h = tf.tanh(tf.nn.conv2d(h, kernel, strides=1, padding="SAME"))
        interior.append(h)
    return tf.matmul(tf.reshape(h, [IMAGE[0], -1]), ws[-1]), interior


GP_CASES = ([(s, "session", "mg_of_mg") for s in STRATEGIES]
            + [("memory", "session", "tf_of_mg"), ("memory", "session", "mg_of_tf"),
               ("memory", "function", "mg_of_mg"), ("nested", "function", "mg_of_mg")])


def _penalty_gradients(real, ws, strategy, first_mg, second_mg, name):
    """d/d(ws, real, fake) of a WGAN-GP critic loss: 10 (|d D(x_hat)/d x_hat| - 1)^2 - D(x_hat),
    with x_hat between the real batch and a fake (constant) one."""
    fake = _constant(IMAGE, seed=11, scale=1.0, name="fake")
    mix = _constant([IMAGE[0], 1, 1, 1], seed=12, scale=0.5, name="mix")
    x_hat = mix * real + (1.0 - mix) * fake
    score, interior = _critic(x_hat, ws)
    slope = _gradients_fn(first_mg, strategy, interior)(
        tf.reduce_sum(score), [x_hat], f"{name}_inner")[0]
    norm = tf.sqrt(tf.reduce_sum(tf.square(slope), axis=[1, 2, 3]))
    loss = 10.0 * tf.reduce_mean(tf.square(norm - 1.0)) - tf.reduce_mean(score)
    return _gradients_fn(second_mg, strategy, interior)(loss, [*ws, real, fake],
                                                        f"{name}_outer")


@pytest.mark.parametrize("strategy,mode,composition", GP_CASES)
def test_gradient_penalty(strategy, mode, composition):
    """The inner gradient is w.r.t. an intermediate tensor (x_hat), the outer one w.r.t. the
    critic's variables, the real batch (placeholder) and the fake batch (constant)."""

    def build(real, ws):
        return (_penalty_gradients(real, ws, strategy, *COMPOSITIONS[composition], "gp"),
                _penalty_gradients(real, ws, None, False, False, "ref"))

    (got, want), = _run(mode, build, IMAGE, CONV_SHAPES)
    _compare(f"penalty/{composition}", strategy, got, want)


# --------------------------------------------------------------------------------------------
# Control flow v2: a while loop and a cond in the forward pass
# --------------------------------------------------------------------------------------------


def _loop_cond_mlp(x, ws, bias):
    """tanh layer, a 3-step while loop of tanh layers, a data-dependent cond, a tanh layer.

    The loop and the branches read tensors, not variables: a variable read inside would make
    the While/If op stateful, and stateful ops are kept, never copied.
    """
    h = tf.tanh(tf.matmul(x, ws[0]) + bias)
    interior = [h]
    loop_weight, branch_weight = tf.identity(ws[1]), tf.identity(ws[2])
    _, h = tf.while_loop(lambda i, h: i < 3,
                         lambda i, h: (i + 1, tf.tanh(tf.matmul(h, loop_weight) + bias)),
                         [tf.constant(0), h])
    interior.append(h)
    h = tf.cond(tf.reduce_sum(x) > 0.0, lambda: tf.tanh(tf.matmul(h, branch_weight)),
                lambda: tf.sin(tf.matmul(h, branch_weight)))
    interior.append(h)
    h = tf.tanh(tf.matmul(h, ws[3]) + bias)
    interior.append(h)
    return tf.reduce_sum(h * h) + tf.reduce_sum(tf.sin(h)), interior


#: Not the budgets: the memory model does not see the activations a While keeps per
#: iteration, so no plan beats tf.gradients' predicted peak and every budget keeps everything.
LOOP_CASES = ([(s, "function") for s in ("memory", "explicit", "nested")]
              + [(s, "session") for s in ("memory", "explicit", "nested")])


@pytest.mark.parametrize("strategy,mode", LOOP_CASES)
def test_while_loop_and_cond(strategy, mode):
    def build(x, ws):
        bias = _constant([WIDTH], seed=5, name="bias")
        loss, interior = _loop_cond_mlp(x, ws, bias)
        xs = [*ws, x, bias]
        probe = _probe_like(xs, seed=8)
        start = len(x.graph.get_operations())
        fn = _gradients_fn(True, strategy, interior)
        ours = _hvp(fn, fn, loss, xs, probe, "hvp")
        if strategy == "explicit":
            # The kept tensors (interior[::2]) leave the loop and the cond inside one segment.
            copied = {op.type for op in _copies_since(x.graph, start)}
            assert copied & {"While", "StatelessWhile"} and copied & {"If", "StatelessIf"}, (
                f"the loop and the cond were not recomputed: {sorted(copied)}")
        want = _hvp(_gradients_fn(False), _gradients_fn(False), loss, xs, probe, "ref")
        return ours, want

    seeds = (0, 1)  # inputs whose sums have opposite signs: the cond takes each branch once
    assert len({np.sign(np.random.RandomState(s).randn(BATCH, WIDTH).sum()) for s in seeds}) == 2
    for got, want in _run(mode, build, (BATCH, WIDTH), MLP_SHAPES[:4], seeds=seeds):
        _compare("while_cond/mg_of_mg", strategy, got, want)


# --------------------------------------------------------------------------------------------
# Dropout: a stateful draw is kept, never recomputed
# --------------------------------------------------------------------------------------------


def _dropout_mlp(x, ws, bias):
    h, interior = x, []
    for i, w in enumerate(ws):
        h = tf.tanh(tf.matmul(h, w) + bias)
        if i in (1, 3):
            h = tf.nn.dropout(h, rate=0.5, seed=i)
        interior.append(h)
    return tf.reduce_sum(h * h) + tf.reduce_sum(tf.sin(h)), interior


DROPOUT_CASES = ([(s, "session") for s in ("memory", "explicit", "budget:80%", "nested")]
                 + [("memory", "function")])


@pytest.mark.parametrize("strategy,mode", DROPOUT_CASES)
def test_dropout(strategy, mode):
    """A replayed draw would give another mask and a silently wrong gradient; ours and
    tf.gradients' are evaluated in one step, so they see the same mask."""

    def build(x, ws):
        bias = _constant([WIDTH], seed=5, name="bias")
        loss, interior = _dropout_mlp(x, ws, bias)
        xs = [*ws, x, bias]
        probe = _probe_like(xs, seed=8)
        start = len(x.graph.get_operations())
        fn = _gradients_fn(True, strategy, interior)
        ours = _hvp(fn, fn, loss, xs, probe, "hvp")
        random = [op.name for op in _copies_since(x.graph, start) if "Random" in op.type]
        assert not random, f"random ops recomputed: {random}"
        want = _hvp(_gradients_fn(False), _gradients_fn(False), loss, xs, probe, "ref")
        return ours, want

    (got, want), = _run(mode, build, (BATCH, WIDTH), MLP_SHAPES)
    _compare("dropout/mg_of_mg", strategy, got, want)


# --------------------------------------------------------------------------------------------
# Patched code: tf.hessians and a MAML step, written against tf.gradients
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_patched_tf_hessians(mode, backprop_calls):
    """tf.hessians takes the first-order gradient (rewritten), then differentiates each of its
    elements inside a while loop of its own w.r.t. a tensor of the enclosing graph: there the
    loop body holds a single op, nothing to rewrite, and the patch falls back to tf.gradients
    ("warn"); the outer derivative still runs through the rewritten first-order graph."""

    def build(x, ws):
        loss, xs, _ = _mlp_xs(x, ws)
        bias = xs[DEPTH + 1]
        with mg.patch("memory"):
            ours = tf.hessians(loss, [bias, x])
        return ours, tf.hessians(loss, [bias, x])

    (got, want), = _run(mode, build, (BATCH, WIDTH), MLP_SHAPES)
    assert len(backprop_calls) == 1 and backprop_calls[0], (
        f"copies per memsave call: {[len(c) for c in backprop_calls]}")
    _compare("patched/tf.hessians", "patched", got, want)


def _maml_outer_gradients(x, ws, gradients, name):
    """One MAML meta-gradient: adapt ``ws`` with a gradient step on a support batch, then
    differentiate the query loss at the adapted weights w.r.t. ``ws`` (and the input)."""
    bias = _constant([WIDTH], seed=5, name="bias")
    support = _constant([BATCH, WIDTH], seed=13, scale=1.0, name="support")
    target = _constant([BATCH, WIDTH], seed=14, scale=0.5, name="target")

    def loss(inputs, weights):
        return tf.reduce_sum(tf.square(_mlp_layers(inputs, weights, bias)[-1] - target))

    inner = gradients(loss(support, ws), ws, name=f"{name}_inner")
    adapted = [w - 0.1 * g for w, g in zip(ws, inner)]
    return gradients(loss(x, adapted), [*ws, x, bias], name=f"{name}_outer")


@pytest.mark.parametrize("strategy,mode", [("memory", "session"), ("memory", "function"),
                                           ("speed", "session")])
def test_patched_maml_step(strategy, mode, backprop_calls):
    def build(x, ws):
        with mg.patch(strategy, fallback="error"):
            ours = _maml_outer_gradients(x, ws, tf.gradients, "maml")
        return ours, _maml_outer_gradients(x, ws, tf.gradients, "ref")

    (got, want), = _run(mode, build, (BATCH, WIDTH), MLP_SHAPES)
    assert len(backprop_calls) == 2 and all(backprop_calls), (
        f"copies per memsave call: {[len(c) for c in backprop_calls]}")
    _compare("patched/maml", "patched", got, want)
