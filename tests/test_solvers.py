"""Budget solvers on TensorFlow-free graph models: the MILP's relaxation and optimality proof
against brute force, and the greedy heuristic against the proven optimum, bounded by work."""

import dataclasses
import itertools
import math
import random

import numpy as np
import pytest

from memsave_grads.core.solvers import problem as problem_lib
from memsave_grads import errors
from memsave_grads.core import fast_replay
from memsave_grads.core import graph as graph_lib
from memsave_grads.core import memory_model
from memsave_grads.core import planners
from memsave_grads.core import solvers
from memsave_grads.core.solvers import greedy as greedy_lib
from memsave_grads.core.solvers import milp as milp_lib
from memsave_grads.core.solvers import revolve
from strategies import chain, matmul_tanh_problem, random_problem


def _closed_sets(problem: problem_lib.BudgetProblem) -> list[frozenset]:
    """Every kept set a plan can have (closed for single ownership), each once."""
    free = sorted(problem.candidates - problem.must_keep)
    found = set()
    for r in range(len(free) + 1):
        for subset in itertools.combinations(free, r):
            found.add(frozenset(graph_lib.close_segments(problem.graph,
                                                         set(subset) | problem.must_keep)))
    return sorted(found, key=sorted)


def _brute_force(problem: problem_lib.BudgetProblem) -> dict[frozenset, tuple[int, float]]:
    return {kept: problem_lib.score(problem, kept)[1:] for kept in _closed_sets(problem)}


# --------------------------------------------------------------------------------------------
# The MILP: a valid relaxation, and optimality proven only when true
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed, held", [(seed, False) for seed in range(30)]
                         + [(seed, True) for seed in range(10)])
def test_milp_rows_are_a_valid_relaxation(seed, held):
    """Every closed kept set satisfies every row of the MILP (its structural rows exactly, its
    memory rows with its own replayed peak as the budget): the MILP never cuts off a plan;
    also where the weight gradients are held to the end of the pass."""
    problem = random_problem(seed, 4, 9)
    if held:
        problem = dataclasses.replace(
            problem, graph=dataclasses.replace(problem.graph, gradients_held=True))
    model = solvers.milp._milp_model(problem)
    first = model["first_memory_row"]
    for kept, (peak, _) in _brute_force(problem).items():
        z = solvers.milp._natural_assignment(problem, model, kept)
        values = model["matrix"] @ z
        assert np.all(values[:first] >= model["lower"][:first] - 1e-9), (seed, sorted(kept))
        assert np.all(values[:first] <= model["upper"][:first] + 1e-9), (seed, sorted(kept))
        assert solvers.milp_lower_bound(problem, kept, model) <= peak, (seed, sorted(kept))


def test_milp_lower_bound_is_tight_on_a_chain():
    """Not a vacuous bound: on a chain of segments it finds most of the replay's peak."""
    n = 40
    graph = chain(n, 1000)
    problem = problem_lib.BudgetProblem(graph, 0)
    for kept in ({9, 19, 29}, {4, 9, 14, 19, 24, 29, 34}, {19}):
        closed = graph_lib.close_segments(graph, kept)
        peak = memory_model.plan_peak_bytes(graph, closed)
        assert 0.9 * peak <= solvers.milp_lower_bound(problem, closed) <= peak


#: Seeds whose graphs take MILP's branch and bound 10-41 s (CI, 2 cores): run with -m slow.
SLOW_MILP_SEEDS = (5, 6, 8)


@pytest.mark.parametrize("seed", [pytest.param(seed, marks=pytest.mark.slow)
                                  if seed in SLOW_MILP_SEEDS else seed for seed in range(12)])
def test_milp_optimum_matches_brute_force(seed):
    """On tiny graphs (<= 12 nodes) the MILP's plan, when flagged optimal, is the cheapest
    kept set whose replayed peak fits, for budgets across the whole range."""
    problem = random_problem(100 + seed, 8, 12)
    plans = _brute_force(problem)
    peaks = sorted({peak for peak, _ in plans.values()})
    proven = 0
    for budget in sorted({peaks[0] - 1, peaks[0], peaks[len(peaks) // 3],
                          peaks[len(peaks) // 2], peaks[-1]}):
        fitting = [cost for peak, cost in plans.values() if peak <= budget]
        try:
            plan = solvers.solve_milp(problem.with_budget(budget))
        except errors.InfeasibleBudgetError:
            assert not fitting, (seed, budget)
            continue
        assert fitting, (seed, budget)
        assert plan.predicted_peak_bytes <= budget
        assert plan.recompute_cost >= min(fitting) - 1e-9
        if plan.optimal:
            proven += 1
            assert plan.recompute_cost == pytest.approx(min(fitting)), (seed, budget)
    assert proven >= 1, seed


def test_milp_does_not_claim_optimality_it_has_not_proven():
    """Out of time before the first MILP solution: the greedy plan, not flagged optimal."""
    problem = _layered_problem(depth=40, width=4)
    plain = memory_model.plain_peak_bytes(problem.graph)
    plan = solvers.solve_milp(problem.with_budget(int(0.5 * plain)), time_limit_seconds=1e-6)
    assert not plan.optimal
    assert plan.predicted_peak_bytes <= int(0.5 * plain)


# --------------------------------------------------------------------------------------------
# Greedy against the proven optimum and bounded by work
# --------------------------------------------------------------------------------------------


def _layered_problem(depth=30, width=3, seed=0):
    """A residual stream with ``width``-op branches (matmul, activation, scale) that rejoin
    it; sizes and costs vary per block."""
    rng = random.Random(seed)
    inputs, sizes, flops, reads_in, reads_out = [()], [4096], [1.0], [False], [False]
    stream = 0
    for _ in range(depth):
        block_size = rng.choice([2048, 4096, 8192])
        prev = stream
        for j in range(width):
            inputs.append((prev,))
            sizes.append(block_size * (4 if j == 1 else 1))
            flops.append(float(block_size * (40 if j == 0 else 1)))
            reads_in.append(j == 0)
            reads_out.append(j == 1)
            prev = len(inputs) - 1
        inputs.append((stream, prev))  # the residual add
        sizes.append(4096)
        flops.append(4096.0)
        reads_in.append(False)
        reads_out.append(False)
        stream = len(inputs) - 1
    n = len(inputs)
    graph = graph_lib.ForwardGraph(
        inputs=tuple(inputs), size_bytes=tuple(sizes), reads_source=(True,) + (False,) * (n - 1),
        feeds_sink=(False,) * (n - 1) + (True,), grad_reads_inputs=tuple(reads_in),
        grad_reads_output=tuple(reads_out), costs=tuple(flops))
    return problem_lib.BudgetProblem(graph, 0, candidates=frozenset(range(n - 1)))


SMALL_PROBLEMS = {
    "chain": lambda: matmul_tanh_problem(60, gradient_reads=True),
    "residual": lambda: _layered_problem(depth=12, width=3),
}


@pytest.fixture(scope="module")
def greedy_vs_optimum():
    """(name, fraction, greedy plan, proven-optimal MILP plan) on two small graphs."""
    rows = []
    for name, fractions in (("chain", (0.6, 0.45, 0.35)),
                            ("residual", (0.75, 0.6, 0.5, 0.45, 0.4, 0.35))):
        problem = SMALL_PROBLEMS[name]()
        plain = memory_model.plain_peak_bytes(problem.graph)
        for fraction in fractions:
            budget = int(fraction * plain)
            rows.append((name, fraction, solvers.solve_greedy(problem.with_budget(budget)),
                         solvers.solve_milp(problem.with_budget(budget))))
    return rows


def test_milp_proves_optimality_on_small_graphs(greedy_vs_optimum):
    for name, fraction, _, exact in greedy_vs_optimum:
        assert exact.optimal, (name, fraction, exact)


def test_greedy_is_near_the_proven_optimum(greedy_vs_optimum):
    """The issue's target: within 10% of the optimum. Met on most rows (6 of 9 here; the
    residual graph at 50%, 45% and 40% misses by 10-17%: docs/budgets.md), never far off."""
    within = 0
    for name, fraction, greedy, exact in greedy_vs_optimum:
        assert greedy.predicted_peak_bytes <= greedy.budget_bytes
        assert greedy.recompute_cost >= exact.recompute_cost - 1e-9  # exact is a lower bound
        assert greedy.recompute_cost <= 1.25 * exact.recompute_cost + 1e-9, (name, fraction)
        within += greedy.recompute_cost <= 1.10 * exact.recompute_cost + 1e-9
    assert within >= 2 / 3 * len(greedy_vs_optimum)


def test_greedy_is_optimal_on_a_chain(greedy_vs_optimum):
    for name, fraction, greedy, exact in greedy_vs_optimum:
        if name == "chain":
            assert greedy.recompute_cost <= 1.02 * exact.recompute_cost, fraction


def _counting_scores(monkeypatch) -> list:
    """Patches ``problem.score`` to record each plan scored, once (a probe stopped over the
    budget and scored in full later is one plan: ``Scorer.over_budget``); returns the record."""
    scored, score = [], problem_lib.score

    def recording(problem, kept, **options):
        if kept not in scored:
            scored.append(kept)
        return score(problem, kept, **options)

    monkeypatch.setattr(problem_lib, "score", recording)
    return scored


@pytest.mark.parametrize("fraction", [0.75, 0.35])
def test_greedy_is_bounded_by_plans_not_by_the_clock(fraction, monkeypatch):
    """One graph, one plan, however slow the machine: greedy stops at its bound on plans, and
    with every reading of the clock 1000 s later it scores the same plans (a deadline would
    stop it at the first that fits)."""
    problem = _layered_problem(depth=60, width=3, seed=1)
    monkeypatch.setattr(greedy_lib, "GREEDY_MAX_PLANS", 40)
    monkeypatch.setattr(greedy_lib, "GREEDY_MIN_PLANS", 40)
    budget = int(fraction * memory_model.plain_peak_bytes(problem.graph))
    scored = _counting_scores(monkeypatch)
    plan = solvers.solve_greedy(problem.with_budget(budget))
    assert plan.predicted_peak_bytes <= budget
    assert len(scored) == 40  # a plan fit before: the bound, not the search, ended it
    first = list(scored)
    scored.clear()
    clock = itertools.count(0, 1000)
    monkeypatch.setattr(problem_lib.time, "perf_counter", lambda: float(next(clock)))
    assert solvers.solve_greedy(problem.with_budget(budget)).kept == plan.kept
    assert scored == first


def test_greedy_plans_fewer_but_good_plans_on_a_graph_of_thousands_of_ops(monkeypatch):
    """Past 1600 ops the bound shrinks (a replay costs ~10 us per node); the DP seeds come
    first, so the plan stays cheap: with the cut search first, this graph's plan recomputed
    half the forward pass (50.1%; measured 2026-11-24, docs/budgets.md)."""
    problem = _layered_problem(depth=500, width=3, seed=1)  # 2001 ops
    # As on a graph of 4000 ops, in half the time.
    monkeypatch.setattr(greedy_lib, "GREEDY_REPLAYED_NODES", greedy_lib.GREEDY_REPLAYED_NODES // 2)
    limit = greedy_lib.plan_limit(problem.graph.num_nodes)
    assert greedy_lib.GREEDY_MIN_PLANS <= limit < greedy_lib.GREEDY_MAX_PLANS
    budget = int(0.5 * memory_model.plain_peak_bytes(problem.graph))
    scored = _counting_scores(monkeypatch)
    plan = solvers.solve_greedy(problem.with_budget(budget))
    assert len(scored) <= limit and plan.predicted_peak_bytes <= budget
    assert plan.recompute_cost < 0.1 * problem.graph.forward_cost()


def test_greedy_finds_plans_just_above_the_smallest_peak():
    """The DP seeds reach budgets where the cut search alone finds nothing (the tanh chain at
    45% of docs/budgets.md)."""
    problem = matmul_tanh_problem(60, gradient_reads=True)
    plain = memory_model.plain_peak_bytes(problem.graph)
    lowest = math.inf
    for fraction in np.linspace(0.2, 0.5, 13):
        try:
            plan = solvers.solve_dp(problem.with_budget(int(fraction * plain)))
        except errors.InfeasibleBudgetError:
            continue
        lowest = min(lowest, plan.predicted_peak_bytes)
    plan = solvers.solve_greedy(problem.with_budget(int(lowest)))
    assert plan.predicted_peak_bytes <= lowest


def test_dp_keeps_expensive_nodes_inside_segments():
    """A way of recomputing a segment that keeps its costly nodes (the branch matmuls, 40 per
    byte): at 60% of the plain peak it recomputes a sixth of what whole segments do."""
    problem = _layered_problem(depth=12, width=3)
    plain = memory_model.plain_peak_bytes(problem.graph)
    problem = problem.with_budget(int(0.6 * plain))
    search = planners.CutSearch(problem.graph, problem.must_keep, problem.candidates)
    positions = [p for p in range(problem.graph.num_nodes) if search.allowed[p]]
    whole = solvers.dp.dp_cuts(problem, search, positions, problem.budget_bytes)
    keeping = solvers.dp.dp_cuts(problem, search, positions, problem.budget_bytes, (None, 20.0))
    assert whole[1] == set() and keeping[1]
    assert all(problem.graph.cost_of(v) >= 20.0 * problem.graph.size_bytes[v]
               for v in keeping[1])
    _, peak_whole, cost_whole = problem_lib.score(problem, search.kept_for(whole[0]))
    _, peak_keeping, cost_keeping = problem_lib.score(problem,
                                                  search.kept_for(keeping[0]) | keeping[1])
    assert max(peak_whole, peak_keeping) <= problem.budget_bytes
    assert cost_keeping < cost_whole / 4


@pytest.mark.parametrize("fraction", [0.45, 0.6, 0.8])
def test_dp_pruning_labels_early_changes_nothing(fraction, monkeypatch):
    """Pruning a position's labels to their Pareto front as they arrive (what keeps the DP's
    memory bounded on Keras 3 ResNet50, which filled 24 GiB without it) gives the cuts that
    pruning them all at once does, ties included, on graphs with many labels per position."""
    problem = _layered_problem(depth=12, width=3)
    problem = problem.with_budget(int(fraction * memory_model.plain_peak_bytes(problem.graph)))
    search = planners.CutSearch(problem.graph, problem.must_keep, problem.candidates)
    positions = [p for p in range(problem.graph.num_nodes) if search.allowed[p]]
    found = {}
    for compact_at in (1, 2, 10**9):
        monkeypatch.setattr(solvers.dp, "_COMPACT_AT_LABELS", compact_at)
        found[compact_at] = solvers.dp.dp_cuts(problem, search, positions,
                                               problem.budget_bytes, (None, 20.0))
    assert found[10**9] is not None
    assert found[1] == found[2] == found[10**9]


def _segment_by_definition(tables, a_index, b_index, mode):
    """A segment's (new kept bytes, recompute cost, local peak), summed node by node as
    ``dp_cuts``' docstring defines them: what ``_Tables`` computes with prefix sums."""
    a = tables.positions[a_index] if a_index >= 0 else -1
    b = tables.positions[b_index]
    keeps = tables.inner[mode][0]
    inside = range(a + 1, b + 1)
    new = {v for v in tables.fronts[b_index] if v > a} | {v for v in inside if keeps[v]}
    new_bytes = sum(tables.size[v] for v in new)
    cost = sum(tables.cost[v] for v in inside if v not in new)
    local = (sum(tables.retained[v] for v in inside if v not in new)
             + sum(tables.size[v] for v in inside if keeps[v] and v not in tables.fronts[b_index])
             + tables.front_bytes[b_index] + tables.transient)
    return new_bytes, cost, local


@pytest.mark.parametrize("seed", range(6))
def test_segment_tables_sum_what_a_segment_holds(seed):
    """The DP's segment tables (prefix sums over sorted frontiers, every segment at once)
    give each segment's kept bytes, cost and local peak as summed node by node."""
    problem = _layered_problem(depth=8, width=3, seed=seed) if seed % 2 else random_problem(
        seed, 12, 30)
    search = planners.CutSearch(problem.graph, problem.must_keep, problem.candidates)
    positions = search.positions()
    tables = solvers.dp._Tables(problem, search, positions, (None, 20.0))
    for mode in (0, 1):
        for a_index in range(-1, len(positions)):
            rows = tables.segment_rows(a_index, mode, len(positions))
            for b_index in range(a_index + 1, len(positions)):
                expected = _segment_by_definition(tables, a_index, b_index, mode)
                found = tables.segment(a_index, b_index, mode)
                assert found[0] == expected[0] and found[2] == expected[2]
                assert found[1] == pytest.approx(expected[1], rel=1e-12, abs=1e-9)
                column = b_index - a_index - 1
                assert (rows[0][column], rows[1][column], rows[2][column]) == found


def _bucketed_label_loop(tables, budget_bytes, quantum):
    """The bucketed DP as a plain loop over labels: at each position, per bucket of
    ``quantum`` kept bytes, the cheapest label (the first of equal ones), extended in order
    of segment start, segment end, way of recomputing and label; returns (cost, cuts)."""
    count, modes = len(tables.positions), len(tables.inner)
    pending = [{} for _ in range(count)]
    best = None
    front = [(0, 0.0, None)]
    for a_index in range(-1, count):
        if a_index >= 0:
            ordered = sorted(pending[a_index].values(), key=lambda label: label[:2])
            front, cheapest = [], math.inf
            for label in ordered:
                if label[1] < cheapest:
                    front.append(label)
                    cheapest = label[1]
        for label in front:
            if label[0] + tables.must_bytes + tables.top(a_index) <= budget_bytes:
                if best is None or label[1] < best[0]:
                    best = (label[1], a_index, label)
        for b_index in range(a_index + 1, count):
            for mode in range(modes):
                new_bytes, seg_cost, local = tables.segment(a_index, b_index, mode)
                for label in front:
                    if label[0] + tables.must_bytes + local > budget_bytes:
                        continue
                    grown = (label[0] + new_bytes, label[1] + seg_cost, (a_index, label))
                    held = pending[b_index].get(grown[0] // quantum)
                    if held is None or grown[1] < held[1]:
                        pending[b_index][grown[0] // quantum] = grown
    if best is None:
        return None
    cuts, index, label = [], best[1], best[2]
    while index >= 0:
        cuts.append(tables.positions[index])
        index, label = label[2]
    return best[0], tuple(reversed(cuts))


@pytest.mark.parametrize("seed", range(8))
def test_the_bucketed_dp_finds_what_a_label_loop_finds(seed):
    """The greedy solver's seeds (``dp_cuts`` with a quantum: dense arrays over positions
    and buckets, a position's labels extended to every segment end at once) find the cuts
    that a plain loop over labels with the same rules finds, at several budgets, quanta and
    ways of recomputing, ties included."""
    problem = _layered_problem(depth=8 + seed, width=2 + seed % 2, seed=seed)
    plain = memory_model.plain_peak_bytes(problem.graph)
    search = planners.CutSearch(problem.graph, problem.must_keep, problem.candidates)
    positions = search.positions()
    answered = 0
    for fraction, labels, modes in itertools.product((0.5, 0.6, 0.75, 0.9), (8, 64),
                                                     ((None,), (None, 20.0))):
        budget_bytes = int(fraction * plain)
        quantum = max(budget_bytes // labels, 1)
        tables = solvers.dp._Tables(problem, search, positions, modes)
        expected = _bucketed_label_loop(tables, budget_bytes, quantum)
        found = solvers.dp.dp_cuts(problem, search, positions, budget_bytes, modes, quantum)
        if expected is None:
            assert found is None
            continue
        answered += 1
        assert found is not None and found[0] == expected[1], (fraction, labels, modes)
    assert answered >= 8


@pytest.mark.parametrize("quantum", [0, 1000])
def test_a_dp_below_zero_bytes_finds_nothing(quantum):
    """A seed's retries lower the DP's budget by the replay's overshoot, past zero where the
    replay disagrees by more than the budget (a Keras step of a generator's batch did): no
    plan, as for any budget nothing fits, not an error."""
    problem = _layered_problem(depth=4, width=2)
    search = planners.CutSearch(problem.graph, problem.must_keep, problem.candidates)
    assert solvers.dp.dp_cuts(problem, search, search.positions(), -5000, (None, 20.0),
                              quantum) is None


def test_dp_is_anytime_on_graphs_of_thousands_of_ops():
    """With its deadline already past, ``"dp"`` still answers: the plan of its first, coarsest
    round, within the budget and not claimed optimal (it did not run on every position)."""
    problem = matmul_tanh_problem(1500)
    budget = int(0.4 * memory_model.plain_peak_bytes(problem.graph))
    plan = solvers.solve_dp(dataclasses.replace(problem.with_budget(budget),
                                                deadline_seconds=0.0))
    assert plan.predicted_peak_bytes <= budget and not plan.optimal
    # Given a few seconds it answers from a finer round, or from the same one: never a worse
    # plan (the full search takes about a minute here).
    with_time = solvers.solve_dp(dataclasses.replace(problem.with_budget(budget),
                                                     deadline_seconds=5.0))
    assert with_time.predicted_peak_bytes <= budget
    assert with_time.recompute_cost <= plan.recompute_cost


def test_milp_answers_on_graphs_larger_than_it_builds():
    """Past MILP_MAX_NODES the MILP is not built; the answer is the best plan of the greedy and
    anytime dp solvers, within the budget, never claimed optimal."""
    problem = matmul_tanh_problem(milp_lib.MILP_MAX_NODES + 10)
    assert problem.graph.num_nodes > milp_lib.MILP_MAX_NODES
    budget = int(0.4 * memory_model.plain_peak_bytes(problem.graph))
    plan = solvers.solve_milp(dataclasses.replace(problem.with_budget(budget),
                                                  deadline_seconds=0.0))
    greedy = solvers.solve_greedy(problem.with_budget(budget))
    assert plan.predicted_peak_bytes <= budget and not plan.optimal
    assert plan.recompute_cost <= greedy.recompute_cost


def _reference_revolve(chain, need, held, quanta):
    """The revolve recursion of ``revolve._revolve_table``'s docstring, pair by pair and amount
    by amount: (least cost, first cut) of ``(p_i, p_j]`` with q units free; plain wins ties,
    and the first cut of least cost among cuts."""
    m2 = len(chain.pos)
    bk = np.full((m2, m2, quanta + 1), np.inf)
    first = np.full((m2, m2, quanta + 1), -1)
    for length in range(1, m2):
        for i in range(m2 - length):
            j = i + length
            for q in range(quanta + 1):
                best, cut = (0.0 if q >= need[i, j] else np.inf), -1
                for d in range(i + 1, j):
                    if q - held[d] < 0:
                        continue
                    value = (chain.cost[i, d] + bk[i, d, q]) + bk[d, j, q - held[d]]
                    if value < best:
                        best, cut = value, d
                bk[i, j, q], first[i, j, q] = best, cut
    return bk, first


@pytest.mark.parametrize("seed", range(12))
def test_the_revolve_table_is_the_recursion(seed):
    """The revolve DP's table (by offset, candidates read through strided views) holds the
    recursion's least costs for every amount of memory, gives its first cuts (read back from
    the tables when asked), and rebuilds its trees."""
    problem = random_problem(seed, low=20, high=70)
    search = planners.CutSearch.of(problem.graph, problem.must_keep, problem.candidates)
    if not search.feasible:
        pytest.skip("no position to cut")
    chain = revolve._Chain(problem, search, search.positions(9))
    plain = fast_replay.plain_peak_bytes(problem.graph)
    finite = 0
    for fraction in (1.0, 1.5, 3.0):
        table = revolve._revolve_table(chain, int(fraction * plain), quanta=24)
        if table is None:
            continue
        finite += bool(np.isfinite(table.costs).any())
        need = np.ceil(chain.base / table.unit - 1e-9)
        bk, first = _reference_revolve(chain, need, table.held, table.quanta)
        m2 = len(chain.pos)
        np.testing.assert_array_equal(table.costs, bk[0, m2 - 1])
        for i in range(m2):
            for j in range(i + 1, m2):
                assert [table.first_cut(i, j, q) for q in range(table.quanta + 1)] == \
                    first[i, j].tolist()
        for q in range(table.quanta + 1):
            assert _tree_lists(table.tree(q)) == _reference_tree(first, table.held, 0, m2 - 1, q)
    assert finite, "every table infinite: the test compared nothing"


@pytest.mark.parametrize("seed", range(12))
def test_the_revolve_chain_holds_each_pair_s_cost_and_bytes(seed):
    """``revolve._Chain``'s per-pair numbers are their definitions, pair by pair: the cost of
    sweeping ``(p_i, p_j]`` again (what is kept anyway, and p_j's frontier, not recomputed)
    and the bytes its plain backward pass needs (what it retains, p_j's frontier, the largest
    step's input gradients)."""
    problem = random_problem(seed, low=20, high=70)
    graph = problem.graph
    search = planners.CutSearch.of(graph, problem.must_keep, problem.candidates)
    if not search.feasible:
        pytest.skip("no position to cut")
    chain = revolve._Chain(problem, search, search.positions(9))
    retained = memory_model.retained_bytes(graph)
    transient = max(sum(graph.size_bytes[p] for p in set(ins)) for ins in graph.inputs)
    pos = chain.pos
    for j in range(1, len(pos)):
        front = set(graph_lib.frontier(graph, pos[j], uses=search.uses)) if j < len(pos) - 1 \
            else set()
        for i in range(j):
            inside = range(pos[i] + 1, pos[j] + 1)
            assert chain.cost[i, j] == pytest.approx(sum(
                graph.cost_of(v) for v in inside
                if v not in problem.must_keep and v not in front))
            assert chain.base[i, j] == sum(retained[v] for v in inside) + sum(
                graph.size_bytes[v] for v in front) + transient


@pytest.mark.parametrize("cost", [math.inf, -math.inf, math.nan, -1.0])
def test_a_graph_model_refuses_a_cost_the_planners_cannot_sum(cost):
    """Recompute costs are FLOPs or measured seconds (``Budget.op_seconds`` refuses others):
    the DP and revolve tables difference prefix sums, where an infinite cost gave NaN
    candidates (and IndexError in the greedy solver's DP seeds, NaN objectives for the MILP),
    and a negative one would make recomputing pay."""
    with pytest.raises(ValueError, match="costs must be finite and >= 0"):
        chain(8, 8, costs=(cost,) + (1.0,) * 7)
    chain(8, 8, costs=(0.0,) + (1.0,) * 7)  # free ops are fine (variable reads, views)


def _tree_lists(tree):
    return list(tree.cuts), [_tree_lists(s) for s in tree.segments]


def _reference_tree(first, held, i, j, q):
    """The cut tree of the recursion's first cuts: cut d, the part before it one level deeper
    with the same memory, the rest with d's frontier held."""
    cuts, segments = [], []
    while first[i, j, q] >= 0:
        d = int(first[i, j, q])
        cuts.append(d)
        segments.append(_reference_tree(first, held, i, d, q))
        q -= int(held[d])
        i = d
    return cuts, segments
