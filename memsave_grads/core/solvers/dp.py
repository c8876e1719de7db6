"""An exact dynamic program over cut positions (``"dp"``), for chains of segments."""

from __future__ import annotations

import bisect
import logging
import math
import time
from typing import Sequence

import numpy as np

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
        self._segments: dict = {}  # by way of recomputing: see _table
        self._segment_lists: dict = {}
        #: The retained bytes up to each position (the bound that ends a segment's growth).
        self.retained_at = np.asarray([self.retained_sum[p + 1] for p in positions],
                                      dtype=np.int64)
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
        if mode not in self._segment_lists:  # the exact DP reads one at a time: Python numbers
            self._segment_lists[mode] = tuple(table.tolist() for table in self._table(mode))
        new_bytes, seg_cost, local = self._segment_lists[mode]
        return (new_bytes[a_index + 1][b_index], seg_cost[a_index + 1][b_index],
                local[a_index + 1][b_index])

    def segment_rows(self, a_index: int, mode: int, b_end: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`segment` of every segment from ``a_index`` to the positions before
        ``b_end``, as arrays indexed by ``b_index - a_index - 1``."""
        return tuple(table[a_index + 1, a_index + 1:b_end] for table in self._table(mode))

    def _table(self, mode: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every segment's (new kept bytes, recompute cost, local peak) for one way of
        recomputing, as arrays by (``a_index + 1``, ``b_index``); entries with
        ``b_index <= a_index`` mean nothing.

        A segment (a, b]'s new kept bytes are b's frontier nodes after a (plus, keeping
        nodes, the kept nodes of (a, b] not in it); it recomputes (a, b] but them; its local
        peak is what (a, b] retains but them, b's frontier and the transient. The sums over
        "frontier nodes after a" come from each frontier's nodes sorted, with prefix sums."""
        if mode in self._segments:
            return self._segments[mode]
        size = np.asarray(self.size, dtype=np.int64)
        cost = np.asarray(self.cost, dtype=np.float64)
        retained = np.asarray(self.retained, dtype=np.int64)
        keeps = np.asarray(self.inner[mode][0], dtype=bool)
        count = len(self.positions)
        # starts[a_index + 1] = a + 1, ends[b_index] = b + 1: the prefix sums' bounds.
        starts = np.asarray([0] + [p + 1 for p in self.positions], dtype=np.int64)
        ends = starts[1:]
        # Every frontier's nodes in one array, by frontier then node; the first node after a
        # in frontier b is at the search for (b, a) in (frontier, node) order.
        lengths = np.asarray([len(f) for f in self.fronts], dtype=np.int64)
        nodes = np.asarray([v for f in self.fronts for v in f], dtype=np.int64)
        owner = np.repeat(np.arange(count, dtype=np.int64), lengths)
        stride = self.n + 1
        first_after = np.searchsorted(
            owner * stride + nodes,
            np.arange(count, dtype=np.int64)[None, :] * stride + starts[:, None], side="left")
        front_end = np.cumsum(lengths)

        def after(values: np.ndarray) -> np.ndarray:
            """Sum of ``values`` over each frontier's nodes after each a."""
            running = np.concatenate(([0], np.cumsum(values[nodes])))
            return running[front_end][None, :] - running[first_after]

        def within(prefix) -> np.ndarray:
            """Sum over each segment's nodes, from a prefix sum over nodes."""
            prefix = np.asarray(prefix)
            return prefix[ends][None, :] - prefix[starts][:, None]

        new_bytes = after(size)
        seg_cost = within(self.cost_sum) - after(cost)
        local = (within(self.retained_sum) - after(retained)
                 + np.asarray(self.front_bytes, dtype=np.int64)[None, :] + self.transient)
        if keeps.any():
            _, bytes_sum, kept_cost_sum, kept_retained_sum = self.inner[mode]
            extra = within(bytes_sum) - after(np.where(keeps, size, 0))
            new_bytes = new_bytes + extra
            seg_cost = seg_cost - (within(kept_cost_sum) - after(np.where(keeps, cost, 0.0)))
            local = local + extra - (within(kept_retained_sum)
                                     - after(np.where(keeps, retained, 0)))
        self._segments[mode] = result = (new_bytes, seg_cost, local)
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


def _trace_back(tables: _Tables, index: int, label, parent=lambda index, label: label[2]
                ) -> tuple[tuple, set]:
    """The cuts and the nodes kept inside segments of the label's path; ``parent(index,
    label)`` is the (position index, label, way of recomputing) it extends."""
    cuts, kept_inside = [], set()
    while index >= 0:
        b = tables.positions[index]
        index, label, mode = parent(index, label)
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
    if quantum:
        return _solved_in_buckets(tables, budget_bytes, quantum, deadline)
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


class _Buckets:
    """The bucketed DP's labels (design note "planning cost"): at each position, one label per
    bucket of ``quantum`` kept bytes, the cheapest, as dense arrays over (position, bucket),
    so that a position's labels extend every segment starting there in a few array
    operations rather than a Python loop over labels and segments.

    The same labels, and so the same plans, as the loop it replaces (which kept a dict by
    bucket per position): a label replaces a bucket's only when strictly cheaper, so of
    equal costs the first inserted stays; insertions came by segment start, then segment
    end, way of recomputing and label (cheapest bytes first), and a bucket is only ever
    written from one segment end, so within one start and way of recomputing the first of
    the cheapest labels per bucket wins, then the bucket's holder unless strictly beaten.
    """

    def __init__(self, count: int, budget_bytes: int, quantum: int, modes: int):
        buckets = budget_bytes // quantum + 1  # a label that fits holds at most the budget
        self.quantum, self.buckets = quantum, buckets
        self.cost = np.full(count * buckets, np.inf)
        self.bytes = np.zeros(count * buckets, dtype=np.int64)
        # The label each one extends, as one number (:meth:`parent`): its position index, its
        # index in that position's front (< buckets), the way of recomputing the segment.
        self.modes = modes
        self.extends = np.zeros(count * buckets, dtype=np.int64)
        #: Per position: its Pareto front's cells (position * buckets + bucket), bytes and
        #: costs, cheapest bytes first.
        self.fronts: dict = {-1: (np.full(1, -1, dtype=np.int64), np.zeros(1, dtype=np.int64),
                                  np.zeros(1))}

    def close(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Position ``index``'s labels are final: its front, the labels no other beats in both
        bytes and cost (by bucket, so by bytes: keep each cheaper than every lighter one)."""
        cells = index * self.buckets + np.flatnonzero(
            np.isfinite(self.cost[index * self.buckets:(index + 1) * self.buckets]))
        cost = self.cost[cells]
        if len(cost):
            lighter_best = np.concatenate(([np.inf], np.minimum.accumulate(cost)[:-1]))
            cells = cells[cost < lighter_best]
        self.fronts[index] = front = (cells, self.bytes[cells], self.cost[cells])
        return front

    def extend(self, tables: _Tables, a_index: int, budget_bytes: int) -> None:
        """Extend position ``a_index``'s front by every segment starting there that fits."""
        _, front_bytes, front_cost = self.fronts[a_index]
        if not len(front_bytes):
            return
        a = tables.positions[a_index] if a_index >= 0 else -1
        # local >= the retained bytes of (a, b] + transient, which only grow with b.
        bound = (budget_bytes - int(front_bytes[0]) - tables.must_bytes - tables.transient
                 + tables.retained_sum[a + 1])
        b_end = max(int(np.searchsorted(tables.retained_at, bound, side="right")), a_index + 1)
        if b_end <= a_index + 1:
            return
        labels_count = len(front_bytes)
        first_cell = np.arange(a_index + 1, b_end, dtype=np.int64)[:, None] * self.buckets
        for mode in range(self.modes):
            new_bytes, seg_cost, local = tables.segment_rows(a_index, mode, b_end)
            # Every (segment, label) at once, by segment end then label (so by bytes); a
            # label that the segment does not fit with costs infinity and so never wins.
            fits = front_bytes <= (budget_bytes - tables.must_bytes - local)[:, None]
            label_cost = np.where(fits, front_cost + seg_cost[:, None], np.inf).ravel()
            label_bytes = front_bytes + new_bytes[:, None]
            # (A label that fits holds at most the budget: the clip only moves ones that
            # do not into the segment's last bucket, where they cannot win.)
            cell = (first_cell + np.minimum(label_bytes // self.quantum, self.buckets - 1)
                    ).ravel()
            label_bytes = label_bytes.ravel()
            # Cells only grow along the candidates: one cell's candidates are a run; each
            # run's winner is its first cheapest.
            total = len(cell)
            run_start = np.empty(total, dtype=bool)
            run_start[0] = True
            np.not_equal(cell[1:], cell[:-1], out=run_start[1:])
            starts = run_start.nonzero()[0]
            run_min = np.minimum.reduceat(label_cost, starts)
            cheapest = label_cost == run_min[run_start.cumsum() - 1]
            first = np.minimum.reduceat(np.where(cheapest, np.arange(total), total), starts)
            won = first[label_cost[first] < self.cost[cell[first]]]
            target = cell[won]
            self.cost[target] = label_cost[won]
            self.bytes[target] = label_bytes[won]
            self.extends[target] = (((a_index + 1) * self.buckets + won % labels_count)
                                    * self.modes + mode)

    def parent(self, index: int, label: int) -> tuple[int, int, int]:
        """The (position index, label, way of recomputing) that label ``label`` of position
        ``index``'s front extends."""
        code = int(self.extends[self.fronts[index][0][label]])
        code, mode = divmod(code, self.modes)
        position, label = divmod(code, self.buckets)
        return position - 1, label, mode


def _solved_in_buckets(tables: _Tables, budget_bytes: int, quantum: int,
                       deadline: float | None) -> tuple[tuple, frozenset] | None:
    """:func:`_solved` with a quantum: one label per position and bucket (:class:`_Buckets`,
    ``budget_bytes // quantum + 1`` of them a position)."""
    if budget_bytes < 0:  # a seed's retries lower the budget by the replay's overshoot
        return None
    positions = tables.positions
    labels = _Buckets(len(positions), budget_bytes, quantum, len(tables.inner))
    best = None  # (cost, position index, label)
    for a_index in range(-1, len(positions)):
        if deadline is not None and time.perf_counter() > deadline:
            raise DeadlinePassed()
        _, front_bytes, front_cost = (labels.fronts[-1] if a_index < 0
                                      else labels.close(a_index))
        labels.extend(tables, a_index, budget_bytes)
        fits = np.flatnonzero(front_bytes + tables.must_bytes + tables.top(a_index)
                              <= budget_bytes)
        if len(fits):
            cheapest = int(fits[np.argmin(front_cost[fits])])
            if best is None or front_cost[cheapest] < best[0]:
                best = (float(front_cost[cheapest]), a_index, cheapest)
    if best is None:
        return None
    cuts, kept_inside = _trace_back(tables, best[1], best[2], labels.parent)
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
