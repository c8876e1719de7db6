"""Multiple recomputation levels (design note "multi-level"): nested plans in the rewrite, their
replay, the revolve DP, and the measured saving below the single-level minimum."""

import itertools

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import memsave_grads as mg
from conftest import assert_grads_close
from memsave_grads._tf import stitch
from memsave_grads import api
from memsave_grads.core import budgets
from memsave_grads.core import graph as graph_lib
from memsave_grads import measure
from memsave_grads.core import memory_model
from memsave_grads.core import multilevel
from memsave_grads.core import planners
from memsave_grads.core import solvers

MIB = measure.MIB


# --------------------------------------------------------------------------------------------
# The rewrite: gradients of 2- and 3-level plans equal tf.gradients
# --------------------------------------------------------------------------------------------


def _nested_gradients(ys, xs, levels):
    """mg.gradients with a balanced nested plan of ``levels`` levels."""
    prepared = api._prepare(ys, xs, None, "memory", {}, select=False)
    ctx = prepared.selection
    candidates, must_keep, not_replayed = ctx.node_sets()
    plan = multilevel.balanced_plan(ctx.model, must_keep, candidates, levels, not_replayed)
    assert plan.levels == levels
    region = ctx.region
    with prepared.graph.as_default():
        grads = stitch.backprop(
            prepared.ys, prepared.xs, prepared.grad_ys, region, {region[i] for i in plan.kept},
            prepared.user_stops, prepared.tf_kwargs, unconnected_zero=False,
            scope_prefix="test_memsave", nested=stitch.nested_ops(plan.children, region))
    # A copy at depth d is named after the copy it copies, inside that level's "nested" scope:
    # 1 + 2 + ... + (d - 1) "nested" scopes in its name.
    depth = max((op.name.count("/nested/") for op in prepared.graph.get_operations()), default=0)
    assert depth == (levels - 1) * levels // 2, f"{levels} levels, nested scopes {depth}"
    return grads


def _weights(shapes, seed=0):
    rng = np.random.RandomState(seed)
    return [tf.Variable((rng.randn(*s) / np.sqrt(s[-2])).astype(np.float32)) for s in shapes]


def _tanh_chain(ws, x):
    h = x
    for _ in range(30):
        h = tf.tanh(1.1 * h)
    return tf.reduce_sum(h * h)


def _residual_mlp(ws, x):
    h = x
    for w in ws:
        h = h + tf.tanh(tf.matmul(h, w))
    return tf.reduce_sum(h * h)


def _conv_net(ws, x):
    h = x
    for w in ws:
        h = tf.nn.relu(tf.nn.conv2d(h, w, strides=1, padding="SAME"))
    return tf.reduce_sum(h * h)


MODELS = {
    "tanh_chain": (_tanh_chain, [], (8, 16)),
    "residual_mlp": (_residual_mlp, [(16, 16)] * 16, (8, 16)),
    "conv_net": (_conv_net, [(3, 3, 4, 4)] * 10, (2, 8, 8, 4)),
}


def _build(model):
    """``MODELS[model]`` in the current graph: (y, xs = [input, *weights])."""
    fn, shapes, x_shape = MODELS[model]
    ws = _weights(shapes)
    x = tf.constant(np.random.RandomState(1).randn(*x_shape).astype(np.float32))
    return fn(ws, x), [x, *ws]


@pytest.mark.parametrize("levels", [2, 3])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_nested_gradients_equal_tf_gradients_in_a_session(model, levels):
    graph = tf.Graph()
    with graph.as_default():
        y, xs = _build(model)
        expected = tf.gradients(y, xs)
        got = _nested_gradients(y, xs, levels)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            expected_v, got_v = sess.run([expected, got])
    assert_grads_close(got_v, expected_v, rtol=1e-5)


@pytest.mark.parametrize("levels", [2, 3])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_nested_gradients_equal_tf_gradients_in_tf_function(model, levels):
    fn, shapes, x_shape = MODELS[model]
    ws = _weights(shapes)
    x = tf.constant(np.random.RandomState(1).randn(*x_shape).astype(np.float32))

    @tf.function
    def step(x):
        y = fn(ws, x)
        xs = [x, *ws]
        return tf.gradients(y, xs), _nested_gradients(y, xs, levels)

    expected, got = step(x)
    assert_grads_close([g.numpy() for g in got], [g.numpy() for g in expected], rtol=1e-5)


@pytest.mark.parametrize("model", ["residual_mlp", "conv_net"])
def test_revolve_budget_below_the_memory_plan_on_networks(model):
    """The budget path end to end: solve_revolve plans 2+ levels, the rewrite follows it."""
    graph = tf.Graph()
    with graph.as_default():
        y, xs = _build(model)
        expected = tf.gradients(y, xs)
        single = api._prepare(y, xs, None, "memory", {}).selection.plan.predicted_peak_bytes
        budget = mg.Budget(bytes=int(0.7 * single), solver="revolve")
        plan = api._prepare(y, xs, None, budget, {}).selection.plan
        assert plan.predicted_peak_bytes <= budget.bytes
        assert multilevel.NestedPlan(plan.kept, plan.nested).levels >= 2
        got = mg.gradients(y, xs, checkpoints=budget)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            expected_v, got_v = sess.run([expected, got])
    assert_grads_close(got_v, expected_v, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# The replay
# --------------------------------------------------------------------------------------------


def _chain(n, size=MIB):
    return graph_lib.ForwardGraph(
        inputs=((),) + tuple((i - 1,) for i in range(1, n)), size_bytes=(size,) * n,
        reads_source=(True,) + (False,) * (n - 1), feeds_sink=(False,) * (n - 1) + (True,),
        grad_reads_inputs=(False,) * n, grad_reads_output=(True,) * n)


@st.composite
def _dags(draw, max_nodes=18):
    n = draw(st.integers(3, max_nodes))
    inputs = [()]
    for v in range(1, n):
        preds = draw(st.sets(st.integers(0, v - 1), min_size=1, max_size=min(3, v)))
        inputs.append(tuple(sorted(preds)))
    sizes = tuple(draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)))
    flags = lambda: tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n)))  # noqa: E731
    readers = [0] * n
    for preds in inputs:
        for p in preds:
            readers[p] += 1
    feeds = tuple(readers[v] == 0 for v in range(n))
    return graph_lib.ForwardGraph(inputs=tuple(inputs), size_bytes=sizes,
                                  reads_source=(True,) + (False,) * (n - 1), feeds_sink=feeds,
                                  grad_reads_inputs=flags(), grad_reads_output=flags(),
                                  views=flags())


@settings(max_examples=60, deadline=None)
@given(_dags(), st.data())
def test_one_level_replay_equals_plan_peak_bytes(g, data):
    kept = data.draw(st.sets(st.integers(0, g.num_nodes - 1)))
    closed = graph_lib.close_segments(g, kept)
    assert multilevel.replay(g, multilevel.NestedPlan(frozenset(closed)))[0] == \
        memory_model.plan_peak_bytes(g, closed)


def test_one_level_cost_equals_budgets_score_on_a_chain():
    g = _chain(40)
    plan = planners.frontier_cuts(g, [], range(39))
    problem = budgets.BudgetProblem(graph=g, budget_bytes=1)
    _, peak, cost = budgets.score(problem, plan.kept)
    assert multilevel.replay(g, multilevel.NestedPlan(plan.kept)) == (peak, cost)


def test_deeper_plans_need_less_memory_and_more_compute_on_a_chain():
    g = _chain(256)
    results = [multilevel.replay(g, multilevel.balanced_plan(g, [], range(255), levels))
               for levels in (1, 2, 3)]
    # balanced plans are not tuned; compare the DP's instead
    plans = [multilevel.solve_revolve(budgets.BudgetProblem(graph=g, budget_bytes=b * MIB))
             for b in (34, 16, 12)]
    levels = [multilevel.NestedPlan(p.kept, p.nested).levels for p in plans]
    assert levels[0] == 1 and levels[1] >= 2 and levels[2] >= levels[1], levels
    assert [p.predicted_peak_bytes for p in plans] == sorted(
        (p.predicted_peak_bytes for p in plans), reverse=True)
    assert [p.recompute_cost for p in plans] == sorted(p.recompute_cost for p in plans)
    assert all(r[0] > 0 for r in results)


# --------------------------------------------------------------------------------------------
# The DP against brute force over every cut tree, on tiny chains
# --------------------------------------------------------------------------------------------


def _trees(lo, hi, positions):
    """Every CutTree over the positions strictly between lo and hi."""
    inside = [p for p in positions if lo < p < hi]
    for k in range(len(inside) + 1):
        for cuts in itertools.combinations(inside, k):
            bounds = [lo, *cuts]
            for segs in itertools.product(*(list(_trees(a, b, positions))
                                            for a, b in zip(bounds, cuts))):
                yield multilevel.CutTree(list(cuts), list(segs))


@pytest.mark.parametrize("n", [6, 8])
def test_revolve_matches_brute_force_on_tiny_chains(n):
    g = _chain(n)
    problem = budgets.BudgetProblem(graph=g, budget_bytes=10**12,
                                    candidates=frozenset(range(n - 1)))
    search = planners.CutSearch(g, [], problem.candidates)
    positions = [p for p in range(n) if search.allowed[p]]
    scored = []
    for tree in _trees(-1, n - 1, positions):
        plan = multilevel.plan_from_tree(g, search, tree)
        scored.append(multilevel.replay(g, plan))
    smallest = min(peak for peak, _ in scored)
    for budget in sorted({peak for peak, _ in scored}):
        best = min(cost for peak, cost in scored if peak <= budget)
        plan = multilevel.solve_revolve(problem.with_budget(budget))
        assert plan.predicted_peak_bytes <= budget
        assert plan.recompute_cost == best, (budget, plan)
    with pytest.raises(mg.InfeasibleBudgetError) as info:
        multilevel.solve_revolve(problem.with_budget(smallest - 1))
    assert info.value.min_feasible_bytes == smallest


def test_revolve_is_a_registered_solver():
    assert "revolve" in solvers.SOLVERS
    assert mg.Budget.parse("budget:5MiB:revolve").solver == "revolve"


# --------------------------------------------------------------------------------------------
# Measured: below the single-level minimum
# --------------------------------------------------------------------------------------------

ROWS, COLS = 256, 1024  # 1 MiB of float32 per activation
LAYERS = 200


def _measure(checkpoints):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [ROWS, COLS])
        h = x
        for _ in range(LAYERS):
            h = tf.tanh(h)
        y = tf.reduce_sum(h)
        grads = mg.gradients(y, x, checkpoints=checkpoints)
        plan = api._prepare(y, x, None, checkpoints, {}).selection.plan
    feed = {x: np.random.RandomState(0).rand(ROWS, COLS).astype(np.float32)}
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(grads, feed)
        peak, values = measure.peak_bytes_of(lambda: sess.run(grads, feed))
    levels = multilevel.NestedPlan(plan.kept, getattr(plan, "nested", {})).levels
    return peak / MIB, values, levels


def test_measured_peak_below_the_single_level_minimum():
    memory_mib, expected, _ = _measure("memory")
    model = _chain(LAYERS + 2)  # x, the tanh layers, the sum: the same shape of problem
    single = planners.frontier_cuts(model, [], range(LAYERS + 1)).predicted_peak_bytes
    budget = int(0.6 * single)
    with pytest.raises(mg.InfeasibleBudgetError):  # below every single-level plan
        solvers.solve_greedy(budgets.BudgetProblem(graph=model, budget_bytes=budget,
                                                   candidates=frozenset(range(LAYERS + 1))))
    nested_mib, got, levels = _measure(mg.Budget(bytes=budget, solver="revolve"))
    assert levels >= 2
    assert_grads_close(got, expected, rtol=1e-5)
    assert nested_mib < 0.75 * memory_mib, (nested_mib, memory_mib)


def test_measured_peak_inside_tf_function():
    """The control inputs hold at every depth inside tf.function too (grappler keeps them)."""
    x = tf.constant(np.random.RandomState(0).rand(ROWS, COLS).astype(np.float32))
    results = {}
    for checkpoints in ("memory", "budget:10MiB:revolve"):
        @tf.function
        def step(x, checkpoints=checkpoints):
            h = x
            for _ in range(100):
                h = tf.tanh(h)
            return mg.gradients(tf.reduce_sum(h), x, checkpoints=checkpoints)

        step(x)
        peak, values = measure.peak_bytes_of(lambda: step(x)[0].numpy())
        results[checkpoints] = (peak / MIB, values)
    (memory_mib, expected), (nested_mib, got) = results.values()
    assert_grads_close([got], [expected], rtol=1e-5)
    assert nested_mib < 0.75 * memory_mib, (nested_mib, memory_mib)


def test_single_level_solvers_fall_back_to_revolve_below_their_minimum():
    g = _chain(64)
    memory_min = budgets.score(budgets.BudgetProblem(g, 0), planners.frontier_cuts(
        g, (), range(g.num_nodes)).kept)[1]
    problem = budgets.BudgetProblem(g, int(0.6 * memory_min))
    with pytest.raises(mg.InfeasibleBudgetError):
        solvers.solve_greedy(problem)
    for solver in ("greedy", "dp"):
        plan = solvers.solve(problem, solver)
        assert plan.solver == "revolve" and plan.nested
        assert plan.predicted_peak_bytes <= problem.budget_bytes
    with pytest.raises(mg.InfeasibleBudgetError) as raised:
        solvers.solve(problem.with_budget(1000), "greedy")
    assert raised.value.min_feasible_bytes < memory_min  # the nested minimum, not "memory"'s
