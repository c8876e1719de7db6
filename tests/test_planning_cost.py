"""The shortcuts that make planning cheap (design note "planning cost") give the plans of the
reference computation they replace: the same kept set, predicted peak and cost."""

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memsave_grads import errors
from memsave_grads.core import fast_replay
from memsave_grads.core import graph as graph_lib
from memsave_grads.core import planners
from memsave_grads.core import solvers
from memsave_grads.core.solvers import problem as problem_lib
from strategies import dags, random_problem


def _reference_fits(scorer, kept):
    """Scorer.fits as it was: the full replay of every probe."""
    return scorer(kept)[1] <= scorer.problem.budget_bytes


_FAST_SCORE = fast_replay.FastReplay.score


def _reference_score(replayer, kept, costs=None, stop_above_bytes=None):
    """FastReplay.score replaying every phase, whatever bound the caller gives."""
    return _FAST_SCORE(replayer, kept, costs)


def _fresh(problem):
    """The problem on a model without the caches a run left on it (``graph.memo``)."""
    return dataclasses.replace(problem, graph=graph_lib.without_memo(problem.graph))


def _outcome(run, problem):
    """What a solver run gives: its plan's numbers, or the smallest peak its error states."""
    try:
        plan = run(_fresh(problem))
    except errors.InfeasibleBudgetError as e:
        return ("infeasible", e.min_feasible_bytes)
    if plan is None:
        return None
    return (frozenset(plan.kept), plan.predicted_peak_bytes, plan.recompute_cost, plan.levels)


def _both(run, problem, monkeypatch):
    fast = _outcome(run, problem)
    with monkeypatch.context() as patched:
        patched.setattr(problem_lib.Scorer, "fits", _reference_fits)
        patched.setattr(fast_replay.FastReplay, "score", _reference_score)
        reference = _outcome(run, problem)
    return fast, reference


def _memory(problem):
    return solvers.memory_plan(problem.graph, problem.must_keep, problem.candidates,
                               problem.not_replayed)


@pytest.mark.parametrize("seed", range(40))
def test_the_solvers_plan_as_the_reference_on_random_graphs(seed, monkeypatch):
    problem = random_problem(seed, low=20, high=60)
    plain = fast_replay.plain_peak_bytes(problem.graph)
    fast, reference = _both(_memory, problem, monkeypatch)
    assert fast == reference
    for fraction in (0.9, 0.6, 0.4):
        budgeted = problem.with_budget(int(fraction * plain))
        fast, reference = _both(solvers.solve_greedy, budgeted, monkeypatch)
        assert fast == reference, fraction


@settings(max_examples=60, deadline=None)
@given(graph=dags(min_nodes=8, max_nodes=40, gradient_flags=True),
       fraction=st.floats(0.3, 1.0))
def test_the_solvers_plan_as_the_reference_on_any_dag(graph, fraction):
    with pytest.MonkeyPatch.context() as monkeypatch:
        problem = problem_lib.BudgetProblem(graph, 0)
        fast, reference = _both(_memory, problem, monkeypatch)
        assert fast == reference
        budgeted = problem.with_budget(int(fraction * fast_replay.plain_peak_bytes(graph)))
        fast, reference = _both(solvers.solve_greedy, budgeted, monkeypatch)
        assert fast == reference


@pytest.mark.parametrize("seed", range(20))
def test_a_probe_stops_above_its_bound_with_a_lower_bound(seed):
    """``stop_above_bytes``: the replay's own peak where the plan fits under it; else a peak
    above it and not above the replay's."""
    problem = random_problem(seed, low=30, high=60)
    graph = problem.graph
    rng = random.Random(seed)
    for _ in range(10):
        kept = {v for v in problem.candidates if rng.random() < 0.3} | problem.must_keep
        kept = frozenset(graph_lib.close_segments(graph, kept))
        exact = fast_replay.FastReplay(graph, problem.not_replayed).score(kept)
        for bound in (exact[0] - 1, exact[0] // 2, exact[0], exact[0] + 1):
            probed = fast_replay.FastReplay(graph, problem.not_replayed).score(
                kept, stop_above_bytes=bound)
            assert probed[1] == exact[1]
            if exact[0] <= bound:
                assert probed[0] == exact[0]
            else:
                assert bound < probed[0] <= exact[0]


def _reference_kept_for(search, cuts):
    """CutSearch.kept_for as it was: the frontiers of the cuts swept node by node, closed by
    close_segments over the whole graph."""
    kept = set(search.must_keep)
    for live in graph_lib.frontiers(search.graph, sorted(cuts), uses=search.uses):
        kept.update(live)
    return graph_lib.close_segments(search.graph, kept)


def _with_dead_ends(graph, rng):
    """``graph`` with some of its ``y`` producers that no node reads made dead ends (nothing
    reads them, no ``y``: the top segment owns them, as close_segments says) and some nodes
    that others read made ``y`` producers too."""
    read = {p for preds in graph.inputs for p in preds}
    feeds = [(f and (v in read or v == graph.num_nodes - 1 or rng.random() < 0.5))
             or (v in read and rng.random() < 0.15)
             for v, f in enumerate(graph.feeds_sink)]
    return dataclasses.replace(graph, feeds_sink=tuple(feeds))


def test_a_read_y_meeting_a_kept_node_is_kept():
    """A ``y`` producer that a kept node also reads has two owners, the top segment and the
    kept node's segment, though no frontier keeps it (no cut): it is kept."""
    graph = graph_lib.ForwardGraph(inputs=((), (0,), (1,)), size_bytes=(4, 4, 4),
                                   reads_source=(True, False, False),
                                   feeds_sink=(False, True, True))
    search = planners.CutSearch(graph, {2}, range(3))
    assert search.kept_for(()) == {1, 2} == _reference_kept_for(search, ())


def _reference_estimates(search, cuts, kept):
    """CutSearch.quick_bytes and held_bytes as they were, node by node."""
    size = search.graph.size_bytes
    bounds = [-1, *cuts, search.graph.num_nodes - 1]
    gap = max(search.cumulative[b] - (search.cumulative[a] if a >= 0 else 0)
              for a, b in zip(bounds, bounds[1:]))
    quick = sum(size[v] for v in kept) + gap
    retained = search.retained_cumulative
    worst, previous = 0, -1
    for cut in cuts:
        held = sum(size[v] for v in kept if v <= previous)
        worst = max(worst, held + retained[cut] - (retained[previous] if previous >= 0 else 0))
        previous = cut
    top = retained[-1] - (retained[previous] if previous >= 0 else 0)
    return quick, max(worst, sum(size[v] for v in kept) + top)


@pytest.mark.parametrize("seed", range(60))
def test_the_kept_set_of_cuts_is_the_swept_one(seed):
    """The kept set of a set of cuts (frontiers, then single ownership) made with arrays and a
    sweep of the ranges where two owners meet is the one the sweep over every node makes, on
    graphs with branches, joins, dead ends, must-keep nodes and ``y`` producers that other
    nodes read; the walks' estimates of a plan's peak, made with prefix sums, are the
    node-by-node ones."""
    rng = random.Random(seed)
    problem = random_problem(seed, low=6, high=80)
    graph = _with_dead_ends(problem.graph, rng) if seed % 2 else problem.graph
    search = planners.CutSearch(graph, problem.must_keep, problem.candidates)
    n = graph.num_nodes
    for _ in range(12):
        cuts = tuple(sorted(rng.sample(range(n), rng.randint(0, min(n, 12)))))
        kept = search.kept_for(cuts)
        assert kept == _reference_kept_for(search, cuts), cuts
        assert (search.quick_bytes(cuts, kept), search.held_bytes(cuts, kept)) == \
            _reference_estimates(search, cuts, kept)
    for position in search.positions():
        assert search.kept_for((position,)) == _reference_kept_for(search, (position,))


@settings(max_examples=150, deadline=None)
@given(graph=dags(min_nodes=2, max_nodes=40), data=st.data())
def test_the_kept_set_of_cuts_is_the_swept_one_on_any_dag(graph, data):
    """The same on Hypothesis DAGs (``y`` producers that other nodes read among them), with
    any must-keep nodes and cuts."""
    n = graph.num_nodes
    must = data.draw(st.frozensets(st.integers(0, n - 1), max_size=3))
    search = planners.CutSearch(graph, must, range(n))
    cuts = tuple(sorted(data.draw(st.frozensets(st.integers(0, n - 1), max_size=8))))
    assert search.kept_for(cuts) == _reference_kept_for(search, cuts)
