"""Multiple recomputation levels (revolve-style): nested plans, their replay, and the DP.

A single-level plan keeps some nodes and recomputes each segment once from them (design notes
"levels" and "single owner"). A *nested* plan gives a recomputed segment its own checkpoints:
while the segment is replayed, only its sub-kept nodes (and what its own top sub-segment's
backward reads) stay; its sub-segments are replayed again from them when backprop reaches them,
recursively. Memory falls to O(log n) on a chain at O(n log n) compute (design note
"multi-level" in docs/design.md).

This module is TensorFlow-free:

* :class:`NestedPlan`: kept nodes plus, per kept node, the plan of its segment;
* :func:`replay`: the memory replay of a nested plan, following what ``stitch.backprop`` does
  (on a plan without children it equals :func:`memory_model.plan_peak_bytes`), and the
  recompute cost (a node replayed at depth d counts d times);
* :func:`solve_revolve`: the revolve recursion generalised to byte sizes, over the cut positions
  of a chain-like graph (``planners.CutSearch``), checked with the replay; registered as the
  ``"revolve"`` budget solver.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Iterable, Mapping, Sequence

import numpy as np

from memsave_grads.core import budgets
from memsave_grads.core import graph as graph_lib
from memsave_grads.core import memory_model
from memsave_grads.core import planners
from memsave_grads.core.memory_model import _backward_readers, _backward_step, _forward, _Ledger  # pylint: disable=protected-access

#: The DP considers at most this many cut positions (thinned evenly beyond).
REVOLVE_MAX_POSITIONS = 128
#: Free memory is quantised into this many units (held bytes round up: conservative).
REVOLVE_QUANTA = 128
#: Times the DP tightens its budget when the replay finds its plan over budget.
REVOLVE_RETRIES = 6


@dataclasses.dataclass(frozen=True)
class NestedPlan:
    """Kept nodes and, for some of them, the plan their recomputed segment follows.

    Attributes:
      kept: nodes kept at this level (for the whole graph: closed for single ownership,
        ``must_keep`` included; for a segment: nodes of that segment, not its kept node).
      children: for a kept node, the :class:`NestedPlan` of its segment. A plan without
        children is an ordinary single-level plan.
    """

    kept: frozenset
    children: Mapping[int, "NestedPlan"] = dataclasses.field(default_factory=dict)

    @property
    def levels(self) -> int:
        """Recomputation depth: 1 for a single-level plan, 2 when segments have sub-plans..."""
        return 1 + max((c.levels for c in self.children.values()), default=0)


def sub_segments(graph: graph_lib.ForwardGraph, members: Sequence[int], kept: Iterable[int],
                 sinks: Iterable[int]) -> memory_model.Segments:
    """:func:`memory_model.segments` inside a recomputed region ``members`` whose outputs the
    backward pass needs are ``sinks`` (the level's kept nodes); inputs from outside are
    boundaries."""
    return memory_model.segments(graph, kept, members=members, sinks=sinks)


def close_within(graph: graph_lib.ForwardGraph, members: Sequence[int], kept: Iterable[int],
                 sinks: Iterable[int]) -> set[int]:
    """``graph.close_segments`` inside a recomputed region: keep every member read by two
    sub-segments (or by a sub-segment and the sub-top)."""
    member_set, kept, sink_set = set(members), set(kept), set(sinks)
    consumers = graph.consumers()
    top = -1
    owner: dict[int, int] = {}
    for v in sorted(member_set, reverse=True):
        if v in kept:
            continue
        owners = {top} if v in sink_set else set()
        for c in consumers[v]:
            if c in member_set:
                owners.add(c if c in kept else owner[c])
        if len(owners) > 1:
            kept.add(v)
        else:
            owner[v] = owners.pop() if owners else top
    return kept


# --------------------------------------------------------------------------------------------
# Replay (memory and recompute cost)
# --------------------------------------------------------------------------------------------


class _Replay:
    def __init__(self, graph):
        self.graph = graph
        self.consumers = graph.consumers()
        self.ledger = _Ledger()
        self.grads: set[int] = set()
        self.cost = 0.0

    def run(self, members, segs: memory_model.Segments, kept: set, children: Mapping) -> None:
        """Forward over ``members`` keeping ``kept`` and what the top's backward reads, the
        top backward, then each level (mirrors ``memory_model.plan_peak_bytes``)."""
        graph, ledger, grads = self.graph, self.ledger, self.grads
        release_at, top_retained = _backward_readers(graph, self.consumers, segs.top)
        retained = {v: v in kept or top_retained.get(v, False) for v in members}
        _forward(graph, members, self.consumers, retained, ledger, kept)
        for v in reversed(segs.top):
            _backward_step(graph, v, grads, ledger, release_at)
        for group in segs.levels():
            for k in group:  # every reader of k is in a lower level, done by now
                ledger.free(graph.size_bytes[k])
            active = [k for k in group if k in grads]
            recomputed = segs.recomputed(active)
            self.cost += sum(graph.cost_of(v) for v in recomputed if v not in kept)
            sub_kept, sub_children = merged_children(children, active, recomputed)
            if sub_kept:
                sub = sub_segments(graph, recomputed, sub_kept, active)
                self.run(recomputed, sub, sub_kept, sub_children)
            else:
                release, saved = _backward_readers(graph, self.consumers, recomputed)
                _forward(graph, recomputed, self.consumers, saved, ledger, kept=())
                for v in reversed(recomputed):
                    _backward_step(graph, v, grads, ledger, release)
            for k in active:
                if k in grads:  # a never-replayed kept node: its gradient goes to xs
                    _backward_step(graph, k, grads, ledger, {})


def merged_children(children: Mapping, active: Iterable[int],
                    recomputed: Iterable[int]) -> tuple[set, dict]:
    """The sub-kept nodes of a level (the union over its active kept nodes, as the rewrite
    recurses once per level) and their own children."""
    active = set(active)
    allowed = set(recomputed) - active
    sub_kept: set = set()
    sub_children: dict = {}
    for k in sorted(active):
        child = children.get(k)
        if child is None:
            continue
        sub_kept |= set(child.kept) & allowed
        sub_children.update(child.children)
    return sub_kept, {k: c for k, c in sub_children.items() if k in sub_kept}


def replay(graph: graph_lib.ForwardGraph, plan: NestedPlan,
           not_replayed: Iterable[int] = ()) -> tuple[int, float]:
    """(predicted peak bytes, recompute cost) of a nested plan. The cost counts a node once per
    time it is replayed (depth d: d times); kept nodes themselves are not counted, as in
    ``budgets.score``."""
    kept = set(plan.kept)
    segs = memory_model.segments(graph, kept, not_replayed)
    state = _Replay(graph)
    state.run(list(range(graph.num_nodes)), segs, kept, plan.children)
    return state.ledger.peak, state.cost


def nested_peak_bytes(graph: graph_lib.ForwardGraph, plan: NestedPlan,
                      not_replayed: Iterable[int] = ()) -> int:
    return replay(graph, plan, not_replayed)[0]


# --------------------------------------------------------------------------------------------
# Cut trees -> nested plans
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CutTree:
    """Cuts (topological positions) made at one level of a region, and for each segment
    ``(cut_{l-1}, cut_l]`` the tree of its own replay."""

    cuts: list
    segments: list


def plan_from_tree(graph: graph_lib.ForwardGraph, search: planners.CutSearch, tree: CutTree,
                   not_replayed: Iterable[int] = ()) -> NestedPlan:
    """The nested plan that keeps the live frontiers of a tree's cuts, level by level."""
    positions = sorted(_all_cuts(tree))
    fronts = dict(zip(positions, graph_lib.frontiers(graph, positions, uses=search.uses)))
    kept = search.kept_for(tree.cuts)
    segs = memory_model.segments(graph, kept, not_replayed)
    return NestedPlan(frozenset(kept), _children(graph, fronts, segs, set(kept), tree))


def _all_cuts(tree: CutTree):
    yield from tree.cuts
    for sub in tree.segments:
        yield from _all_cuts(sub)


def _children(graph, fronts, segs, kept, tree) -> dict:
    children: dict[int, NestedPlan] = {}
    for sub in tree.segments:
        if not sub.cuts:
            continue
        wanted = {v for c in sub.cuts for v in fronts[c]}
        for k in sorted(kept):
            members = segs.owned.get(k) or []
            nodes = wanted & set(members) - {k}
            if not nodes:
                continue
            sub_kept = close_within(graph, members, nodes, [k])
            inner = sub_segments(graph, members, sub_kept, [k])
            plan = NestedPlan(frozenset(sub_kept),
                              _children(graph, fronts, inner, sub_kept, sub))
            if k in children:  # two subtrees in one segment (not on chains): merge
                old = children[k]
                plan = NestedPlan(old.kept | plan.kept, {**old.children, **plan.children})
            children[k] = plan
    return children


# --------------------------------------------------------------------------------------------
# The revolve DP over cut positions
# --------------------------------------------------------------------------------------------


class _Chain:
    """Positions (index 0 = the start, m + 1 = the end) and per-pair costs and bytes.

    ``base[i, j]``: bytes a plain replay of ``(p_i, p_j]`` needs above what is held (retained
    bytes, the gradient of p_j's frontier, and the largest input gradients one backward step
    allocates; the end has no frontier);
    ``cost[i, j]``: recompute cost of the forward sweep over it (its own kept nodes excluded);
    ``front[d]``: bytes of p_d's frontier, held while what lies after it is processed.
    """

    def __init__(self, problem: budgets.BudgetProblem, search: planners.CutSearch,
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
                # its retained bytes count here (unlike in solvers._dp_cuts).
                self.base[i, j] = ret_sum[b + 1] - ret_sum[a + 1] + self.front[j] + transient


_BASE = -1


def _revolve_dp(chain: _Chain, budget_bytes: int, quanta: int = REVOLVE_QUANTA) -> CutTree | None:
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


def _rebuild(choice, held, i, j, q) -> CutTree:
    cuts, segments = [], []
    while True:
        d = int(choice[i, j, q])
        if d == _BASE:
            return CutTree(cuts, segments)
        cuts.append(d)
        segments.append(_rebuild(choice, held, i, d, q))
        q -= int(held[d])
        i = d


def _min_peak_tree(chain: _Chain) -> CutTree:
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
        return CutTree(cuts, segments)

    return rebuild(0, m2 - 1)


def _to_positions(tree: CutTree, pos: Sequence[int]) -> CutTree:
    return CutTree([pos[c] for c in tree.cuts], [_to_positions(s, pos) for s in tree.segments])


def solve_revolve(problem: budgets.BudgetProblem) -> budgets.BudgetPlan:
    """The cheapest nested plan whose replayed peak fits (the revolve recursion generalised to
    byte sizes over the graph's cut positions; design note "multi-level").

    The DP is exact for its decomposed peak on the (possibly thinned) positions; the replay
    checks its plan, and the budget is lowered by the overshoot when they disagree. A budget
    below the smallest peak of the deepest plan found raises ``InfeasibleBudgetError``.
    """
    started = time.perf_counter()
    graph = problem.graph
    search = planners.CutSearch(graph, problem.must_keep, problem.candidates)
    positions = [p for p in range(graph.num_nodes) if search.allowed[p]]
    exact = len(positions) <= REVOLVE_MAX_POSITIONS
    if not exact:
        step = len(positions) / REVOLVE_MAX_POSITIONS
        positions = sorted({positions[int(i * step)] for i in range(REVOLVE_MAX_POSITIONS)})
    chain = _Chain(problem, search, positions)
    best, smallest = None, math.inf

    def consider(tree: CutTree):
        nonlocal best, smallest
        plan = plan_from_tree(graph, search, _to_positions(tree, chain.pos),
                              problem.not_replayed)
        peak, cost = replay(graph, plan, problem.not_replayed)
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
        raise budgets.infeasible(problem, int(smallest), "revolve")
    cost, peak, plan = best
    return budgets.BudgetPlan(kept=plan.kept, predicted_peak_bytes=peak, recompute_cost=cost,
                              solver="revolve", optimal=False,
                              solve_seconds=time.perf_counter() - started,
                              budget_bytes=problem.budget_bytes, nested=plan.children)


def balanced_plan(graph: graph_lib.ForwardGraph, must_keep: Iterable[int],
                  candidates: Iterable[int], levels: int,
                  not_replayed: Iterable[int] = ()) -> NestedPlan:
    """A nested plan of exactly ``levels`` recomputation levels (where the graph has enough cut
    positions): each region's positions are cut into about n^(1/(levels+1)) equal parts,
    recursively. For tests and experiments; budgets use :func:`solve_revolve`."""
    search = planners.CutSearch(graph, must_keep, candidates)
    positions = [p for p in range(graph.num_nodes) if search.allowed[p]]
    parts = max(2, round((len(positions) + 1) ** (1.0 / (levels + 1))))

    def split(inside: list, depth: int) -> CutTree:
        if depth >= levels or not inside:
            return CutTree([], [])
        count = min(len(inside), parts - 1 if depth else parts)
        step = (len(inside) + 1) / (count + 1)
        cuts = sorted({inside[min(len(inside) - 1, int(step * (i + 1)) - 1)]
                       for i in range(count)})
        segments, previous = [], -1
        for c in cuts:
            segments.append(split([p for p in inside if previous < p < c], depth + 1))
            previous = c
        return CutTree(cuts, segments)

    return plan_from_tree(graph, search, split(positions, 0), not_replayed)
