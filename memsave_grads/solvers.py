"""Budget solvers: one contract, :class:`~budgets.BudgetProblem` in, :class:`~budgets.BudgetPlan` out.

Every solver minimises the recompute cost of a plan subject to its predicted peak fitting the
budget, and every one scores plans with the same static models (``budgets.score``: the memory
replay and the per-node cost), so their answers are comparable (design note "budget solvers"):

* :func:`solve_greedy` (``"greedy"``, the default): Chen et al.'s budget search generalised to
  frontier cuts. For a grid of segment caps it places cuts as ``"memory"`` does, then drops
  trailing cuts (a larger top segment is never recomputed) as long as the plan still fits, and
  finally spends what budget is left on keeping the recomputed nodes that cost most per byte.
  Well under a second on every benchmark graph.
* :func:`solve_dp` (``"dp"``): an exact dynamic program over cut positions, for graphs that
  are chains of segments (every frontier small). It finds the cheapest set of cuts under a
  decomposed (segment by segment) peak, then checks the plan with the replay, tightening the
  budget if the replay disagrees.
* :func:`solve_milp` (``"milp"``): an exact mixed-integer program over *kept sets* (not only
  cuts), for small general graphs, with HiGHS through ``scipy.optimize.milp``. Its memory
  constraint is the bytes alive at the end of the forward pass, a lower bound of the replay's
  peak; each solution is checked with the replay and excluded if it does not fit, until one
  does. That one is optimal under the shared models. Used to validate the heuristic.

Multiple recomputation levels (revolve: recomputing a segment from checkpoints that are
themselves recomputed) are not planned: the rewrite recomputes each segment once from kept
tensors, so the smallest feasible budget is the ``"memory"`` plan's peak.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

from absl import logging

from memsave_grads import budgets
from memsave_grads import errors
from memsave_grads import graph as graph_lib
from memsave_grads import memory_model
from memsave_grads import planners

#: Segment caps the greedy solver tries (a geometric grid, as for ``"memory"``).
GREEDY_CAP_POINTS = 24
#: Plans (the cheapest that fit) the greedy solver tries to improve by keeping more nodes.
GREEDY_FILL_PLANS = 3
#: The dynamic program considers at most this many cut positions; on larger graphs it thins
#: them evenly and no longer claims optimality.
DP_MAX_POSITIONS = 400
#: Times the DP tightens its budget when the replay finds its plan over budget.
DP_RETRIES = 6
#: The MILP refuses graphs larger than this (it grows quadratically in practice).
MILP_MAX_NODES = 600
#: Solutions the MILP may reject (replay over budget) before it gives up on optimality.
MILP_MAX_ROUNDS = 60
#: Rejected solutions the MILP excludes one by one (which keeps its optimality proof) before it
#: starts lowering its linear budget by the replay's overshoot instead.
MILP_EXCLUDE_ROUNDS = 8
MILP_TIME_LIMIT_SECONDS = 30.0


class _Scorer:
    """Scores plans once each (a replay is the expensive step) and remembers the best fit."""

    def __init__(self, problem: budgets.BudgetProblem):
        self.problem = problem
        self.cache: dict[frozenset, tuple[frozenset, int, float]] = {}
        self.smallest_peak = math.inf
        self.best: tuple[frozenset, int, float] | None = None

    def __call__(self, kept) -> tuple[frozenset, int, float]:
        key = frozenset(kept)
        if key not in self.cache:
            result = budgets.score(self.problem, key)
            self.cache[key] = result
            closed, peak, cost = result
            self.smallest_peak = min(self.smallest_peak, peak)
            if peak <= self.problem.budget_bytes and (
                    self.best is None or (cost, peak) < (self.best[2], self.best[1])):
                self.best = result
        return self.cache[key]

    def fits(self, kept) -> bool:
        return self(kept)[1] <= self.problem.budget_bytes

    def plan(self, solver: str, started: float, optimal: bool = False) -> budgets.BudgetPlan:
        if self.best is None:
            # For the error: the smallest peak known, at least that of the "memory" plan.
            problem = self.problem
            lowest = planners.frontier_cuts(problem.graph, problem.must_keep, problem.candidates,
                                            problem.not_replayed)
            if lowest is not None:
                self(lowest.kept)
        if self.best is None:
            raise budgets.infeasible(self.problem, int(self.smallest_peak), solver)
        kept, peak, cost = self.best
        return budgets.BudgetPlan(kept=kept, predicted_peak_bytes=peak, recompute_cost=cost,
                                  solver=solver, optimal=optimal,
                                  solve_seconds=time.perf_counter() - started,
                                  budget_bytes=self.problem.budget_bytes)


def _last_true(lo: int, hi: int, predicate: Callable[[int], bool]) -> int | None:
    """The largest ``k`` in ``[lo, hi]`` with ``predicate(k)``, assuming it holds up to some
    point and fails after (binary search); ``None`` if it fails at ``lo``."""
    if not predicate(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if predicate(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _fill(problem: budgets.BudgetProblem, scorer: _Scorer, kept: frozenset) -> None:
    """Spend the budget left by ``kept`` on keeping recomputed nodes, most cost per byte first."""
    graph = problem.graph
    extra = sorted((v for v in budgets.recomputed_nodes(problem, kept)
                    if v in problem.candidates and graph.cost_of(v) > 0),
                   key=lambda v: (-graph.cost_of(v) / max(graph.size_bytes[v], 1), v))
    if extra:
        _last_true(0, len(extra), lambda k: scorer.fits(kept | set(extra[:k])))


def solve_greedy(problem: budgets.BudgetProblem) -> budgets.BudgetPlan:
    """Budget search over frontier-cut plans, then fill (see the module docstring)."""
    started = time.perf_counter()
    scorer = _Scorer(problem)
    nothing = scorer(problem.must_keep)  # plain tf.gradients (kept: only what must be)
    if nothing[1] <= problem.budget_bytes and nothing[2] == 0:
        return scorer.plan("greedy", started, optimal=True)
    search = planners.CutSearch(problem.graph, problem.must_keep, problem.candidates)
    if search.feasible:
        seen = set()
        for cap in search.caps(GREEDY_CAP_POINTS):
            cuts = search.cuts_for(cap)
            if not cuts or cuts in seen:
                continue
            seen.add(cuts)
            # Fewer trailing cuts: a larger top segment, less recomputed, more memory.
            _last_true(0, len(cuts) - 1,
                       lambda drop, cuts=cuts: scorer.fits(search.kept_for(cuts[:len(cuts) - drop])))
    fitting = [r for r in scorer.cache.values() if r[1] <= problem.budget_bytes]
    # Fill the cheapest plans and the ones with the most budget left (fewest bytes kept).
    bases = sorted(fitting, key=lambda r: (r[2], r[1]))[:GREEDY_FILL_PLANS]
    bases += sorted(fitting, key=lambda r: (r[1], r[2]))[:GREEDY_FILL_PLANS]
    for kept in dict.fromkeys(r[0] for r in bases):
        _fill(problem, scorer, kept)
    return scorer.plan("greedy", started)


# --------------------------------------------------------------------------------------------
# Dynamic program over cut positions
# --------------------------------------------------------------------------------------------


def _retained_bytes(graph: graph_lib.ForwardGraph) -> list[int]:
    """Bytes of each node the backward pass of its own segment keeps alive (views: none)."""
    consumers = graph.consumers()
    out = []
    for v in range(graph.num_nodes):
        read = graph.gradient_reads_output(v) or graph.feeds_sink[v] or any(
            graph.gradient_reads_inputs(c) for c in consumers[v])
        out.append(0 if graph.is_view(v) or not read else graph.size_bytes[v])
    return out


def _prefix(values) -> list:
    out, running = [0], 0
    for value in values:
        running += value
        out.append(running)
    return out


def _dp_cuts(problem: budgets.BudgetProblem, search: planners.CutSearch, positions: list[int],
             budget_bytes: int) -> tuple | None:
    """The cheapest cuts (a subset of ``positions``) under the decomposed peak, or None.

    Decomposed peak of cuts q_1 < ... < q_m (q_0 = -1): while segment (q_{i-1}, q_i] is
    recomputed, the frontiers of q_1..q_{i-1} are held, plus the segment's retained bytes, the
    gradient of q_i's frontier and a transient of two nodes; at the top, every frontier is held
    plus the retained bytes after q_m. Costs and kept bytes add up over segments.
    """
    graph = problem.graph
    n = graph.num_nodes
    size = graph.size_bytes
    must = set(problem.must_keep)
    must_bytes = sum(size[v] for v in must)
    cost = [0.0 if v in must else graph.cost_of(v) for v in range(n)]
    retained = _retained_bytes(graph)
    cost_sum, retained_sum = _prefix(cost), _prefix(retained)
    transient = 2 * max(size, default=0)
    fronts = graph_lib.frontiers(graph, positions, uses=search.uses)
    front_bytes = [sum(size[v] for v in f) for f in fronts]

    def segment(a_index: int, b_index: int) -> tuple[int, float, int]:
        """(new kept bytes, recompute cost, local peak) of the segment between two positions."""
        a = positions[a_index] if a_index >= 0 else -1
        b = positions[b_index]
        new = [v for v in fronts[b_index] if v > a]
        new_bytes = sum(size[v] for v in new)
        seg_cost = cost_sum[b + 1] - cost_sum[a + 1] - sum(cost[v] for v in new)
        local = (retained_sum[b + 1] - retained_sum[a + 1] - sum(retained[v] for v in new)
                 + front_bytes[b_index] + transient)
        return new_bytes, seg_cost, local

    def top(a_index: int) -> int:
        a = positions[a_index] if a_index >= 0 else -1
        return retained_sum[n] - retained_sum[a + 1] + transient

    # labels[i]: Pareto front of (kept bytes so far, cost so far, parent) at position i; each
    # position's labels are final before it extends the segments that start there.
    start = [(0, 0.0, None)]
    pending: list[list] = [[] for _ in positions]

    def pareto(candidates):
        candidates.sort(key=lambda c: (c[0], c[1]))
        front, best_cost = [], math.inf
        for c in candidates:  # keep the labels no other beats in both bytes and cost
            if c[1] < best_cost:
                front.append(c)
                best_cost = c[1]
        return front

    for a_index in range(-1, len(positions)):
        if a_index >= 0:
            pending[a_index] = pareto(pending[a_index])
        at_a = start if a_index < 0 else pending[a_index]
        if not at_a:
            continue
        lightest = at_a[0][0]
        a = positions[a_index] if a_index >= 0 else -1
        for b_index in range(a_index + 1, len(positions)):
            b = positions[b_index]
            # local >= the retained bytes of (a, b] + transient, which only grow with b.
            if lightest + must_bytes + retained_sum[b + 1] - retained_sum[a + 1] + \
                    transient > budget_bytes:
                break
            new_bytes, seg_cost, local = segment(a_index, b_index)
            for label in at_a:
                if label[0] + must_bytes + local <= budget_bytes:
                    pending[b_index].append((label[0] + new_bytes, label[1] + seg_cost,
                                             (a_index, label)))
    best = None
    for a_index in range(-1, len(positions)):
        for label in (start if a_index < 0 else pending[a_index]):
            if label[0] + must_bytes + top(a_index) <= budget_bytes:
                if best is None or label[1] < best[1][1]:
                    best = (a_index, label)
    if best is None:
        return None
    cuts = []
    index, label = best
    while index >= 0:
        cuts.append(positions[index])
        index, label = label[2]
    return tuple(reversed(cuts))


def solve_dp(problem: budgets.BudgetProblem) -> budgets.BudgetPlan:
    """Exact cuts under the decomposed peak, checked by the replay (see :func:`_dp_cuts`)."""
    started = time.perf_counter()
    scorer = _Scorer(problem)
    scorer(problem.must_keep)
    search = planners.CutSearch(problem.graph, problem.must_keep, problem.candidates)
    positions = [p for p in range(problem.graph.num_nodes) if search.allowed[p]]
    exact = len(positions) <= DP_MAX_POSITIONS
    if not exact:
        step = len(positions) / DP_MAX_POSITIONS
        positions = sorted({positions[int(i * step)] for i in range(DP_MAX_POSITIONS)})
    budget_bytes = problem.budget_bytes
    proven = False
    for _ in range(DP_RETRIES):
        cuts = _dp_cuts(problem, search, positions, budget_bytes) if positions else None
        if cuts is None:
            break
        _, peak, _ = scorer(search.kept_for(cuts))
        if peak <= problem.budget_bytes:
            proven = exact and budget_bytes == problem.budget_bytes
            break
        budget_bytes -= peak - problem.budget_bytes  # the replay disagrees: ask for less
    return scorer.plan("dp", started, optimal=proven)


# --------------------------------------------------------------------------------------------
# MILP over kept sets
# --------------------------------------------------------------------------------------------


def _milp_model(problem: budgets.BudgetProblem):
    """The MILP's matrices (see :func:`solve_milp`). Variables, 5 per node v: x_v (kept),
    t_v (in the top segment), y_v (alive at the end of the forward pass through the top),
    h_v / l_v (the largest / smallest t over v's readers)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    from scipy import sparse  # pylint: disable=import-outside-toplevel

    graph = problem.graph
    n = graph.num_nodes
    consumers = graph.consumers()
    x, t, y, h, l = (lambda v: v), (lambda v: n + v), (lambda v: 2 * n + v), \
        (lambda v: 3 * n + v), (lambda v: 4 * n + v)
    rows, cols, vals, lower, upper = [], [], [], [], []

    def add(terms, lo, hi):
        r = len(lower)
        for col, val in terms:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        lower.append(lo)
        upper.append(hi)

    for v in range(n):
        sink = graph.feeds_sink[v]
        add([(x(v), 1), (t(v), 1)], -np.inf, 1)  # kept or top or recomputed
        if sink:
            add([(x(v), 1), (t(v), 1)], 1, np.inf)
        # In the top exactly when not kept and a y or a top node reads it.
        add([(t(v), 1)] + [(t(c), -1) for c in consumers[v]], -np.inf, 1 if sink else 0)
        for c in consumers[v]:
            add([(t(v), 1), (t(c), -1), (x(v), 1)], 0, np.inf)
            add([(h(v), 1), (t(c), -1)], 0, np.inf)
            add([(t(c), 1), (l(v), -1)], 0, np.inf)
            if graph.gradient_reads_inputs(c):
                add([(y(v), 1), (t(c), -1), (x(v), 1)], 0, np.inf)
        # Read by the top and by a recomputed segment: kept (single owner).
        add([(x(v), 1), (h(v), -1), (l(v), 1)], 0, np.inf)
        if graph.gradient_reads_output(v) or sink:
            add([(y(v), 1), (t(v), -1)], 0, np.inf)
    # Memory rows come last (the solver tightens their upper bounds together).
    first_memory_row = len(lower)
    # Bytes alive when the forward pass ends: every kept node and the top's retained buffers.
    buffer = [0 if graph.is_view(v) else graph.size_bytes[v] for v in range(n)]
    kept_terms = [(x(v), graph.size_bytes[v]) for v in range(n) if graph.size_bytes[v]]
    add(kept_terms + [(y(v), buffer[v]) for v in range(n) if buffer[v]], -np.inf,
        problem.budget_bytes)
    # Bytes alive at the backward step of top node v: every kept node still, each retained top
    # output whose readers all come at or before v (so none has been freed yet), and v's own
    # gradient, its inputs' gradients and its variables' gradients.
    last_reader = [max(consumers[u], default=u) for u in range(n)]
    for v in range(n):
        step_bytes = graph.size_bytes[v] + graph.params_of(v) + sum(
            graph.size_bytes[p] for p in set(graph.inputs[v]))
        alive = [(y(u), buffer[u]) for u in range(v + 1) if buffer[u] and (
            last_reader[u] <= v or graph.gradient_reads_output(u)) and not graph.feeds_sink[u]]
        if step_bytes and alive:
            add(kept_terms + alive + [(t(v), step_bytes)], -np.inf, problem.budget_bytes)
        # Below the top (v kept or recomputed), while v's segment is backpropagated the kept
        # nodes before it are still held: they belong to later levels (exact on chains of
        # segments; on parallel branches a lower level may already have freed some).
        before = [(x(u), graph.size_bytes[u]) for u in range(v) if graph.size_bytes[u]]
        if step_bytes and before:
            add(before + [(t(v), -step_bytes)], -np.inf, problem.budget_bytes - step_bytes)

    cost = np.zeros(5 * n)
    for v in range(n):
        if v not in problem.must_keep:
            cost[x(v)] = cost[t(v)] = -graph.cost_of(v)  # minimise what is neither kept nor top
    lo_bounds, hi_bounds = np.zeros(5 * n), np.ones(5 * n)
    for v in range(n):
        if v in problem.must_keep:
            lo_bounds[x(v)] = 1
        elif v not in problem.candidates:
            hi_bounds[x(v)] = 0
        if graph.feeds_sink[v]:
            lo_bounds[h(v)] = 1
    integrality = np.zeros(5 * n)
    integrality[:2 * n] = 1
    matrix = sparse.csr_matrix((vals, (rows, cols)), shape=(len(lower), 5 * n))
    return (cost, matrix, np.array(lower), np.array(upper), lo_bounds, hi_bounds, integrality,
            len(lower) - first_memory_row)


def solve_milp(problem: budgets.BudgetProblem,
               time_limit_seconds: float = MILP_TIME_LIMIT_SECONDS) -> budgets.BudgetPlan:
    """The cheapest kept set under the budget (exact; small graphs; needs scipy)."""
    try:
        import numpy as np  # pylint: disable=import-outside-toplevel
        from scipy import optimize, sparse  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise errors.MissingDependencyError(
            "checkpoints: the 'milp' solver needs scipy (scipy.optimize.milp, HiGHS), which is "
            "not installed. Install it with `pip install scipy` (or memsave-grads[milp]), or use "
            "the 'greedy' or 'dp' solver.") from e
    graph = problem.graph
    if graph.num_nodes > MILP_MAX_NODES:
        raise errors.InvalidArgumentError(
            f"checkpoints: the 'milp' solver takes graphs of at most {MILP_MAX_NODES} forward "
            f"ops; this one has {graph.num_nodes}. Use the 'greedy' or 'dp' solver.")
    started = time.perf_counter()
    scorer = _Scorer(problem)
    cost, matrix, lower, upper, lo_bounds, hi_bounds, integrality, memory_rows = \
        _milp_model(problem)
    free = [v for v in range(graph.num_nodes) if lo_bounds[v] == 0 and hi_bounds[v] == 1]
    cuts_rows, cuts_lower = [], []
    linear_budget = problem.budget_bytes
    proven = False
    for round_index in range(MILP_MAX_ROUNDS):
        remaining = time_limit_seconds - (time.perf_counter() - started)
        if remaining <= 0:
            break
        constraints = [optimize.LinearConstraint(matrix, lower, upper)]
        if cuts_rows:
            constraints.append(optimize.LinearConstraint(
                sparse.vstack(cuts_rows), np.array(cuts_lower), np.inf))
        result = optimize.milp(cost, constraints=constraints, integrality=integrality,
                               bounds=optimize.Bounds(lo_bounds, hi_bounds),
                               options={"time_limit": remaining, "mip_rel_gap": 1e-9})
        if result.x is None:
            # No kept set meets the lower bounds. Their below-the-top rows hold on chains of
            # segments only, so this proves nothing in general: the greedy fallback decides.
            break
        kept = {v for v in range(graph.num_nodes) if result.x[v] > 0.5}
        _, peak, _ = scorer(kept)
        if peak <= problem.budget_bytes:
            proven = result.status == 0 and linear_budget == problem.budget_bytes
            break
        if round_index < MILP_EXCLUDE_ROUNDS:
            # Exclude this kept set and solve again: keeps the optimality argument.
            row = np.zeros(5 * graph.num_nodes)
            for v in free:
                row[v] = -1.0 if v in kept else 1.0
            cuts_rows.append(sparse.csr_matrix(row))
            cuts_lower.append(1 - sum(1 for v in free if v in kept))
        else:
            # The lower bound keeps missing part of the replay's peak: ask for that much less.
            linear_budget -= peak - problem.budget_bytes
            upper[-memory_rows:] -= peak - problem.budget_bytes
        logging.vlog(1, "memsave_grads: milp round %d: replay peak %d over the budget",
                     round_index, peak)
    if scorer.best is None:
        # Out of rounds or time without a plan the replay accepts: the heuristic's plan, which
        # is not claimed optimal (or its error, with the smallest peak it found).
        logging.warning("memsave_grads: milp found no plan within %d bytes the replay accepts; "
                        "using the greedy plan", problem.budget_bytes)
        plan = solve_greedy(problem)
        return dataclasses.replace(plan, solver="milp (greedy fallback)", optimal=False,
                                   solve_seconds=time.perf_counter() - started)
    return scorer.plan("milp", started, optimal=proven)


SOLVERS: dict[str, Callable[[budgets.BudgetProblem], budgets.BudgetPlan]] = {
    "greedy": solve_greedy,
    "dp": solve_dp,
    "milp": solve_milp,
}


def solve(problem: budgets.BudgetProblem, solver: str = budgets.DEFAULT_SOLVER) -> budgets.BudgetPlan:
    plan = SOLVERS[solver](problem)
    logging.vlog(1, "memsave_grads: %s: budget %d bytes -> peak %d, cost %.3g, %.2f s",
                 solver, problem.budget_bytes, plan.predicted_peak_bytes, plan.recompute_cost,
                 plan.solve_seconds)
    return plan


def tradeoff(problem: budgets.BudgetProblem, points: int = 12,
             solver: str = budgets.DEFAULT_SOLVER) -> list[budgets.BudgetPlan]:
    """The Pareto front of predicted peak vs recompute cost: plans for ``points`` budgets from
    the smallest feasible peak to plain ``tf.gradients``' peak, dominated plans dropped."""
    low = planners.frontier_cuts(problem.graph, problem.must_keep, problem.candidates,
                                 problem.not_replayed)
    high = memory_model.plain_peak_bytes(problem.graph)
    low_bytes = low.predicted_peak_bytes if low is not None else high
    plans = []
    for i in range(points):
        budget = low_bytes + (high - low_bytes) * i / max(points - 1, 1)
        try:
            plans.append(solve(problem.with_budget(int(budget)), solver))
        except errors.InfeasibleBudgetError:
            continue
    plans.sort(key=lambda p: (p.predicted_peak_bytes, p.recompute_cost))
    front = []
    for plan in plans:
        if not front or plan.recompute_cost < front[-1].recompute_cost:
            front.append(plan)
    return front
