"""Nested recomputation levels (``"revolve"``): the revolve recursion generalised to byte sizes.

See ``memsave_grads.core.multilevel`` (design note "multi-level") for nested plans."""

from __future__ import annotations

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


class _Chain:
    """Positions (index 0 = the start, m + 1 = the end) and per-pair costs and bytes.

    ``base[i, j]``: bytes a plain replay of ``(p_i, p_j]`` needs above what is held (retained
    bytes, the gradient of p_j's frontier, and the largest input gradients one backward step
    allocates; the end has no frontier);
    ``cost[i, j]``: recompute cost of the forward sweep over it (its own kept nodes excluded);
    ``front[d]``: bytes of p_d's frontier, held while what lies after it is processed.
    """

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
        for i in range(m2):
            a = self.pos[i]
            for j in range(i + 1, m2):
                b = self.pos[j]
                new = [v for v in front_nodes[j] if v > a]
                self.cost[i, j] = cost_sum[b + 1] - cost_sum[a + 1] - sum(cost[v] for v in new)
                # p_j's frontier is freed when its level starts and replayed as a copy, so
                # its retained bytes count here (unlike in dp.dp_cuts).
                self.base[i, j] = ret_sum[b + 1] - ret_sum[a + 1] + self.front[j] + transient


_BASE = -1


def _revolve_dp(chain: _Chain, budget_bytes: int,
                quanta: int = REVOLVE_QUANTA) -> multilevel.CutTree | None:
    """Cheapest cut tree under the decomposed peak, or None.

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
    sizes = [int(v) for v in np.concatenate([chain.front, chain.base.ravel()])
             if math.isfinite(v) and v > 0]
    common = math.gcd(*sizes) if sizes else 0
    if common and free // common <= 2 * quanta:
        unit, quanta = common, int(free // common)
    m2 = len(chain.pos)
    need = np.ceil(chain.base / unit - 1e-9)  # inf stays inf
    held = np.ceil(chain.front / unit - 1e-9).astype(np.int64)
    qs = np.arange(quanta + 1)
    bk = np.full((m2, m2, quanta + 1), np.inf)
    choice = np.full((m2, m2, quanta + 1), _BASE, dtype=np.int32)
    t = np.full((m2, m2, quanta + 1), np.inf)      # cost[i, d] + Bk[i, d]
    shifted = np.full((m2, m2, quanta + 1), np.inf)  # Bk[d, j, q - F_d]
    for length in range(1, m2):
        i = np.arange(0, m2 - length)
        j = i + length
        base = np.where(qs[None, :] >= need[i, j][:, None], 0.0, np.inf)
        if length > 1:
            offsets = np.arange(1, length)
            d = i[:, None] + offsets[None, :]
            cand = t[i[:, None], d] + shifted[d, j[:, None]]  # (len(i), length-1, Q+1)
            best = np.argmin(cand, axis=1)
            val = np.take_along_axis(cand, best[:, None, :], axis=1)[:, 0, :]
            take = val < base
            bk[i, j] = np.where(take, val, base)
            choice[i, j] = np.where(take, i[:, None] + 1 + best, _BASE)
        else:
            bk[i, j] = base
        t[i, j] = chain.cost[i, j][:, None] + bk[i, j]
        # shifted[d, j, q] = bk[d, j, q - held[d]] for the pairs just finished (d = i).
        for ii, jj in zip(i, j):
            h = held[ii]
            row = np.full(quanta + 1, np.inf)
            if h <= quanta:
                row[h:] = bk[ii, jj, :quanta + 1 - h]
            shifted[ii, jj] = row
    if not math.isfinite(bk[0, m2 - 1, quanta]):
        return None
    return _rebuild(choice, held, 0, m2 - 1, quanta)


def _rebuild(choice, held, i, j, q) -> multilevel.CutTree:
    cuts, segments = [], []
    while True:
        d = int(choice[i, j, q])
        if d == _BASE:
            return multilevel.CutTree(cuts, segments)
        cuts.append(d)
        segments.append(_rebuild(choice, held, i, d, q))
        q -= int(held[d])
        i = d


def _min_peak_tree(chain: _Chain) -> multilevel.CutTree:
    """The tree with the smallest decomposed peak (cost ignored):
    ``E[i, j] = min(base, min_d max(E[i, d], F_d + E[d, j]))``."""
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


def _to_positions(tree: multilevel.CutTree, pos: Sequence[int]) -> multilevel.CutTree:
    return multilevel.CutTree([pos[c] for c in tree.cuts],
                              [_to_positions(s, pos) for s in tree.segments])


def solve_revolve(problem: problem_lib.BudgetProblem) -> plan_lib.Plan:
    """The cheapest nested plan whose replayed peak fits (the revolve recursion generalised to
    byte sizes over the graph's cut positions; design note "multi-level").

    The DP is exact for its decomposed peak on the (possibly thinned) positions; the replay
    checks its plan, and the budget is lowered by the overshoot when they disagree. A budget
    below the smallest peak of the deepest plan found raises ``InfeasibleBudgetError``.
    """
    started = time.perf_counter()
    graph = problem.graph
    search = planners.CutSearch.of(graph, problem.must_keep, problem.candidates)
    positions = search.positions(REVOLVE_MAX_POSITIONS)
    chain = _Chain(problem, search, positions)
    best, smallest = None, math.inf

    def consider(tree: multilevel.CutTree):
        nonlocal best, smallest
        plan = multilevel.plan_from_tree(graph, search, _to_positions(tree, chain.pos),
                              problem.not_replayed)
        peak, cost = memory_model.plan_peak_and_cost(graph, plan)
        smallest = min(smallest, peak)
        if peak <= problem.budget_bytes and (best is None or (cost, peak) < best[:2]):
            best = (cost, peak, plan)
        return peak

    budget_bytes = problem.budget_bytes
    for _ in range(REVOLVE_RETRIES):
        tree = _revolve_dp(chain, budget_bytes)
        if tree is None:
            break
        peak = consider(tree)
        if peak <= problem.budget_bytes:
            break
        budget_bytes -= peak - problem.budget_bytes
    if best is None:
        consider(_min_peak_tree(chain))
    if best is None:
        raise problem_lib.infeasible(problem, int(smallest), "revolve")
    cost, peak, plan = best
    reason = (f"nested levels ({plan.levels} deep): the cheapest cut tree the revolve DP found "
              "whose replayed peak fits the budget")
    return plan.replace(predicted_peak_bytes=peak, recompute_cost=cost, planner="revolve",
                        reason=reason,
                        optimal=False, solve_seconds=time.perf_counter() - started,
                        budget_bytes=problem.budget_bytes)

