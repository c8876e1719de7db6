"""The fast replay gives memory_model.replay's peak and problem.score's cost, plan for plan."""

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memsave_grads.core import fast_replay
from memsave_grads.core import graph as graph_lib
from memsave_grads.core import memory_model
from memsave_grads.core import schedule as schedule_lib
from memsave_grads.core.solvers import problem as problem_lib
from strategies import dags, random_problem


def _replayed(graph, kept, not_replayed, workspace=None):
    sched = schedule_lib.build(graph, kept, not_replayed)
    cost = sum(graph.cost_of(v) for v in sched.recomputed_nodes())
    return memory_model.replay(graph, sched, workspace)[0], cost


@pytest.mark.parametrize("seed", range(60))
def test_same_peak_and_cost_as_the_replay_on_random_plans(seed):
    """Seeded random DAGs (branches, views, variables, elementwise buffers, never-replayed
    nodes), many closed kept sets each, one replayer per graph so that its caches are shared
    between plans as in a search."""
    problem = random_problem(seed, low=8, high=40)
    graph, rng = problem.graph, random.Random(seed)
    workspace = [rng.choice([0, 0, 5, 20]) for _ in range(graph.num_nodes)] if seed % 2 else None
    fast = fast_replay.FastReplay(graph, problem.not_replayed, workspace)
    for _ in range(25):
        share = rng.random()
        kept = {v for v in problem.candidates if rng.random() < share} | problem.must_keep
        kept = graph_lib.close_segments(graph, kept)
        expected_peak, expected_cost = _replayed(graph, kept, problem.not_replayed, workspace)
        peak, cost = fast.score(kept)
        assert peak == expected_peak, sorted(kept)
        assert cost == pytest.approx(expected_cost)


@pytest.mark.parametrize("seed", range(20))
def test_function_ops_bytes_get_the_replay_s_numbers(seed):
    """Graphs with conds, loops or calls (internal saved and exposed bytes, design note
    "control flow and calls"): the same numbers as the full replay."""
    problem = random_problem(seed, low=8, high=30)
    rng = random.Random(seed)
    n = problem.graph.num_nodes
    graph = dataclasses.replace(
        problem.graph, internal_saved_bytes=tuple(rng.choice([0, 0, 7, 30]) for _ in range(n)),
        exposed_bytes=tuple(rng.choice([0, 0, 0, 11]) for _ in range(n)))
    fast = fast_replay.FastReplay(graph, problem.not_replayed)
    for _ in range(10):
        kept = {v for v in problem.candidates if rng.random() < 0.3} | problem.must_keep
        kept = graph_lib.close_segments(graph, kept)
        assert fast.score(kept) == pytest.approx(_replayed(graph, kept, problem.not_replayed))


@settings(max_examples=150, deadline=None)
@given(graph=dags(max_nodes=30, gradient_flags=True), data=st.data())
def test_same_peak_as_the_replay_on_any_dag(graph, data):
    kept = data.draw(st.sets(st.integers(0, graph.num_nodes - 1)))
    kept = graph_lib.close_segments(graph, kept)
    assert fast_replay.FastReplay(graph).peak_bytes(kept) == _replayed(graph, kept, ())[0]


@settings(max_examples=100, deadline=None)
@given(graph=dags(max_nodes=30, gradient_flags=True), data=st.data())
def test_a_kept_set_that_is_not_closed_gets_the_replay_too(graph, data):
    """A node two segments read is recomputed by both: the fast phases assume one owner a
    node, so such a set goes to the full replay, and the numbers still agree."""
    kept = data.draw(st.sets(st.integers(0, graph.num_nodes - 1)))
    fast = fast_replay.FastReplay(graph)
    assert fast.score(kept) == pytest.approx(_replayed(graph, kept, ()))


def _ownership_of_the_schedule(graph, kept, not_replayed):
    """Each node's owner and each kept node's level, read off ``schedule.build``: the
    definition FastReplay.closed_owners computes without building the schedule."""
    schedule = schedule_lib.build(graph, kept, not_replayed)
    owner = [fast_replay.NOWHERE] * graph.num_nodes
    for v in schedule.top:
        owner[v] = fast_replay.TOP
    for k, members in schedule.owned.items():
        for v in (*members, k):  # a never-replayed kept node owns no segment, but itself
            owner[v] = k
    return owner, {k: level.number for level in schedule.levels for k in level.nodes}


@settings(max_examples=300, deadline=None)
@given(graph=dags(max_nodes=30, gradient_flags=True), data=st.data())
def test_closing_and_owning_in_one_sweep_is_the_schedule_s(graph, data):
    """FastReplay.closed_owners: close_segments' kept set, and the owners and levels of its
    schedule, whatever is kept and never replayed (a kept reader that is never replayed owns
    nothing, which close_segments does not tell apart); and scoring with them is scoring."""
    nodes = st.integers(0, graph.num_nodes - 1)
    kept = data.draw(st.sets(nodes))
    not_replayed = data.draw(st.sets(nodes)) & kept
    fast = fast_replay.FastReplay(graph, not_replayed)
    closed, owned = fast.closed_owners(kept)
    assert closed == graph_lib.close_segments(graph, kept)
    assert owned == _ownership_of_the_schedule(graph, closed, not_replayed)
    assert fast.score_owned(closed, owned) == pytest.approx(
        _replayed(graph, closed, not_replayed))


@pytest.mark.parametrize("seed", range(30))
def test_closing_and_owning_in_one_sweep_on_random_problems(seed):
    """The same on the seeded problems (must-keep, never-replayed and candidate sets), with
    the share kept from none to all."""
    problem = random_problem(seed, low=8, high=40)
    graph, rng = problem.graph, random.Random(seed)
    fast = fast_replay.FastReplay(graph, problem.not_replayed)
    for share in (0.0, 0.1, 0.3, 0.6, 1.0):
        kept = {v for v in problem.candidates if rng.random() < share} | problem.must_keep
        closed, owned = fast.closed_owners(kept)
        assert closed == graph_lib.close_segments(graph, kept)
        assert owned == _ownership_of_the_schedule(graph, closed, problem.not_replayed)


def test_the_scorer_scores_as_before():
    """problem.score through the fast replay: the peak and cost of the full replay."""
    problem = random_problem(7, low=30, high=30)
    rng = random.Random(7)
    for _ in range(20):
        kept = {v for v in problem.candidates if rng.random() < 0.3}
        closed, peak, cost = problem_lib.score(problem, kept)
        assert (peak, cost) == pytest.approx(_replayed(problem.graph, closed,
                                                        problem.not_replayed))


@pytest.mark.parametrize("seed", range(10))
def test_a_workspace_without_scratch_shares_the_planners_replays(seed):
    """The never-worse rule passes a workspace of zeros on graphs without convolutions: it
    gets the replayer and plain peak the planners made (design note "planning cost", "Fifth
    pass"), and the same numbers as the replay with those zeros; a workspace with scratch gets
    its own."""
    problem = random_problem(seed, low=8, high=30)
    graph, n = problem.graph, problem.graph.num_nodes
    zeros = [0] * n
    planners_replayer = fast_replay.replayer(graph, problem.not_replayed)
    assert fast_replay.replayer(graph, problem.not_replayed, zeros) is planners_replayer
    assert fast_replay.plain_peak_bytes(graph, zeros) == fast_replay.plain_peak_bytes(graph)
    assert fast_replay.plain_peak_bytes(graph) == memory_model.plain_peak_bytes(graph, zeros)
    kept = graph_lib.close_segments(graph, set(problem.must_keep) | set(
        sorted(problem.candidates)[::3]))
    assert planners_replayer.peak_bytes(kept) == _replayed(
        graph, kept, problem.not_replayed, zeros)[0]
    scratch = [0] * (n - 1) + [64]
    assert fast_replay.replayer(graph, problem.not_replayed, scratch) is not planners_replayer
