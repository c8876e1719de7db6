"""Nested recomputation levels (``"revolve"``): the revolve recursion generalised to byte sizes.

See ``memsave_grads.core.multilevel`` (design note "multi-level") for nested plans."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Sequence

import numpy as np

from memsave_grads.core import graph as graph_lib
from memsave_grads.core import memory_model
from memsave_grads.core import plan as plan_lib
from memsave_grads.core import multilevel
from memsave_grads.core import planners
from memsave_grads.core.solvers import problem as problem_lib

#: The DP considers at most this many cut positions (thinned evenly beyond).
REVOLVE_MAX_POSITIONS = 128
#: Free memory is quantised into this many units (held bytes round up: conservative).
REVOLVE_QUANTA = 128
#: Times the DP tightens its budget when the replay finds its plan over budget.
REVOLVE_RETRIES = 6
#: The search for the smallest peak (:func:`smallest_peak_plan`) runs the DP on a ladder of
#: budgets, each this fraction of the one before, at most this many rounds, and stops after
#: this many rounds in a row that found no lower peak.
SMALLEST_PEAK_LADDER = 0.9
SMALLEST_PEAK_ROUNDS = 16
SMALLEST_PEAK_PATIENCE = 4
#: :func:`lowest_peak_within_cost` replays the trees of this many amounts of memory, from the
#: smallest whose DP cost is within the cap upwards.
WITHIN_COST_TRIES = 3
#: ... on at most this many cut positions: the DP's work grows as their cube, and the default
#: strategy must plan in about the time of tf.gradients' build (design note "planning cost").
WITHIN_COST_POSITIONS = 48


class _Chain:
    """Positions (index 0 = the start, m + 1 = the end) and per-pair costs and bytes.

    ``base[i, j]``: bytes a plain replay of ``(p_i, p_j]`` needs above what is held (retained
    bytes, the gradient of p_j's frontier, and the largest input gradients one backward step
    allocates; the end has no frontier);
    ``cost[i, j]``: recompute cost of the forward sweep over it (its own kept nodes excluded);
    ``front[d]``: bytes of p_d's frontier, held while what lies after it is processed.
    """

    @classmethod
    def of(cls, problem: problem_lib.BudgetProblem, search: planners.CutSearch,
           max_positions: int = REVOLVE_MAX_POSITIONS) -> "_Chain":
        """The chain over ``search``'s positions (thinned to ``max_positions``), made once per
        graph model and node sets: it does not depend on the budget."""
        key = ("revolve chain", problem.must_keep, problem.candidates, max_positions)
        memo = graph_lib.memo(problem.graph)
        if key not in memo:
            memo[key] = cls(problem, search, search.positions(max_positions))
        return memo[key]

    def __init__(self, problem: problem_lib.BudgetProblem, search: planners.CutSearch,
                 positions: list[int]):
        graph = problem.graph
        n = graph.num_nodes
        size = graph.size_bytes
        must = set(problem.must_keep)
        self.must_bytes = sum(size[v] for v in must)
        self.pos = [-1, *positions, n - 1]
        m2 = len(self.pos)
        fronts = graph_lib.frontiers(graph, positions, uses=search.uses)
        front_nodes = [[], *fronts, []]
        cost = [0.0 if v in must else graph.cost_of(v) for v in range(n)]
        retained = memory_model.retained_bytes(graph)
        cost_sum = np.concatenate([[0.0], np.cumsum(cost)])
        ret_sum = np.concatenate([[0], np.cumsum(retained)])
        # A backward step allocates the gradients of its node's inputs while its own is alive.
        transient = max((sum(size[p] for p in set(ins)) for ins in graph.inputs), default=0)
        self.front = np.array([sum(size[v] for v in f) for f in front_nodes], dtype=np.float64)
        self.base = np.full((m2, m2), np.inf)
        self.cost = np.full((m2, m2), np.inf)
        starts = np.asarray(self.pos)
        for j in range(1, m2):
            b, a = self.pos[j], starts[:j]
            # What p_j's frontier holds of (p_i, p_j] is a tail of it (sorted): its cost, summed
            # as a list is, for each tail the pairs ending at j take.
            front = front_nodes[j]
            tails = np.asarray([sum(cost[v] for v in front[k:]) for k in range(len(front) + 1)])
            self.cost[:j, j] = (cost_sum[b + 1] - cost_sum[a + 1]
                                - tails[np.searchsorted(front, a, side="right")])
            # p_j's frontier is freed when its level starts and replayed as a copy, so its
            # retained bytes count here (unlike in dp.dp_cuts).
            self.base[:j, j] = ret_sum[b + 1] - ret_sum[a + 1] + self.front[j] + transient


_BASE = -1


def _revolve_dp(chain: _Chain, budget_bytes: int,
                quanta: int = REVOLVE_QUANTA) -> multilevel.CutTree | None:
    """Cheapest cut tree under the decomposed peak, or None (:func:`_revolve_table` at its
    whole budget)."""
    table = _revolve_table(chain, budget_bytes, quanta)
    if table is None or not math.isfinite(table.costs[-1]):
        return None
    return table.tree(table.quanta)


@dataclasses.dataclass
class _Table:
    """The revolve DP's answer for every amount of free memory up to its budget:
    ``costs[q]`` is the least recompute cost of a tree whose decomposed peak is at most
    ``must_bytes + q * unit`` (inf where none is); :meth:`first_cut` the first cut of a pair
    at an amount, read from the DP's own tables when a tree is rebuilt (a few pairs of
    the table's thousands: design note "planning cost")."""

    costs: np.ndarray
    unit: float
    quanta: int
    held: np.ndarray
    #: ``need[i, j]``: units the plain backward pass over ``(p_i, p_j]`` needs;
    #: ``through[i, o, q]``: ``cost[i, i+o] + Bk[i, i+o, q]``; ``shifted[d, e, q]``:
    #: ``Bk[d, d+e, q - held[d]]`` (:func:`_revolve_table`'s tables by offset).
    need: np.ndarray
    through: np.ndarray
    shifted: np.ndarray

    def first_cut(self, i: int, j: int, q: int) -> int:
        """The first cut of the cheapest tree of ``(p_i, p_j]`` at ``q`` units (``_BASE``:
        none, the plain backward pass): the first of the least candidates, where it is less
        than plain, the same sums :func:`_revolve_table` takes the minimum of."""
        length = j - i
        base = 0.0 if q >= self.need[i, j] else np.inf
        if length < 2:
            return _BASE
        offsets = np.arange(1, length)
        candidates = self.through[i, 1:length, q] + self.shifted[i + offsets, length - offsets, q]
        best = int(np.argmin(candidates))
        return i + 1 + best if candidates[best] < base else _BASE

    def tree(self, q: int) -> multilevel.CutTree:
        return _rebuild(self, 0, len(self.held) - 1, q)


def _revolve_table(chain: _Chain, budget_bytes: int,
                   quanta: int = REVOLVE_QUANTA) -> _Table | None:
    """The revolve DP over every amount of free memory up to ``budget_bytes``; None where
    nothing is free.

    ``Bk[i, j, q]``: least recompute cost to backprop ``(p_i, p_j]`` after one forward sweep
    over it, with q units of memory free: either plain (its retained bytes fit), or keep a
    first cut d: ``(p_d, p_j]`` is backpropagated with d's frontier held, then ``(p_i, p_d]``
    is swept again (cost) and backpropagated the same way, one level deeper:
    ``Bk[i, j, q] = min_d Bk[d, j, q - F_d] + cost[i, d] + Bk[i, d, q]``.
    """
    free = budget_bytes - chain.must_bytes
    if free <= 0:
        return None
    unit = free / quanta
    # Exact when every size is a multiple of a unit that is not too small (uniform layers).
    sizes = np.concatenate([chain.front, chain.base.ravel()])
    sizes = sizes[np.isfinite(sizes) & (sizes > 0)]
    if sizes.size and sizes.max() < 2.0 ** 62:  # int64 holds them
        common = int(np.gcd.reduce(np.trunc(sizes).astype(np.int64)))
    else:
        common = math.gcd(*(int(v) for v in sizes))
    if common and free // common <= 2 * quanta:
        unit, quanta = common, int(free // common)
    m2 = len(chain.pos)
    need = np.ceil(chain.base / unit - 1e-9)  # inf stays inf
    held = np.ceil(chain.front / unit - 1e-9).astype(np.int64)
    qs = np.arange(quanta + 1)
    # The tables by offset: [i, o] stands for the pair (i, i + o). A pair's candidates are then
    # a slice of `t` and a strided view of `shifted`, read where they lie, and every entry
    # read was written by a shorter pair before (so no table is filled first: design note
    # "planning cost"). Bk itself is only wanted for the whole chain; which cut won, only
    # for the pairs of the trees rebuilt (_Table.first_cut).
    t = np.empty((m2, m2, quanta + 1))        # [i, o]: cost[i, i+o] + Bk[i, i+o]
    shifted = np.empty((m2, m2, quanta + 1))  # [d, e]: Bk[d, d+e, q - F_d]
    s0, s1, s2 = shifted.strides
    scratch = np.empty(((m2 + 1) // 2) ** 2 * (quanta + 1))  # (m2 - length) * (length - 1) at most
    # bk_length: Bk of the pairs of the current length, (i, i + length) for every i.
    for length in range(1, m2):
        i = np.arange(0, m2 - length)
        j = i + length
        base = np.where(qs[None, :] >= need[i, j][:, None], 0.0, np.inf)
        if length > 1:
            # d = i + o for o = 1 .. length - 1: t[i, d] is t[i, o]; shifted[d, j] is
            # shifted[i + o, length - o]: from shifted[1, length - 1], a row (s0) per i and
            # a row less a column (s0 - s1) per o.
            later = np.lib.stride_tricks.as_strided(
                shifted[1:, length - 1], shape=(m2 - length, length - 1, quanta + 1),
                strides=(s0, s0 - s1, s2), writeable=False)
            # (len(i), length-1, Q+1), in one buffer for all lengths (no allocation each)
            cand = scratch[:(m2 - length) * (length - 1) * (quanta + 1)].reshape(
                m2 - length, length - 1, quanta + 1)
            np.add(t[:m2 - length, 1:length], later, out=cand)
            best = cand.min(axis=1)
            # The plain pass where no cut is less, ties included, as first_cut reads it.
            bk_length = np.where(best < base, best, base)
        else:
            bk_length = base
        t[i, length] = chain.cost[i, j][:, None] + bk_length
        # shifted[d, j, q] = Bk[d, j, q - held[d]] for the pairs just finished (d = i).
        source = qs[None, :] - held[i][:, None]
        values = np.take_along_axis(bk_length, np.clip(source, 0, quanta), axis=1)
        shifted[i, length] = np.where(source >= 0, values, np.inf)
    return _Table(bk_length[0].copy(), unit, quanta, held, need, t, shifted)


def _rebuild(table: _Table, i: int, j: int, q: int) -> multilevel.CutTree:
    cuts, segments = [], []
    while True:
        d = table.first_cut(i, j, q)
        if d == _BASE:
            return multilevel.CutTree(cuts, segments)
        cuts.append(d)
        segments.append(_rebuild(table, i, d, q))
        q -= int(table.held[d])
        i = d


def _min_peak_tree(chain: _Chain) -> multilevel.CutTree:
    """The tree with the smallest decomposed peak (cost ignored):
    ``E[i, j] = min(base, min_d max(E[i, d], F_d + E[d, j]))``. (Its tables are by pair, not
    by offset as :func:`_revolve_table`'s: one amount of memory, no view to read.)"""
    m2 = len(chain.pos)
    e = np.full((m2, m2), np.inf)
    choice = np.full((m2, m2), _BASE, dtype=np.int32)
    for length in range(1, m2):
        i = np.arange(0, m2 - length)
        j = i + length
        base = chain.base[i, j]
        if length > 1:
            d = i[:, None] + np.arange(1, length)[None, :]
            cand = np.maximum(e[i[:, None], d], chain.front[d] + e[d, j[:, None]])
            best = np.argmin(cand, axis=1)
            val = cand[np.arange(len(i)), best]
            take = val < base
            e[i, j] = np.where(take, val, base)
            choice[i, j] = np.where(take, i + 1 + best, _BASE)
        else:
            e[i, j] = base

    def rebuild(i, j):
        cuts, segments = [], []
        while choice[i, j] != _BASE:
            d = int(choice[i, j])
            cuts.append(d)
            segments.append(rebuild(i, d))
            i = d
        return multilevel.CutTree(cuts, segments)

    return rebuild(0, m2 - 1)


def smallest_peak_plan(problem: problem_lib.BudgetProblem) -> tuple[float, int, plan_lib.Plan]:
    """(cost, peak, plan) of the lowest replayed peak found by a search that does not depend
    on ``problem.budget_bytes`` (design note "multi-level", the smallest feasible peak): the
    ``"memory"`` planner's single-level plan, the tree of the smallest decomposed peak, then
    the DP's trees on a ladder of budgets below the lower of their peaks
    (:data:`SMALLEST_PEAK_LADDER`; at most :data:`SMALLEST_PEAK_ROUNDS` rounds, down to where
    the DP finds no tree, or none lower for :data:`SMALLEST_PEAK_PATIENCE` rounds). An
    infeasible budget's error states this peak, so every budget below it states the same
    number, and a budget of that number is met by this plan. Made once per graph model and
    node sets (``graph.memo``)."""
    key = ("smallest peak", problem.must_keep, problem.candidates, problem.not_replayed)
    memo = graph_lib.memo(problem.graph)
    if key in memo:
        return memo[key]
    graph = problem.graph
    search = planners.CutSearch.of(graph, problem.must_keep, problem.candidates)
    chain = _Chain.of(problem, search)
    found = [_replayed(problem, search, chain, _min_peak_tree(chain))]
    single = planners.frontier_cuts(graph, problem.must_keep, problem.candidates,
                                    problem.not_replayed)
    if single is not None:
        peak, cost = memory_model.plan_peak_and_cost(graph, single)
        found.append((cost, peak, single))
    lowest = min(found, key=lambda f: (f[1], f[0]))
    # The DP's decomposed peak and the replay differ by a few units either way, so a budget
    # just below the lowest peak may give a deeper tree that replays higher while a lower one
    # does not (bisecting the budget found 20 MiB on the demo net where this finds 14): a
    # ladder, down to where the DP finds no tree or no lower peak for a while.
    target, unchanged = lowest[1], 0
    for _ in range(SMALLEST_PEAK_ROUNDS):
        target = int(target * SMALLEST_PEAK_LADDER)
        tree = _revolve_dp(chain, target)
        if tree is None or unchanged >= SMALLEST_PEAK_PATIENCE:
            break
        replayed = _replayed(problem, search, chain, tree)
        unchanged = 0 if (replayed[1], replayed[0]) < (lowest[1], lowest[0]) else unchanged + 1
        lowest = min(lowest, replayed, key=lambda f: (f[1], f[0]))
    memo[key] = lowest
    return lowest


def lowest_peak_within_cost(problem: problem_lib.BudgetProblem, cost_cap: float,
                            peak_cap_bytes: int | None = None
                            ) -> tuple[float, int, plan_lib.Plan] | None:
    """(cost, replayed peak, plan) of the nested plan of the lowest peak below
    ``problem.budget_bytes`` (and at most ``peak_cap_bytes``, whose replays stop once they
    pass it) whose recompute cost is at most ``cost_cap``, or None where the DP finds none
    (design note "nested by default").

    One DP run at the budget answers every smaller amount of memory at once
    (:func:`_revolve_table`): the smallest whose least cost is within the cap, and
    :data:`WITHIN_COST_TRIES` amounts above it (the DP's decomposed peak and the replay differ
    by a few units either way), are rebuilt and replayed; the lowest replayed peak whose
    replayed cost is within the cap stands."""
    graph = problem.graph
    search = planners.CutSearch.of(graph, problem.must_keep, problem.candidates)
    if not search.feasible:
        return None
    chain = _Chain.of(problem, search, WITHIN_COST_POSITIONS)
    table = _revolve_table(chain, problem.budget_bytes)
    if table is None:
        return None
    within = np.flatnonzero(table.costs <= cost_cap)
    if not len(within):
        return None
    first = int(within[0])
    step = max(1, (table.quanta - first) // (2 * WITHIN_COST_TRIES))
    best, trees = None, []
    for q in sorted({min(table.quanta, first + i * step) for i in range(WITHIN_COST_TRIES)}):
        if table.costs[q] > cost_cap:
            continue
        tree = table.tree(q)
        if tree in trees:  # amounts a unit or two apart often rebuild the same tree
            continue
        trees.append(tree)
        found = _replayed(problem, search, chain, tree, peak_cap_bytes)
        if found[0] <= cost_cap and found[1] < problem.budget_bytes and (
                peak_cap_bytes is None or found[1] <= peak_cap_bytes) and (
                best is None or (found[1], found[0]) < (best[1], best[0])):
            best = found
    return best


def _replayed(problem: problem_lib.BudgetProblem, search: planners.CutSearch, chain: "_Chain",
              tree: multilevel.CutTree, stop_above_bytes: int | None = None
              ) -> tuple[float, int, plan_lib.Plan]:
    """(cost, replayed peak, plan) of a cut tree over ``chain``'s positions (a peak above
    ``stop_above_bytes`` is where the replay stopped, and the cost the cost so far)."""
    plan = multilevel.plan_from_tree(problem.graph, search, _to_positions(tree, chain.pos),
                                     problem.not_replayed)
    peak, cost = memory_model.plan_peak_and_cost(problem.graph, plan,
                                                 stop_above_bytes=stop_above_bytes)
    return cost, peak, plan


def _to_positions(tree: multilevel.CutTree, pos: Sequence[int]) -> multilevel.CutTree:
    return multilevel.CutTree([pos[c] for c in tree.cuts],
                              [_to_positions(s, pos) for s in tree.segments])


def solve_revolve(problem: problem_lib.BudgetProblem) -> plan_lib.Plan:
    """The cheapest nested plan whose replayed peak fits (the revolve recursion generalised to
    byte sizes over the graph's cut positions; design note "multi-level").

    The DP is exact for its decomposed peak on the (possibly thinned) positions; the replay
    checks its plan, and the budget is lowered by the overshoot when they disagree. Where no
    plan fits, the plan of :func:`smallest_peak_plan` stands if it fits; else
    ``InfeasibleBudgetError`` states its peak (the same for every budget).
    """
    started = time.perf_counter()
    graph = problem.graph
    search = planners.CutSearch.of(graph, problem.must_keep, problem.candidates)
    chain = _Chain.of(problem, search)
    best = None
    budget_bytes = problem.budget_bytes
    for _ in range(REVOLVE_RETRIES):
        tree = _revolve_dp(chain, budget_bytes)
        if tree is None:
            break
        cost, peak, plan = _replayed(problem, search, chain, tree)
        if peak <= problem.budget_bytes:
            best = (cost, peak, plan)
            break
        budget_bytes -= peak - problem.budget_bytes
    if best is None:
        # Nothing found at this budget: the plan of the smallest peak, which either fits or
        # is the minimum the error states, the same whatever the budget asked.
        best = smallest_peak_plan(problem)
        if best[1] > problem.budget_bytes:
            raise problem_lib.infeasible(problem, best[1], "revolve")
    cost, peak, plan = best
    reason = (f"nested levels ({plan.levels} deep): the cheapest cut tree the revolve DP found "
              "whose replayed peak fits the budget")
    return plan.replace(predicted_peak_bytes=peak, recompute_cost=cost, planner="revolve",
                        reason=reason,
                        optimal=False, solve_seconds=time.perf_counter() - started,
                        budget_bytes=problem.budget_bytes)

