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
from memsave_grads import api
from memsave_grads.core import plan as plan_lib
from memsave_grads.core.solvers import problem as problem_lib
from memsave_grads.core import graph as graph_lib
from memsave_grads import measure
from memsave_grads.core import memory_model
from memsave_grads.core import multilevel
from memsave_grads.core import planners
from memsave_grads.core import solvers
from strategies import dags, tanh_chain
from tf_builders import residual_tanh_mlp, tanh_layers

MIB = measure.MIB


# --------------------------------------------------------------------------------------------
# The rewrite: gradients of 2- and 3-level plans equal tf.gradients
# --------------------------------------------------------------------------------------------


def _nested_gradients(ys, xs, levels):
    """mg.gradients with a balanced nested plan of ``levels`` levels."""
    prepared = api.prepare(ys, xs, None, "memory", {}, select=False)
    ctx = prepared.selection
    candidates, must_keep, not_replayed = ctx.node_sets()
    plan = multilevel.balanced_plan(ctx.model, must_keep, candidates, levels, not_replayed)
    assert plan.levels == levels
    grads = api.run_plan(prepared, plan)
    # A copy at depth d is named after the copy it copies, inside that level's "nested" scope:
    # 1 + 2 + ... + (d - 1) "nested" scopes in its name.
    depth = max((op.name.count("/nested/") for op in prepared.graph.get_operations()), default=0)
    assert depth == (levels - 1) * levels // 2, f"{levels} levels, nested scopes {depth}"
    return grads


def _weights(shapes, seed=0):
    rng = np.random.RandomState(seed)
    return [tf.Variable((rng.randn(*s) / np.sqrt(s[-2])).astype(np.float32)) for s in shapes]


def _tanh_chain(ws, x):
    h = tanh_layers(x, 30, scale=1.1)
    return tf.reduce_sum(h * h)


def _residual_mlp(ws, x):
    h = residual_tanh_mlp(x, ws)
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
        single = api.prepare(y, xs, None, "memory", {}).plan.predicted_peak_bytes
        budget = mg.Budget(bytes=int(0.7 * single), solver="revolve")
        plan = api.prepare(y, xs, None, budget, {}).plan
        assert plan.predicted_peak_bytes <= budget.bytes
        assert plan.levels >= 2
        got = mg.gradients(y, xs, checkpoints=budget)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            expected_v, got_v = sess.run([expected, got])
    assert_grads_close(got_v, expected_v, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# The replay
# --------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(dags(min_nodes=3, max_nodes=18, min_size_bytes=0, max_size_bytes=9, max_extra_sinks=0,
            gradient_flags=True), st.data())
def test_sub_plans_that_keep_nothing_replay_as_one_level(g, data):
    """A level whose segments have sub-plans keeping nothing is an ordinary level: the nested
    path (Schedule.nested) gives the single-level peak and cost exactly."""
    kept = data.draw(st.sets(st.integers(0, g.num_nodes - 1)))
    closed = graph_lib.close_segments(g, kept)
    trivial = plan_lib.Plan(closed, children={k: plan_lib.Plan(frozenset()) for k in closed})
    assert memory_model.plan_peak_and_cost(g, trivial) == \
        memory_model.plan_peak_and_cost(g, plan_lib.Plan(closed))


@settings(max_examples=60, deadline=None)
@given(dags(min_nodes=3, max_nodes=18, min_size_bytes=0, max_size_bytes=9, max_extra_sinks=0,
            gradient_flags=True), st.data())
def test_a_capped_replay_answers_as_the_full_one(g, data):
    """``stop_above_bytes``: a plan peaking at most the cap gets the full replay's peak and
    cost; one above it a peak above the cap (where the replay stopped), nested levels
    included."""
    kept = graph_lib.close_segments(g, data.draw(st.sets(st.integers(0, g.num_nodes - 1))))
    inner = data.draw(st.sets(st.sampled_from(sorted(kept)))) if kept else set()
    plan = plan_lib.Plan(kept, children={k: plan_lib.Plan(frozenset()) for k in inner})
    peak, cost = memory_model.plan_peak_and_cost(g, plan)
    cap = data.draw(st.integers(0, peak + 2))
    capped = memory_model.plan_peak_and_cost(g, plan, stop_above_bytes=cap)
    if peak <= cap:
        assert capped == (peak, cost)
    else:
        assert cap < capped[0] <= peak and capped[1] <= cost


def test_one_level_cost_equals_budgets_score_on_a_chain():
    g = tanh_chain(40, MIB)
    plan = planners.frontier_cuts(g, [], range(39))
    problem = problem_lib.BudgetProblem(graph=g, budget_bytes=1)
    _, peak, cost = problem_lib.score(problem, plan.kept)
    assert memory_model.plan_peak_and_cost(g, plan_lib.Plan(plan.kept)) == (peak, cost)


def test_deeper_plans_need_less_memory_and_more_compute_on_a_chain():
    g = tanh_chain(256, MIB)
    results = [memory_model.plan_peak_and_cost(g, multilevel.balanced_plan(g, [], range(255), levels))
               for levels in (1, 2, 3)]
    # balanced plans are not tuned; compare the DP's instead
    plans = [solvers.solve_revolve(problem_lib.BudgetProblem(graph=g, budget_bytes=b * MIB))
             for b in (34, 16, 12)]
    levels = [p.levels for p in plans]
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
    g = tanh_chain(n, MIB)
    problem = problem_lib.BudgetProblem(graph=g, budget_bytes=10**12,
                                    candidates=frozenset(range(n - 1)))
    search = planners.CutSearch(g, [], problem.candidates)
    positions = [p for p in range(n) if search.allowed[p]]
    scored = []
    for tree in _trees(-1, n - 1, positions):
        plan = multilevel.plan_from_tree(g, search, tree)
        scored.append(memory_model.plan_peak_and_cost(g, plan))
    smallest = min(peak for peak, _ in scored)
    for budget in sorted({peak for peak, _ in scored}):
        best = min(cost for peak, cost in scored if peak <= budget)
        plan = solvers.solve_revolve(problem.with_budget(budget))
        assert plan.predicted_peak_bytes <= budget
        assert plan.recompute_cost == best, (budget, plan)
    with pytest.raises(mg.InfeasibleBudgetError) as info:
        solvers.solve_revolve(problem.with_budget(smallest - 1))
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
        y = tf.reduce_sum(tanh_layers(x, LAYERS))
        grads = mg.gradients(y, x, checkpoints=checkpoints)
        plan = api.prepare(y, x, None, checkpoints, {}).plan
    feed = {x: np.random.RandomState(0).rand(ROWS, COLS).astype(np.float32)}
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(grads, feed)
        peak, values = measure.peak_bytes_of(lambda: sess.run(grads, feed))
    levels = plan.levels
    return peak / MIB, values, levels


def test_measured_peak_below_the_single_level_minimum():
    memory_mib, expected, _ = _measure("memory")
    model = tanh_chain(LAYERS + 2, MIB)  # x, the tanh layers, the sum: the same shape of problem
    single = planners.frontier_cuts(model, [], range(LAYERS + 1)).predicted_peak_bytes
    budget = int(0.6 * single)
    with pytest.raises(mg.InfeasibleBudgetError):  # below every single-level plan
        solvers.solve_greedy(problem_lib.BudgetProblem(graph=model, budget_bytes=budget,
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
            return mg.gradients(tf.reduce_sum(tanh_layers(x, 100)), x, checkpoints=checkpoints)

        step(x)
        peak, values = measure.peak_bytes_of(lambda: step(x)[0].numpy())
        results[checkpoints] = (peak / MIB, values)
    (memory_mib, expected), (nested_mib, got) = results.values()
    assert_grads_close([got], [expected], rtol=1e-5)
    assert nested_mib < 0.75 * memory_mib, (nested_mib, memory_mib)


def test_single_level_solvers_fall_back_to_revolve_below_their_minimum():
    g = tanh_chain(64, MIB)
    memory_min = problem_lib.score(problem_lib.BudgetProblem(g, 0), planners.frontier_cuts(
        g, (), range(g.num_nodes)).kept)[1]
    problem = problem_lib.BudgetProblem(g, int(0.6 * memory_min))
    with pytest.raises(mg.InfeasibleBudgetError):
        solvers.solve_greedy(problem)
    for solver in ("greedy", "dp"):
        plan = solvers.solve(problem, solver)
        assert plan.planner == "revolve" and plan.children
        assert plan.predicted_peak_bytes <= problem.budget_bytes
    with pytest.raises(mg.InfeasibleBudgetError) as raised:
        solvers.solve(problem.with_budget(1000), "greedy")
    assert raised.value.min_feasible_bytes < memory_min  # the nested minimum, not "memory"'s
