"""Memory budgets: the Budget spec, the solvers' contract, infeasible budgets, parity."""

import numpy as np
import pytest
import tensorflow as tf

import memsave_grads as mg
from conftest import assert_grads_close
from graphs import BUILDERS
from memsave_grads.bench import solvers as bench_solvers
from memsave_grads.core import budgets
from memsave_grads.core import plan as plan_lib
from memsave_grads.core.solvers import problem as problem_lib
from memsave_grads.core import memory_model
from memsave_grads.core import solvers
from strategies import matmul_tanh_problem
from tf_builders import residual_tanh_mlp

MIB = 2**20


# --------------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("budget:4GiB", mg.Budget(bytes=4 * 2**30)),
    ("budget:512MB", mg.Budget(bytes=512 * 10**6)),
    ("budget:1.5kib", mg.Budget(bytes=1536)),
    ("budget:60%", mg.Budget(fraction=0.6)),
    ("budget:0.35", mg.Budget(fraction=0.35)),
    ("budget:60%:milp", mg.Budget(fraction=0.6, solver="milp")),
    ("budget:2GiB:dp", mg.Budget(bytes=2 * 2**30, solver="dp")),
])
def test_budget_strings(text, expected):
    assert mg.Budget.parse(text) == expected


@pytest.mark.parametrize("text, words", [
    ("budget:5", ["no unit", "fraction"]),
    ("budget:4XB", ["unknown unit", "'XB'"]),
    ("budget:lots", ["malformed budget", "Examples"]),
    ("budget:150%", ["fraction", "(0, 1]"]),
    ("budget:50%:annealing", ["unknown solver", "'annealing'"]),
])
def test_malformed_budget_strings(text, words):
    with pytest.raises(mg.InvalidArgumentError) as info:
        mg.Budget.parse(text)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("kwargs, words", [
    ({}, ["exactly one of bytes= or fraction="]),
    ({"bytes": 10, "fraction": 0.5}, ["exactly one"]),
    ({"bytes": -1}, ["Budget.bytes", "positive"]),
    ({"fraction": 0.0}, ["Budget.fraction", "(0, 1]"]),
    ({"fraction": True}, ["Budget.fraction"]),
])
def test_budget_validation(kwargs, words):
    with pytest.raises(mg.InvalidArgumentError) as info:
        mg.Budget(**kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("text, got", [("budget:150%", "got 1.5"), ("budget:0%", "got 0.0"),
                                       ("budget:0.5B", "got 0")])
def test_an_out_of_range_budget_string_is_named_as_written(text, got):
    with pytest.raises(mg.InvalidArgumentError) as info:
        mg.Budget.parse(text)
    assert f"budget {text!r}" in str(info.value) and got in str(info.value)


def test_a_budget_names_exactly_the_registered_solvers():
    """Budget validates solver names without importing the solvers (no import cycle): the two
    lists must agree."""
    assert budgets.SOLVER_NAMES == tuple(solvers.SOLVERS)


def test_calibrated_costs_use_measured_seconds_and_scale_the_rest():
    costs = budgets.calibrated_costs(["a", "b", "c"], [100.0, 200.0, 50.0], {"a": 1e-3, "b": 4e-3})
    assert costs[0] == pytest.approx(1e-3) and costs[1] == pytest.approx(4e-3)
    assert costs[2] == pytest.approx(50 * np.median([1e-5, 2e-5]))
    assert budgets.calibrated_costs(["a"], [3.0], {}) == (3.0,)


def test_measured_seconds_of_another_graph_say_so(caplog):
    """Names that match no op of the graph (a profile of another graph) leave the FLOP
    estimates, with a warning rather than silently."""
    caplog.set_level("WARNING", logger="memsave_grads")
    assert budgets.calibrated_costs(["a", "b"], [3.0, 4.0], {"z": 1e-3}) == (3.0, 4.0)
    assert any("names none of this graph's 2 forward ops" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("fraction, text", [(0.5, "50%"), (0.005, "0.5%"), (1 / 3, "33.3%")])
def test_a_budget_describes_its_fraction_without_rounding_it_away(fraction, text):
    assert mg.Budget(fraction=fraction).describe().startswith(f"budget {text} ")


# --------------------------------------------------------------------------------------------
# Solvers (TensorFlow-free models)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("solver", sorted(solvers.SOLVERS))
@pytest.mark.parametrize("fraction", [0.8, 0.5, 0.3])
def test_every_solver_fits_the_budget(solver, fraction):
    problem = matmul_tanh_problem(40)
    plain = memory_model.plain_peak_bytes(problem.graph)
    plan = solvers.solve(problem.with_budget(int(fraction * plain)), solver)
    assert plan.predicted_peak_bytes <= int(fraction * plain)
    _, peak, cost = problem_lib.score(problem, plan.kept)
    assert (peak, cost) == (plan.predicted_peak_bytes, plan.recompute_cost)


@pytest.mark.parametrize("solver", sorted(solvers.SOLVERS))
def test_a_roomy_budget_recomputes_nothing(solver):
    problem = matmul_tanh_problem(40)
    plan = solvers.solve(problem.with_budget(10 * memory_model.plain_peak_bytes(problem.graph)),
                         solver)
    assert plan.recompute_cost == 0


@pytest.mark.parametrize("solver", sorted(solvers.SOLVERS))
def test_infeasible_budget_states_a_feasible_minimum(solver):
    problem = matmul_tanh_problem(40)
    with pytest.raises(mg.InfeasibleBudgetError) as info:
        solvers.solve(problem.with_budget(1000), solver)
    minimum = info.value.min_feasible_bytes
    assert minimum > 1000 and budgets.format_bytes(minimum) in str(info.value)
    assert "Raise the budget" in str(info.value)
    plan = solvers.solve(problem.with_budget(minimum), solver)  # the promise holds
    assert plan.predicted_peak_bytes <= minimum


@pytest.mark.parametrize("solver", ["greedy", "dp", "revolve"])
def test_every_infeasible_budget_states_the_same_minimum(solver):
    """The minimum an infeasible budget's error states does not depend on the budget asked
    (it did: on the demo net 'budget:10%' said 14 MiB and 'budget:8%' 16 MiB), and a budget
    of that minimum is met."""
    problem = matmul_tanh_problem(300)
    plain = memory_model.plain_peak_bytes(problem.graph)
    stated = set()
    for share in (0.015, 0.01, 0.005, 0.001):
        try:
            solvers.solve(problem.with_budget(int(share * plain)), solver)
        except mg.InfeasibleBudgetError as e:
            stated.add(e.min_feasible_bytes)
    [minimum] = stated
    assert solvers.solve(problem.with_budget(minimum), solver).predicted_peak_bytes <= minimum


@pytest.mark.parametrize("blocks, percents", [
    # Met down to 11%; the smallest peak is 10.3% of plain tf.gradients' (measured).
    pytest.param(32, (11, 10, 6, 1), id="32_blocks"),
    # The network of the report; each plan of it costs 10-30 s on a busy 2-core machine.
    pytest.param(64, (9, 8, 6, 1), id="64_blocks", marks=pytest.mark.slow)])
def test_every_infeasible_budget_of_a_network_states_the_same_minimum(blocks, percents):
    """The same through gradients() on a residual MLP (before, with 64 blocks: 'budget:9%' said
    96 KiB and 'budget:6%' 200 KiB, while 'budget:8%' was met)."""
    minimums, met = set(), []
    for percent in percents:
        with tf.Graph().as_default():
            x = tf.constant(np.random.RandomState(0).randn(32, 64).astype(np.float32))
            weights = [tf.constant(np.random.RandomState(i).randn(64, 64).astype(np.float32))
                       for i in range(1, blocks + 1)]
            loss = tf.reduce_sum(residual_tanh_mlp(x, weights) ** 2)
            try:
                mg.gradients(loss, weights, checkpoints=f"budget:{percent}%", fallback="error")
                met.append(percent)
            except mg.InfeasibleBudgetError as e:
                minimums.add(e.min_feasible_bytes)
                plain = e.plain_peak_bytes
    [minimum] = minimums
    assert all(percent / 100 * plain >= minimum for percent in met)
    with tf.Graph().as_default():
        x = tf.constant(np.random.RandomState(0).randn(32, 64).astype(np.float32))
        weights = [tf.constant(np.random.RandomState(i).randn(64, 64).astype(np.float32))
                   for i in range(1, blocks + 1)]
        loss = tf.reduce_sum(residual_tanh_mlp(x, weights) ** 2)
        report = mg.explain(loss, weights, checkpoints=mg.Budget(bytes=minimum))
        assert report.predicted_peak_bytes <= minimum


def test_the_greedy_solver_finds_the_single_level_plan_its_first_seed_just_misses(graph):
    """A 48-layer tanh chain (1 MiB activations) at 35% of its plain peak: the greedy solver's
    first DP seed overshoots the budget by a few KiB in the replay. Its retries asked for that
    overshoot less each time, less than the DP's rounding of bytes, so the same plan came back
    until the retries ran out; the solver then fell back to 46 nested levels at 27x the
    recomputation of the single-level plan that fits."""
    from memsave_grads.bench import graphs
    loss, weights = graphs.mlp(depth=48, width=1024, batch=256, residual=False)
    report = mg.explain(loss, weights, checkpoints="budget:35%")
    assert report.planner == "greedy", report.planner
    assert max(lv.depth for lv in report.levels) == 1
    assert report.recompute_fraction < 1.0, report.recompute_fraction


def test_tighter_budgets_cost_more():
    problem = matmul_tanh_problem(60)
    plain = memory_model.plain_peak_bytes(problem.graph)
    costs = [solvers.solve(problem.with_budget(int(f * plain)), "dp").recompute_cost
             for f in (0.9, 0.6, 0.4, 0.25)]
    assert costs == sorted(costs) and costs[-1] > costs[0]


def test_tradeoff_is_a_pareto_front():
    problem = matmul_tanh_problem(60)
    front = solvers.tradeoff(problem, points=8)
    assert len(front) >= 3
    peaks = [p.predicted_peak_bytes for p in front]
    costs = [p.recompute_cost for p in front]
    assert peaks == sorted(peaks) and costs == sorted(costs, reverse=True)
    assert costs[-1] == 0  # the roomiest budget: plain tf.gradients


#: The comparison's budgets (fractions of tf.gradients' peak). Most of its time is milp's:
#: about 100 s for both budgets, half of it the residual MLP's two rows, where milp searches to
#: its 30 s deadline without a proof. The default suite compares at the first budget (all four
#: graphs, the same assertions); the slow one at both.
COMPARED_FRACTIONS = (0.6, 0.45)


@pytest.fixture(scope="module", params=[
    # ~38 s (milp on four graphs): test_solvers.py's greedy-vs-proven-optimum checks stay.
    pytest.param(COMPARED_FRACTIONS[:1], id="one_budget", marks=pytest.mark.slow),
    pytest.param(COMPARED_FRACTIONS, id="both_budgets", marks=pytest.mark.slow)])
def small_graph_rows(request):
    return bench_solvers.compare(fractions=request.param)


def test_greedy_is_near_the_exact_solvers(small_graph_rows):
    """The issue's target (within 10% of the optimum) on graphs of <= 200 ops: met on most rows
    (docs/budgets.md lists the misses); single-level plans never worse than 1.5x, always within
    the budget."""
    report = bench_solvers.comparison_table(small_graph_rows)
    within = 0
    for row in small_graph_rows:
        assert row.forward_ops <= 200, report
        greedy = row.plans["greedy"]
        if not isinstance(greedy, plan_lib.Plan):
            continue
        assert greedy.predicted_peak_bytes <= row.budget_bytes
        best = bench_solvers.best_cost(row)
        if greedy.children:  # no single-level plan found: the revolve fallback, counted a miss
            continue
        assert greedy.recompute_cost <= 1.5 * best + 1e-9, report
        within += greedy.recompute_cost <= 1.10 * best + 1e-9
    assert within >= 0.75 * len(small_graph_rows), report


def test_a_proven_milp_optimum_is_never_beaten(small_graph_rows):
    """milp's ``optimal`` flag claims no plan recomputes less: no other solver's plan may."""
    report = bench_solvers.comparison_table(small_graph_rows)
    proven = 0
    for row in small_graph_rows:
        milp = row.plans["milp"]
        if isinstance(milp, plan_lib.Plan) and milp.optimal:
            proven += 1
            assert milp.recompute_cost <= bench_solvers.best_cost(row) + 1e-9, report
    assert proven >= len(small_graph_rows) // 2, report


# --------------------------------------------------------------------------------------------
# Through gradients()
# --------------------------------------------------------------------------------------------


def _mlp(batch=64, width=128, depth=12):
    x = tf.compat.v1.placeholder(tf.float32, [batch, width])
    weights = [tf.Variable(tf.random.stateless_normal([width, width], [i, 0], stddev=0.08))
               for i in range(depth)]
    h = residual_tanh_mlp(x, weights)
    return x, tf.reduce_sum(h * h), weights


@pytest.mark.parametrize("checkpoints", [
    "budget:70%", "budget:45%", mg.Budget(fraction=0.5, solver="dp"),
    mg.Budget(fraction=0.7, solver="milp"), "budget:400KiB"])
def test_budget_gradients_equal_tf_gradients(checkpoints, graph, session):
    x, loss, weights = _mlp()
    expected = tf.gradients(loss, weights)
    report = mg.explain(loss, weights, checkpoints=checkpoints)
    actual = mg.gradients(loss, weights, checkpoints=checkpoints)
    assert report.budget_bytes is not None
    assert report.predicted_peak_bytes <= report.budget_bytes
    session.run(tf.compat.v1.global_variables_initializer())
    feed = {x: np.random.RandomState(0).rand(64, 128).astype(np.float32)}
    got, want = session.run([actual, expected], feed)
    assert_grads_close(got, want)


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_budget_parity_on_the_graph_catalogue(builder, graph, session):
    case = BUILDERS[builder]()
    expected = tf.gradients(case.ys, case.xs, case.grad_ys, **case.kwargs)
    try:
        actual = mg.gradients(case.ys, case.xs, case.grad_ys, checkpoints="budget:50%",
                              **case.kwargs)
    except mg.InfeasibleBudgetError as e:  # tiny graphs: use the smallest feasible budget,
        # in bytes where it exceeds tf.gradients' own predicted peak (kept outputs are held
        # longer), which needs static shapes.
        plain = mg.explain(case.ys, case.xs, checkpoints="memory",
                           **case.kwargs).predicted_plain_peak_bytes
        budget = (mg.Budget(fraction=1.01 * e.min_feasible_bytes / plain)
                  if 1.01 * e.min_feasible_bytes <= plain else
                  mg.Budget(bytes=e.min_feasible_bytes))
        actual = mg.gradients(case.ys, case.xs, case.grad_ys, checkpoints=budget, **case.kwargs)
    except mg.NoCheckpointsFoundError:
        pytest.skip("nothing to keep on this graph")
    session.run(tf.compat.v1.global_variables_initializer())
    dense = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in actual]
    dense_ref = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in expected]
    got, want = session.run([[g for g in dense if g is not None],
                             [g for g in dense_ref if g is not None]], case.feed)
    assert_grads_close(got, want)


def test_infeasible_budget_error_adds_no_ops(graph):
    _, loss, weights = _mlp()
    before = len(graph.get_operations())
    with pytest.raises(mg.InfeasibleBudgetError) as info:
        mg.gradients(loss, weights, checkpoints="budget:1KiB", fallback="error")
    assert len(graph.get_operations()) == before
    assert isinstance(info.value, ValueError) and "budget of 1 KiB" in str(info.value)
    feasible = mg.Budget(bytes=info.value.min_feasible_bytes)
    assert mg.explain(loss, weights, checkpoints=feasible).predicted_peak_bytes <= feasible.bytes


def test_byte_budget_needs_static_shapes(graph):
    x = tf.compat.v1.placeholder(tf.float32, [None, 32])
    w = tf.Variable(tf.ones([32, 32]))
    h = x
    for _ in range(6):
        h = tf.tanh(h @ w)
    loss = tf.reduce_sum(h)
    with pytest.raises(mg.InvalidArgumentError,
                       match="unknown dimensions.*assume_batch_size.*fraction"):
        mg.gradients(loss, [w], checkpoints="budget:1MiB")
    assert mg.gradients(loss, [w], checkpoints="budget:100%")[0] is not None


def test_budget_through_patch(graph):
    _, loss, weights = _mlp()
    with mg.patch(checkpoints="budget:50%"):
        grads = tf.gradients(loss, weights)
    unpatched = tf.gradients(loss, weights)
    assert len(graph.get_operations()) > 0 and all(g is not None for g in grads)
    assert [g.name for g in grads] != [g.name for g in unpatched]


def test_profile_calibrates_costs(graph, session):
    x, loss, weights = _mlp()
    grads = tf.gradients(loss, weights)
    session.run(tf.compat.v1.global_variables_initializer())
    feed = {x: np.zeros([64, 128], np.float32)}
    for runs in (0, -1, 1.5, True):
        with pytest.raises(mg.MemsaveGradsError, match="runs: expected an int >= 1"):
            mg.profile_op_seconds(session, grads, feed_dict=feed, runs=runs)
    with pytest.raises(mg.InvalidTypeError, match="session: expected a tf.compat.v1.Session"):
        mg.profile_op_seconds(None, grads, feed_dict=feed)
    seconds = mg.profile_op_seconds(session, grads, feed_dict=feed, runs=2)
    assert any(name.endswith("MatMul") for name in seconds) and all(
        s >= 0 for s in seconds.values())
    report = mg.explain(loss, weights, checkpoints=mg.Budget(fraction=0.5, op_seconds=seconds))
    assert report.predicted_peak_bytes <= report.budget_bytes


def test_malformed_budget_string_fails_at_patch_time():
    with pytest.raises(mg.InvalidArgumentError, match="malformed budget"):
        mg.patch(checkpoints="budget:lots")
    assert not mg.is_patched()


def test_milp_without_scipy_says_how_to_install(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "scipy", None)  # import scipy now raises ImportError
    with pytest.raises(mg.MissingDependencyError, match="pip install scipy"):
        solvers.solve(matmul_tanh_problem(40).with_budget(10**9), "milp")
