"""The "memory" strategy's two steps (design note "frontier cuts", step 6): the lowest peak of
the frontier cuts, then the plan that recomputes least at that peak."""

import math

from hypothesis import example, given, settings

import numpy as np
import pytest
import tensorflow as tf

import memsave_grads as mg
from memsave_grads.core import memory_model
from memsave_grads.core.graph import ForwardGraph
from memsave_grads.core import planners
from memsave_grads.core import solvers
from memsave_grads.core.solvers import problem as problem_lib
from strategies import dags, matmul_tanh_problem
import tf_builders


def _score(graph, kept):
    return problem_lib.score(problem_lib.BudgetProblem(graph, 0), kept)


#: A DAG on which "memory" plans nested levels (found by CI's Hypothesis run, 2026-11-27).
_NESTED_BY_DEFAULT_DAG = ForwardGraph(
    inputs=((), (0,), (0,), (0,), (0,), (0,), (0,), (0,), (0,), (0, 7), (0, 4), (0, 8), (0,),
            (0,), (0,), (9,)),
    size_bytes=(1, 1, 1, 1, 25, 1, 1, 136, 304, 242, 784, 305, 1, 1, 595, 784),
    reads_source=(True,) + (False,) * 15,
    feeds_sink=(False, True, True, True, False, True, True, False, False, False, True, True,
                True, True, True, True))


@settings(max_examples=150, deadline=None)
@given(dags())
@example(_NESTED_BY_DEFAULT_DAG)
def test_never_a_higher_peak_nor_more_recomputation_than_the_cuts(g):
    """The single-level plan never peaks higher nor recomputes more than the cuts; nested levels
    (design note "nested by default") replace it only for a clearly lower peak within one
    forward pass of recomputation (they may recompute more than the cuts), else not at all."""
    cut = planners.frontier_cuts(g, must_keep=[], candidates=range(g.num_nodes))
    plan = solvers.memory_plan(g, must_keep=[], candidates=range(g.num_nodes), nested=False)
    default = solvers.memory_plan(g, must_keep=[], candidates=range(g.num_nodes))
    if cut is None:
        assert plan is None and default is None
        return
    _, cut_peak, cut_cost = _score(g, cut.kept)
    kept, peak, cost = _score(g, plan.kept)
    assert kept == plan.kept                       # closed for single ownership
    assert peak == plan.predicted_peak_bytes <= cut_peak
    assert cost == plan.recompute_cost <= cut_cost
    assert plan.planner == default.planner == "memory"
    if default.levels == 1:
        assert default.kept == plan.kept
        return
    assert default.predicted_peak_bytes <= solvers.NESTED_PEAK_FACTOR * cut.predicted_peak_bytes
    assert default.recompute_cost <= solvers.NESTED_COST_CAP_FRACTION * g.forward_cost()
    assert memory_model.plan_peak_and_cost(g, default) == (default.predicted_peak_bytes,
                                                           default.recompute_cost)


def test_recomputes_less_at_the_same_peak_on_matmul_chains(monkeypatch):
    """matmul -> tanh pairs whose gradients read as TensorFlow's do: the cut plan recomputes
    every segment but the top one; keeping matmul outputs where the peak allows costs no peak.
    (The single-level steps only: nested levels are the next test's.)"""
    monkeypatch.setattr(solvers, "NESTED_PEAK_FACTOR", 0.0)
    problem = matmul_tanh_problem(60, gradient_reads=True)
    g, candidates = problem.graph, problem.candidates
    cut = planners.frontier_cuts(g, [], candidates)
    plan = solvers.memory_plan(g, [], candidates)
    _, cut_peak, cut_cost = _score(g, cut.kept)
    assert plan.predicted_peak_bytes <= cut_peak < memory_model.plain_peak_bytes(g)
    assert plan.recompute_cost < cut_cost
    assert "recomputes least" in plan.reason


def test_nested_levels_where_they_predict_clearly_less_for_one_forward_pass():
    """Design note "nested by default": on this chain a nested plan predicts at most 0.9x the
    single-level peak and recomputes no more than one forward pass, so "memory" plans it; the
    replay of the plan agrees with what the plan says."""
    problem = matmul_tanh_problem(60, gradient_reads=True)
    g, candidates = problem.graph, problem.candidates
    cut = planners.frontier_cuts(g, [], candidates)
    plan = solvers.memory_plan(g, [], candidates)
    assert plan.levels > 1 and plan.planner == "memory"
    assert plan.predicted_peak_bytes <= solvers.NESTED_PEAK_FACTOR * cut.predicted_peak_bytes
    assert plan.recompute_cost <= g.forward_cost()
    assert memory_model.plan_peak_and_cost(g, plan) == (plan.predicted_peak_bytes,
                                                        plan.recompute_cost)


def test_the_same_graph_always_gets_the_same_plan(monkeypatch):
    """Bounded by plans scored, not by seconds: a slow machine plans as a fast one."""
    problem = matmul_tanh_problem(80, gradient_reads=True)
    first = solvers.memory_plan(problem.graph, [], problem.candidates)
    clock = iter(range(0, 10**9, 1000))   # every reading of the clock 1000 s later
    monkeypatch.setattr(problem_lib.time, "perf_counter", lambda: float(next(clock)))
    assert solvers.memory_plan(problem.graph, [], problem.candidates).kept == first.kept


def test_gradients_equal_tf_gradients_on_a_conv_stack():
    """The refined plan keeps tensors inside segments: the gradients stay tf.gradients'."""
    with tf.Graph().as_default():
        rng = np.random.default_rng(0)
        x = tf.constant(rng.standard_normal((4, 16, 16, 8)), tf.float32)
        h, variables = x, []
        for i in range(8):
            w = tf.Variable(rng.standard_normal((3, 3, 8, 8)) * 0.2, dtype=tf.float32,
                            name=f"w{i}")
            variables.append(w)
            h = h + tf.nn.relu(tf.nn.conv2d(tf.tanh(h), w, 1, "SAME"))
        loss = tf.reduce_sum(h * h)
        report = mg.explain(loss, variables, checkpoints="memory")
        ours = mg.gradients(loss, variables, checkpoints="memory")
        theirs = tf.gradients(loss, variables)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            ours, theirs = session.run([ours, theirs])
    assert report.predicted_peak_bytes < report.predicted_plain_peak_bytes
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_a_step_traced_again_is_not_planned_again(monkeypatch):
    """The same forward pass traced again (as Keras traces a training step again) is planned
    once per strategy, and its gradients are the first trace's; another depth, another batch
    size (other tensor sizes) or another strategy or budget is planned anew."""
    from memsave_grads._tf import selection  # pylint: disable=import-outside-toplevel
    selection._PLANS.clear()
    planned = []
    make_plan = selection._make_plan
    monkeypatch.setattr(selection, "_make_plan", lambda ctx, checkpoints: planned.append(
        (len(ctx.region), checkpoints)) or make_plan(ctx, checkpoints))
    rng = np.random.RandomState(0)
    weights = [tf.constant(rng.randn(32, 32).astype(np.float32) * 0.2) for _ in range(12)]

    def traced(depth, batch=16, checkpoints="memory"):
        x = tf.constant(np.random.RandomState(1).randn(batch, 32).astype(np.float32))

        @tf.function
        def step(x):
            h = x
            for w in weights[:depth]:
                h = h + tf.tanh(h @ w)
            return mg.gradients(tf.reduce_sum(h * h), [x], checkpoints=checkpoints)[0]
        return step(x).numpy()

    first, second = traced(12), traced(12)
    assert len(planned) == 1
    np.testing.assert_array_equal(first, second)
    for count, (depth, batch, checkpoints) in enumerate(
            [(10, 16, "memory"), (12, 8, "memory"), (12, 16, "budget:50%"),
             (12, 16, "budget:40%"), (12, 16, "budget:40%:dp")], start=2):
        traced(depth, batch, checkpoints)
        assert len(planned) == count, (depth, batch, checkpoints)
    traced(12, 16, "budget:50%")  # made before: not again
    assert len(planned) == 6


@pytest.mark.parametrize("blocks", [16, 64, 144])
def test_a_residual_chain_is_planned_at_the_single_level_bound(blocks):
    """Issue 36, item 3: on a chain of N residual blocks, "memory" predicts within 1.1x of the
    single-level bound, 2 sqrt(N) activations plus the working set (design note "tapered
    cuts"). A block retains two activations for its backward pass (its input and its tanh);
    the working set is what plain tf.gradients holds beyond those, the same for every plan.
    Evenly spaced cuts stay above the bound by a growing factor (1.13x, 1.21x, 1.26x here)."""
    width, batch = 256, 64
    activation_bytes = width * batch * 4
    with tf.Graph().as_default():
        h = tf.random.normal([batch, width], seed=1)
        weights = [tf.Variable(tf.random.normal([width, width], stddev=0.05, seed=i))
                   for i in range(blocks)]
        loss = tf.reduce_sum(tf_builders.residual_tanh_mlp(h, weights) ** 2)
        report = mg.explain(loss, weights, checkpoints="memory")
    working_set_bytes = report.predicted_plain_peak_bytes - 2 * blocks * activation_bytes
    bound_bytes = 2 * math.sqrt(blocks) * activation_bytes + working_set_bytes
    assert working_set_bytes > 0
    assert report.predicted_peak_bytes <= 1.1 * bound_bytes, (
        report.predicted_peak_bytes / bound_bytes, report.plan_reason)
    assert report.recompute_fraction <= 1.0   # one extra forward pass at most


def test_a_step_traced_again_is_not_replayed_again_by_the_never_worse_rule(monkeypatch):
    """The never-worse rule's predicted peaks are kept like the plans: the same forward pass
    traced again decides without replaying the memory model, and decides the same; another
    batch size (other tensor sizes) is replayed anew."""
    from memsave_grads._tf import selection  # pylint: disable=import-outside-toplevel
    selection._PREDICTED_PEAKS.clear()
    monkeypatch.setattr(selection, "NEVER_WORSE_RULE", True)  # off for the other tests
    replayed, decisions = [], []
    replay, decide = selection._replayed_peaks, selection.decide_schedule
    monkeypatch.setattr(selection, "_replayed_peaks", lambda *args: replayed.append(
        args[-1]) or replay(*args))
    monkeypatch.setattr(selection, "decide_schedule", lambda *args: decisions.append(
        decide(*args)) or decisions[-1])
    rng = np.random.RandomState(0)
    weights = [tf.constant(rng.randn(32, 32).astype(np.float32) * 0.2) for _ in range(12)]

    def traced(batch):
        x = tf.constant(np.random.RandomState(1).randn(batch, 32).astype(np.float32))

        @tf.function
        def step(x):
            h = x
            for w in weights:
                h = h + tf.tanh(h @ w)
            return mg.gradients(tf.reduce_sum(h * h), [x], checkpoints="memory")[0]
        return step(x).numpy()

    traced(16)
    first = len(replayed)
    assert first >= 1
    traced(16)
    assert len(replayed) == first
    assert decisions[0] == decisions[1]
    traced(8)
    assert len(replayed) > first


def test_build_time_measures_first_builds_that_plan(monkeypatch):
    """``build-time`` rebuilds the same graph for every measurement; the plans kept across
    retraces would make every build after the first skip planning, so it forgets them: each
    build plans."""
    from memsave_grads._tf import selection  # pylint: disable=import-outside-toplevel
    from memsave_grads.bench import build_time  # pylint: disable=import-outside-toplevel
    planned = []
    make_plan = selection._make_plan
    monkeypatch.setattr(selection, "_make_plan", lambda ctx, checkpoints: planned.append(
        checkpoints) or make_plan(ctx, checkpoints))
    spec = build_time.residual_mlp(8)
    for _ in range(3):
        build_time._build_once(spec, "memory")
    assert len(planned) == 3
    selection.forget_plans()
