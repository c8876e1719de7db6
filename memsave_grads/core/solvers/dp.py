"""An exact dynamic program over cut positions (``"dp"``), for chains of segments."""

from __future__ import annotations

import bisect
import logging
import math
import time
from typing import Sequence

from memsave_grads.core import graph as graph_lib
from memsave_grads.core import memory_model
from memsave_grads.core import plan as plan_lib
from memsave_grads.core import planners
from memsave_grads.core.solvers import problem as problem_lib

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

#: The dynamic program considers at most this many cut positions; on larger graphs it thins
#: them evenly and no longer claims optimality.
DP_MAX_POSITIONS = 400
#: Times the DP tightens its budget when the replay finds its plan over budget.
DP_RETRIES = 6
#: A position's pending labels are pruned to their Pareto front once they number this many
#: (and twice the last front's size after that).
_COMPACT_AT_LABELS = 4096


#: How long ``"dp"`` searches by default, in seconds: it answers with the best plan it has by
#: then (anytime), on graphs of any size.
DP_DEADLINE_SECONDS = 30.0
#: The anytime DP first solves on this many positions, then doubles them while time is left.
DP_FIRST_POSITIONS = 40


class DeadlinePassed(Exception):
    """A DP ran past its deadline before it finished (its partial labels prove nothing)."""


def _prefix(values) -> list:
    out, running = [0], 0
    for value in values:
        running += value
        out.append(running)
    return out


class _Tables:
    """What a DP over ``positions`` reads, computed once per (positions, ways of recomputing):
    the greedy solver's seeds and the DP's retries ask again with other budgets only."""

    def __init__(self, problem: problem_lib.BudgetProblem, search: planners.CutSearch,
                 positions: list[int], keep_ratios: Sequence[float | None]):
        graph = problem.graph
        n = graph.num_nodes
        self.positions = positions
        self.n = n
        self.size = size = graph.size_bytes
        must = set(problem.must_keep)
        self.must_bytes = sum(size[v] for v in must)
        self.cost = cost = [0.0 if v in must else graph.cost_of(v) for v in range(n)]
        self.retained = retained = memory_model.retained_bytes(graph)
        self.cost_sum, self.retained_sum = _prefix(cost), _prefix(retained)
        self.transient = 2 * max(size, default=0)
        self.fronts = graph_lib.frontiers(graph, positions, uses=search.uses)
        self.front_bytes = [sum(size[v] for v in f) for f in self.fronts]
        # Per way of recomputing: which nodes it keeps inside a segment, and prefix sums of
        # their bytes, costs and retained bytes.
        self.inner = []
        for ratio in keep_ratios:
            keeps = [ratio is not None and v in problem.candidates and v not in must
                     and cost[v] > 0 and cost[v] >= ratio * max(size[v], 1) for v in range(n)]
            self.inner.append((keeps, _prefix(size[v] if keeps[v] else 0 for v in range(n)),
                               _prefix(cost[v] if keeps[v] else 0.0 for v in range(n)),
                               _prefix(retained[v] if keeps[v] else 0 for v in range(n))))
        self._segments: dict = {}
        #: dp_cuts' answers by (budget, quantum): the greedy solver's seeds ask the same
        #: question again where two quantiles give the same cost-per-byte threshold.
        self.answers: dict = {}

    @classmethod
    def of(cls, problem, search, positions, keep_ratios) -> "_Tables":
        key = ("dp tables", problem.must_keep, problem.candidates, tuple(positions),
               tuple(keep_ratios))
        memo = graph_lib.memo(problem.graph)
        if key not in memo:
            memo[key] = cls(problem, search, positions, keep_ratios)
        return memo[key]

    def segment(self, a_index: int, b_index: int, mode: int) -> tuple[int, float, int]:
        """(new kept bytes, recompute cost, local peak) of the segment between two positions
        (see :func:`dp_cuts`); the same for every budget, so computed once."""
        key = (a_index, b_index, mode)
        if key in self._segments:
            return self._segments[key]
        size, cost, retained = self.size, self.cost, self.retained
        a = self.positions[a_index] if a_index >= 0 else -1
        b = self.positions[b_index]
        new = [v for v in self.fronts[b_index] if v > a]
        new_bytes = sum(size[v] for v in new)
        seg_cost = self.cost_sum[b + 1] - self.cost_sum[a + 1] - sum(cost[v] for v in new)
        local = (self.retained_sum[b + 1] - self.retained_sum[a + 1]
                 - sum(retained[v] for v in new) + self.front_bytes[b_index] + self.transient)
        keeps, bytes_sum, kept_cost_sum, kept_retained_sum = self.inner[mode]
        if mode:
            extra = bytes_sum[b + 1] - bytes_sum[a + 1] - sum(size[v] for v in new if keeps[v])
            new_bytes += extra
            seg_cost -= kept_cost_sum[b + 1] - kept_cost_sum[a + 1] - sum(
                cost[v] for v in new if keeps[v])
            local += extra - (kept_retained_sum[b + 1] - kept_retained_sum[a + 1] - sum(
                retained[v] for v in new if keeps[v]))
        self._segments[key] = result = (new_bytes, seg_cost, local)
        return result

    def top(self, a_index: int) -> int:
        """The top segment's local peak after a last cut at ``a_index``."""
        a = self.positions[a_index] if a_index >= 0 else -1
        return self.retained_sum[self.n] - self.retained_sum[a + 1] + self.transient


def _pareto(candidates: list, quantum: int) -> list:
    """The labels no other beats in both bytes and cost (with a quantum: the cheapest per
    bucket of bytes), sorted by bytes."""
    candidates.sort(key=lambda c: (c[0], c[1]))
    front, best_cost = [], math.inf
    for c in candidates:
        if c[1] < best_cost:
            if quantum and front and c[0] // quantum == front[-1][0] // quantum:
                front[-1] = c  # one label per bucket of bytes: the cheapest
            else:
                front.append(c)
            best_cost = c[1]
    return front


def _extend(tables: _Tables, a_index: int, at_a: list, pending: list, compact_at: list,
            budget_bytes: int, modes: int, quantum: int) -> None:
    """Extend the labels at position ``a_index`` by every segment starting there that fits."""
    positions, must_bytes, transient = tables.positions, tables.must_bytes, tables.transient
    at_bytes = [label[0] for label in at_a]
    lightest = at_a[0][0]
    a = positions[a_index] if a_index >= 0 else -1
    retained_sum = tables.retained_sum
    for b_index in range(a_index + 1, len(positions)):
        b = positions[b_index]
        # local >= the retained bytes of (a, b] + transient, which only grow with b.
        if lightest + must_bytes + retained_sum[b + 1] - retained_sum[a + 1] + \
                transient > budget_bytes:
            break
        for mode in range(modes):
            new_bytes, seg_cost, local = tables.segment(a_index, b_index, mode)
            # Labels are sorted by bytes: the ones this segment fits with are a prefix.
            fitting = bisect.bisect_right(at_bytes, budget_bytes - must_bytes - local)
            if not quantum:
                reaching = pending[b_index]
                reaching.extend(
                    (label[0] + new_bytes, label[1] + seg_cost, (a_index, label, mode))
                    for label in at_a[:fitting])
                if len(reaching) > compact_at[b_index]:
                    # Drop dominated labels now, not only once b is reached: every earlier
                    # position adds its whole front here, and Keras 3 ResNet50's 400
                    # positions filled 24 GiB before b was reached. Exact: a label
                    # dominated now stays dominated, and ties keep the first, as before.
                    pending[b_index] = reaching = _pareto(reaching, 0)
                    compact_at[b_index] = max(_COMPACT_AT_LABELS, 2 * len(reaching))
                continue
            # The greedy seeds' hot loop (design note "planning cost"): names bound once.
            buckets = pending[b_index]
            held_in = buckets.get
            for label in at_a[:fitting]:
                label_bytes = label[0] + new_bytes
                key = label_bytes // quantum
                held = held_in(key)
                label_cost = label[1] + seg_cost
                if held is None or label_cost < held[1]:
                    buckets[key] = (label_bytes, label_cost, (a_index, label, mode))


def _trace_back(tables: _Tables, index: int, label) -> tuple[tuple, set]:
    """The cuts and the nodes kept inside segments of the label's path."""
    cuts, kept_inside = [], set()
    while index >= 0:
        b = tables.positions[index]
        index, label, mode = label[2]
        a = tables.positions[index] if index >= 0 else -1
        cuts.append(b)
        keeps = tables.inner[mode][0]
        kept_inside.update(v for v in range(a + 1, b + 1) if keeps[v])
    return tuple(reversed(cuts)), kept_inside


def dp_cuts(problem: problem_lib.BudgetProblem, search: planners.CutSearch, positions: list[int],
            budget_bytes: int, keep_ratios: Sequence[float | None] = (None,),
            quantum: int = 0, deadline: float | None = None) -> tuple[tuple, set] | None:
    """The cheapest cuts (a subset of ``positions``) under the decomposed peak, or None.

    Decomposed peak of cuts q_1 < ... < q_m (q_0 = -1): while segment (q_{i-1}, q_i] is
    recomputed, the frontiers of q_1..q_{i-1} are held, plus the segment's retained bytes, the
    gradient of q_i's frontier and a transient of two nodes; at the top, every frontier is held
    plus the retained bytes after q_m. Costs and kept bytes add up over segments.

    ``keep_ratios``: the ways a segment may be recomputed. ``None``: all of it; a number r: its
    nodes that cost at least r per byte are kept too (they are held like frontiers from then
    on, are not recomputed, and are counted at full size in the segment's local peak). Returns
    the cuts and the nodes kept inside segments. ``quantum``: at most one label per position
    and bucket of this many kept bytes, the cheapest (fewer labels: fast, no longer exact).
    ``deadline`` (a ``time.perf_counter()`` value): raise :class:`DeadlinePassed` once past it.
    """
    tables = _Tables.of(problem, search, positions, keep_ratios)
    if (budget_bytes, quantum) not in tables.answers:
        tables.answers[budget_bytes, quantum] = _solved(tables, budget_bytes, quantum, deadline)
    found = tables.answers[budget_bytes, quantum]
    return None if found is None else (found[0], set(found[1]))


def _solved(tables: _Tables, budget_bytes: int, quantum: int,
            deadline: float | None) -> tuple[tuple, frozenset] | None:
    """:func:`dp_cuts` on its tables (computed once per budget and quantum)."""
    positions = tables.positions
    keep_ratios = tables.inner
    # labels[i]: Pareto front of (kept bytes so far, cost so far, parent) at position i; each
    # position's labels are final before it extends the segments that start there.
    start = [(0, 0.0, None)]
    # Labels reaching each position: a list, or with a quantum a dict by bucket of bytes.
    pending: list = [{} if quantum else [] for _ in positions]
    compact_at = [_COMPACT_AT_LABELS] * len(positions)
    for a_index in range(-1, len(positions)):
        if deadline is not None and time.perf_counter() > deadline:
            raise DeadlinePassed()
        if a_index >= 0:
            pending[a_index] = _pareto(list(pending[a_index].values()) if quantum
                                       else pending[a_index], quantum)
        at_a = start if a_index < 0 else pending[a_index]
        if at_a:
            _extend(tables, a_index, at_a, pending, compact_at, budget_bytes,
                    len(keep_ratios), quantum)
    best = None
    for a_index in range(-1, len(positions)):
        for label in (start if a_index < 0 else pending[a_index]):
            if label[0] + tables.must_bytes + tables.top(a_index) <= budget_bytes:
                if best is None or label[1] < best[1][1]:
                    best = (a_index, label)
    if best is None:
        return None
    cuts, kept_inside = _trace_back(tables, *best)
    return cuts, frozenset(kept_inside)


def solve_dp(problem: problem_lib.BudgetProblem) -> plan_lib.Plan:
    """Exact cuts under the decomposed peak, checked by the replay (see :func:`dp_cuts`);
    anytime: on :data:`DP_FIRST_POSITIONS` positions first, then twice as many while the
    deadline (``problem.deadline_seconds``, default :data:`DP_DEADLINE_SECONDS`) allows, up
    to every position (at most :data:`DP_MAX_POSITIONS`); the cheapest plan the replay
    accepts stands. Proven optimal (for its model) only when the DP ran on every position."""
    started = time.perf_counter()
    deadline = started + (DP_DEADLINE_SECONDS if problem.deadline_seconds is None
                          else problem.deadline_seconds)
    scorer = problem_lib.Scorer(problem)
    scorer(problem.must_keep)
    search = planners.CutSearch.of(problem.graph, problem.must_keep, problem.candidates)
    every = len(search.positions())
    proven = False
    count = min(DP_FIRST_POSITIONS, every)
    first = True
    while count:
        try:
            # The first, coarsest round always finishes (a fraction of a second), so that
            # even a deadline already past has a plan to answer with.
            proven = _dp_rounds(problem, scorer, search, search.positions(count),
                                None if first else deadline,
                                exact=count == every and count <= DP_MAX_POSITIONS)
        except DeadlinePassed:
            _LOG.debug("memsave_grads: dp: out of time on %d positions", count)
            break
        first = False
        if proven or count >= min(every, DP_MAX_POSITIONS) or time.perf_counter() > deadline:
            break
        count = min(2 * count, every, DP_MAX_POSITIONS)
    return scorer.plan("dp", started, optimal=proven)


def _dp_rounds(problem: problem_lib.BudgetProblem, scorer: problem_lib.Scorer,
               search: planners.CutSearch, positions: list[int], deadline: float | None,
               exact: bool) -> bool:
    """The DP on ``positions``, its budget lowered while the replay finds the plan over it
    (at most :data:`DP_RETRIES` times); whether it proved its plan optimal."""
    budget_bytes = problem.budget_bytes
    for _ in range(DP_RETRIES):
        found = dp_cuts(problem, search, positions, budget_bytes, deadline=deadline) \
            if positions else None
        if found is None:
            return False
        _, peak, _ = scorer(search.kept_for(found[0]))
        if peak <= problem.budget_bytes:
            return exact and budget_bytes == problem.budget_bytes
        budget_bytes -= peak - problem.budget_bytes  # the replay disagrees: ask for less
    return False
