"""Budget solvers: one contract, :class:`~budgets.BudgetProblem` in, :class:`~budgets.BudgetPlan` out.

Every solver minimises the recompute cost of a plan subject to its predicted peak fitting the
budget, and every one scores plans with the same static models (``budgets.score``: the memory
replay and the per-node cost), so their answers are comparable (design note "budget solvers"):

* :func:`solve_greedy` (``"greedy"``, the default), in phases, keeping the cheapest plan that
  fits: (1) Chen et al.'s budget search generalised to frontier cuts: for a grid of segment
  caps it places cuts as ``"memory"`` does, then drops trailing cuts (a larger top segment is
  never recomputed) while the plan fits, and fills the cheapest plans and those with the most
  budget left (keeps recomputed nodes that cost most per byte, a prefix of that order);
  (2) fast DP seeds: :func:`_dp_cuts` on at most ``GREEDY_DP_POSITIONS`` positions with
  bucketed labels, recomputing segments whole or keeping their costly nodes, each plan checked
  by the replay and filled; (3) fills that skip nodes that do not fit. It stops scoring plans
  after ``GREEDY_SECONDS`` (under a second on every benchmark graph).
* :func:`solve_dp` (``"dp"``): an exact dynamic program over cut positions, for graphs that
  are chains of segments (every frontier small). It finds the cheapest set of cuts under a
  decomposed (segment by segment) peak, then checks the plan with the replay, tightening the
  budget if the replay disagrees.
* :func:`solve_milp` (``"milp"``): an exact mixed-integer program over *kept sets* (not only
  cuts), for small general graphs, with HiGHS through ``scipy.optimize.milp``. Its memory rows
  are a *valid relaxation* of the replay (for every kept set, each is at most the replayed
  peak; see :func:`_milp_model`), so its optimum is a lower bound of the true optimum. Each
  solution is replayed and, if rejected, excluded (a no-good cut); the plan is proven optimal
  (``optimal=True``) once the best plan replayed costs no more than the MILP's bound. Used to
  validate the heuristic.

These three plan a single recomputation level (each segment replayed once from kept tensors),
so for them the smallest feasible budget is the ``"memory"`` plan's peak; ``"revolve"``
(``multilevel``) plans nested levels, and :func:`solve` hands it any budget below that.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from typing import Callable, Sequence

from absl import logging

from memsave_grads.core import budgets
from memsave_grads import errors
from memsave_grads.core import graph as graph_lib
from memsave_grads.core import memory_model
from memsave_grads.core import multilevel
from memsave_grads.core import planners

#: Segment caps the greedy solver tries (a geometric grid, as for ``"memory"``).
GREEDY_CAP_POINTS = 24
#: Plans (the cheapest that fit) the greedy solver tries to improve by keeping more nodes.
GREEDY_FILL_PLANS = 3
#: The fill does not try nodes whose cost is under this share of the plan's recompute cost.
GREEDY_FILL_MIN_SHARE = 1e-3
#: The greedy solver starts no new DP seed this many seconds after it started, and scores no
#: new plan after GREEDY_SECONDS (once one fits: it then returns the best so far). On graphs
#: of <= 200 ops it finishes well before either.
GREEDY_DP_SECONDS = 0.45
GREEDY_SECONDS = 0.7
#: The greedy solver's DP seeds: at most this many cut positions (thinned evenly), one label
#: per bucket of 1/GREEDY_DP_LABELS of the budget, at most GREEDY_DP_RETRIES replays per seed.
GREEDY_DP_POSITIONS = 80
GREEDY_DP_LABELS = 64
GREEDY_DP_RETRIES = 6
#: One seed recomputes whole segments; each other keeps the nodes of a segment whose cost per
#: byte is at least this quantile (over the candidates), and recomputes the rest.
GREEDY_DP_QUANTILES = (0.75, 0.9, 0.5)
#: The dynamic program considers at most this many cut positions; on larger graphs it thins
#: them evenly and no longer claims optimality.
DP_MAX_POSITIONS = 400
#: Times the DP tightens its budget when the replay finds its plan over budget.
DP_RETRIES = 6
#: The MILP refuses graphs larger than this (it grows quadratically in practice).
MILP_MAX_NODES = 600
#: Solutions the MILP may reject (replay over budget, each then excluded) before it gives up
#: on optimality; the time limit usually ends it first.
MILP_MAX_ROUNDS = 1000
MILP_TIME_LIMIT_SECONDS = 30.0
#: The MILP's pair variables (see :func:`_milp_model`) are limited to about this many; beyond
#: it each node looks back over a shorter window of ancestors (still a valid lower bound).
MILP_MAX_PAIRS = 40000
#: Single-owner rows are written for nodes whose branch region (up to their nearest
#: post-dominator) has at most this many nodes.
MILP_REGION_NODES = 60


class _OutOfTime(Exception):
    """A scorer's deadline passed (and it has a plan that fits)."""


class _Scorer:
    """Scores plans once each (a replay is the expensive step) and remembers the best fit.

    With a ``deadline`` (``time.perf_counter()``), scoring a new plan after it raises
    :class:`_OutOfTime`, but only once some plan fits: the search stops, the best plan stands.
    """

    def __init__(self, problem: budgets.BudgetProblem, deadline: float = math.inf):
        self.problem = problem
        self.deadline = deadline
        self.cache: dict[frozenset, tuple[frozenset, int, float]] = {}
        self.smallest_peak = math.inf
        self.best: tuple[frozenset, int, float] | None = None

    def __call__(self, kept) -> tuple[frozenset, int, float]:
        key = frozenset(kept)
        if key not in self.cache:
            if self.best is not None and time.perf_counter() > self.deadline:
                raise _OutOfTime()
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


def _fill(problem: budgets.BudgetProblem, scorer: _Scorer, kept: frozenset,
          deadline: float = math.inf, skip: bool = True) -> None:
    """Spend the budget left by ``kept`` on keeping recomputed nodes, most cost per byte first.

    Runs of nodes that fit are found by galloping then binary search (one replay per probe);
    a node that does not fit is skipped, not the end: smaller or cheaper-to-hold ones after it
    still get their turn (``skip=False``: the first such node ends the fill). Nodes whose cost
    is negligible (under ``GREEDY_FILL_MIN_SHARE`` of the plan's recompute cost) are not
    tried. Stops at ``deadline`` (``time.perf_counter()``).
    """
    graph = problem.graph
    current, _, cost = scorer(kept)
    floor = GREEDY_FILL_MIN_SHARE * cost
    extra = sorted((v for v in budgets.recomputed_nodes(problem, current)
                    if v in problem.candidates and graph.cost_of(v) > floor),
                   key=lambda v: (-graph.cost_of(v) / max(graph.size_bytes[v], 1), v))
    i = 0
    while i < len(extra) and time.perf_counter() < deadline:
        rest = len(extra) - i

        def fits(k, base=current, start=i):
            return scorer.fits(base | set(extra[start:start + k]))

        good, bad, k = 0, None, 1
        while True:  # gallop: 1, 2, 4, ... nodes while they fit
            k = min(k, rest)
            if fits(k):
                good = k
                if k == rest:
                    break
                k *= 2
            else:
                bad = k
                break
        if bad is not None and bad - good > 1:
            good = _last_true(good, bad - 1, fits)
        if good:
            current = scorer(current | set(extra[i:i + good]))[0]
        if not skip:
            return
        i += good + 1  # extra[i + good] did not fit: skip it


def solve_greedy(problem: budgets.BudgetProblem) -> budgets.BudgetPlan:
    """Budget search over frontier-cut plans, fast DP seeds, then fill (module docstring)."""
    started = time.perf_counter()
    scorer = _Scorer(problem, deadline=started + GREEDY_SECONDS)
    nothing = scorer(problem.must_keep)  # plain tf.gradients (kept: only what must be)
    if nothing[1] <= problem.budget_bytes and nothing[2] == 0:
        return scorer.plan("greedy", started, optimal=True)
    try:
        _greedy_search(problem, scorer, started)
    except _OutOfTime:
        logging.vlog(1, "memsave_grads: greedy: out of time, best plan so far")
    return scorer.plan("greedy", started)


def _greedy_search(problem: budgets.BudgetProblem, scorer: _Scorer, started: float) -> None:
    """The greedy solver's phases, best plans first; ``scorer`` keeps the best that fits and
    ends the search at its deadline."""
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
        _fill(problem, scorer, kept, skip=False)
    if search.feasible:
        _dp_seeds(problem, scorer, search, started + GREEDY_DP_SECONDS)
    # With the time left, fill the best plans again, now skipping nodes that do not fit.
    fitting = [r for r in scorer.cache.values() if r[1] <= problem.budget_bytes]
    for result in sorted(fitting, key=lambda r: (r[2], r[1]))[:GREEDY_FILL_PLANS]:
        _fill(problem, scorer, result[0])


def _dp_seeds(problem: budgets.BudgetProblem, scorer: _Scorer, search: planners.CutSearch,
              deadline: float) -> None:
    """Fast, inexact DP plans (few positions, rounded labels; see :func:`_dp_cuts`), each
    checked by the replay (the DP budget tightened by the overshoot if it disagrees), then
    filled. The ways a segment may be recomputed: whole, or keeping its nodes that cost at
    least a quantile of cost per byte (``GREEDY_DP_QUANTILES``)."""
    graph = problem.graph
    allowed = [p for p in range(graph.num_nodes) if search.allowed[p]]
    ratios = sorted(graph.cost_of(v) / max(graph.size_bytes[v], 1) for v in problem.candidates
                    if v not in problem.must_keep and graph.cost_of(v) > 0)
    if not ratios or not allowed:
        return
    quantum = max(problem.budget_bytes // GREEDY_DP_LABELS, 1)
    # The DP's model is not the replay's, so other positions give other plans: a second round
    # with half as many positions, if time is left.
    for count, quantile in itertools.product(
            (GREEDY_DP_POSITIONS, GREEDY_DP_POSITIONS // 2), (None,) + GREEDY_DP_QUANTILES):
        step = max(len(allowed) / count, 1.0)
        positions = sorted({allowed[int(i * step)] for i in range(min(count, len(allowed)))})
        modes = (None,) if quantile is None else (
            None, ratios[min(int(quantile * len(ratios)), len(ratios) - 1)])
        budget_bytes, previous, factor = problem.budget_bytes, None, 1
        for _ in range(GREEDY_DP_RETRIES):
            if time.perf_counter() >= deadline:
                return
            found = _dp_cuts(problem, search, positions, budget_bytes, modes, quantum, deadline)
            if found is None:
                break
            kept, peak, _ = scorer(search.kept_for(found[0]) | found[1])
            if peak <= problem.budget_bytes:
                _fill(problem, scorer, kept, skip=False)
                break
            # The replay disagrees: ask for less (twice as much less each time the same plan
            # comes back).
            factor = factor * 2 if kept == previous else 1
            previous = kept
            budget_bytes -= factor * (peak - problem.budget_bytes)


# --------------------------------------------------------------------------------------------
# Dynamic program over cut positions
# --------------------------------------------------------------------------------------------


def _prefix(values) -> list:
    out, running = [0], 0
    for value in values:
        running += value
        out.append(running)
    return out


def _dp_cuts(problem: budgets.BudgetProblem, search: planners.CutSearch, positions: list[int],
             budget_bytes: int, keep_ratios: Sequence[float | None] = (None,),
             quantum: int = 0, deadline: float = math.inf) -> tuple[tuple, set] | None:
    """The cheapest cuts (a subset of ``positions``) under the decomposed peak, or None.

    Decomposed peak of cuts q_1 < ... < q_m (q_0 = -1): while segment (q_{i-1}, q_i] is
    recomputed, the frontiers of q_1..q_{i-1} are held, plus the segment's retained bytes, the
    gradient of q_i's frontier and a transient of two nodes; at the top, every frontier is held
    plus the retained bytes after q_m. Costs and kept bytes add up over segments.

    ``keep_ratios``: the ways a segment may be recomputed. ``None``: all of it; a number r: its
    nodes that cost at least r per byte are kept too (they are held like frontiers from then
    on, are not recomputed, and are counted at full size in the segment's local peak). Returns
    the cuts and the nodes kept inside segments. ``quantum``: at most one label per position
    and bucket of this many kept bytes, the cheapest (fewer labels: fast, no longer exact). Gives up (None) at
    ``deadline``.
    """
    graph = problem.graph
    n = graph.num_nodes
    size = graph.size_bytes
    must = set(problem.must_keep)
    must_bytes = sum(size[v] for v in must)
    cost = [0.0 if v in must else graph.cost_of(v) for v in range(n)]
    retained = memory_model.retained_bytes(graph)
    cost_sum, retained_sum = _prefix(cost), _prefix(retained)
    transient = 2 * max(size, default=0)
    fronts = graph_lib.frontiers(graph, positions, uses=search.uses)
    front_bytes = [sum(size[v] for v in f) for f in fronts]
    # Per way of recomputing: which nodes it keeps inside a segment, and prefix sums of their
    # bytes, costs and retained bytes.
    inner = []
    for ratio in keep_ratios:
        keeps = [ratio is not None and v in problem.candidates and v not in must and cost[v] > 0
                 and cost[v] >= ratio * max(size[v], 1) for v in range(n)]
        inner.append((keeps, _prefix(size[v] if keeps[v] else 0 for v in range(n)),
                      _prefix(cost[v] if keeps[v] else 0.0 for v in range(n)),
                      _prefix(retained[v] if keeps[v] else 0 for v in range(n))))

    def segment(a_index: int, b_index: int, mode: int) -> tuple[int, float, int]:
        """(new kept bytes, recompute cost, local peak) of the segment between two positions."""
        a = positions[a_index] if a_index >= 0 else -1
        b = positions[b_index]
        new = [v for v in fronts[b_index] if v > a]
        new_bytes = sum(size[v] for v in new)
        seg_cost = cost_sum[b + 1] - cost_sum[a + 1] - sum(cost[v] for v in new)
        local = (retained_sum[b + 1] - retained_sum[a + 1] - sum(retained[v] for v in new)
                 + front_bytes[b_index] + transient)
        keeps, bytes_sum, kept_cost_sum, kept_retained_sum = inner[mode]
        if mode:
            extra = bytes_sum[b + 1] - bytes_sum[a + 1] - sum(size[v] for v in new if keeps[v])
            new_bytes += extra
            seg_cost -= kept_cost_sum[b + 1] - kept_cost_sum[a + 1] - sum(
                cost[v] for v in new if keeps[v])
            local += extra - (kept_retained_sum[b + 1] - kept_retained_sum[a + 1] - sum(
                retained[v] for v in new if keeps[v]))
        return new_bytes, seg_cost, local

    def top(a_index: int) -> int:
        a = positions[a_index] if a_index >= 0 else -1
        return retained_sum[n] - retained_sum[a + 1] + transient

    # labels[i]: Pareto front of (kept bytes so far, cost so far, parent) at position i; each
    # position's labels are final before it extends the segments that start there.
    start = [(0, 0.0, None)]
    # Labels reaching each position: a list, or with a quantum a dict by bucket of bytes.
    pending: list = [{} if quantum else [] for _ in positions]

    def pareto(candidates):
        candidates.sort(key=lambda c: (c[0], c[1]))
        front, best_cost = [], math.inf
        for c in candidates:  # keep the labels no other beats in both bytes and cost
            if c[1] < best_cost:
                if quantum and front and c[0] // quantum == front[-1][0] // quantum:
                    front[-1] = c  # one label per bucket of bytes: the cheapest
                else:
                    front.append(c)
                best_cost = c[1]
        return front

    for a_index in range(-1, len(positions)):
        if time.perf_counter() > deadline:
            return None
        if a_index >= 0:
            pending[a_index] = pareto(list(pending[a_index].values()) if quantum
                                      else pending[a_index])
        at_a = start if a_index < 0 else pending[a_index]
        if not at_a:
            continue
        at_bytes = [label[0] for label in at_a]
        lightest = at_a[0][0]
        a = positions[a_index] if a_index >= 0 else -1
        for b_index in range(a_index + 1, len(positions)):
            b = positions[b_index]
            # local >= the retained bytes of (a, b] + transient, which only grow with b.
            if lightest + must_bytes + retained_sum[b + 1] - retained_sum[a + 1] + \
                    transient > budget_bytes:
                break
            for mode in range(len(keep_ratios)):
                new_bytes, seg_cost, local = segment(a_index, b_index, mode)
                # Labels are sorted by bytes: the ones this segment fits with are a prefix.
                fitting = bisect.bisect_right(at_bytes, budget_bytes - must_bytes - local)
                if not quantum:
                    pending[b_index].extend(
                        (label[0] + new_bytes, label[1] + seg_cost, (a_index, label, mode))
                        for label in at_a[:fitting])
                    continue
                buckets = pending[b_index]
                for label in at_a[:fitting]:
                    key = (label[0] + new_bytes) // quantum
                    held = buckets.get(key)
                    if held is None or label[1] + seg_cost < held[1]:
                        buckets[key] = (label[0] + new_bytes, label[1] + seg_cost,
                                        (a_index, label, mode))
    best = None
    for a_index in range(-1, len(positions)):
        for label in (start if a_index < 0 else pending[a_index]):
            if label[0] + must_bytes + top(a_index) <= budget_bytes:
                if best is None or label[1] < best[1][1]:
                    best = (a_index, label)
    if best is None:
        return None
    cuts, kept_inside = [], set()
    index, label = best
    while index >= 0:
        b = positions[index]
        index, label, mode = label[2]
        a = positions[index] if index >= 0 else -1
        cuts.append(b)
        keeps = inner[mode][0]
        kept_inside.update(v for v in range(a + 1, b + 1) if keeps[v])
    return tuple(reversed(cuts)), kept_inside


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
        found = _dp_cuts(problem, search, positions, budget_bytes) if positions else None
        if found is None:
            break
        _, peak, _ = scorer(search.kept_for(found[0]))
        if peak <= problem.budget_bytes:
            proven = exact and budget_bytes == problem.budget_bytes
            break
        budget_bytes -= peak - problem.budget_bytes  # the replay disagrees: ask for less
    return scorer.plan("dp", started, optimal=proven)


# --------------------------------------------------------------------------------------------
# MILP over kept sets
# --------------------------------------------------------------------------------------------


def _milp_facts(graph: graph_lib.ForwardGraph, not_replayed, candidates) -> dict:
    """Plan-independent facts the MILP's memory rows rest on (see :func:`_milp_model`).

    * ``runs[v]``: v's backward step runs under every plan: it produces a ``y`` and may not be
      kept, or its gradient is allocated, i.e. it has bytes and some reader's step runs.
    * ``has_grad[v]``: v's own gradient is allocated before its step.
    * ``release[u]``: the step after which a non-kept ``u`` is freed, when all its readers are
      in its own segment (true for every non-kept node of a closed plan: single owner); ``None``
      if nothing retains it.
    * ``bad[v]``: v is a never-replayed node or an ancestor of one (its step may never run).
    * ``ancestors[v]``: bitset of v's ancestors along paths that pass no never-replayed node.
    """
    n = graph.num_nodes
    consumers = graph.consumers()
    nr = set(not_replayed)
    bad, runs, has_grad = [False] * n, [False] * n, [False] * n
    for v in reversed(range(n)):
        bad[v] = v in nr or any(bad[c] for c in consumers[v])
        has_grad[v] = graph.size_bytes[v] > 0 and any(runs[c] for c in consumers[v])
        # A kept node that produces a y but gets no gradient is never backpropagated.
        runs[v] = (graph.feeds_sink[v] and v not in candidates) or has_grad[v]
    release = []
    for u in range(n):
        readers = [c for c in consumers[u] if graph.gradient_reads_input(c, u)]
        if graph.gradient_reads_output(u):
            readers.append(u)
        release.append(min(readers) if readers else (u if graph.feeds_sink[u] else None))
    ancestors = [0] * n
    for v in range(n):
        bits = 0
        for p in set(graph.inputs[v]):
            bits |= (1 << p) | (0 if p in nr else ancestors[p])
        ancestors[v] = bits
    return {"bad": bad, "runs": runs, "has_grad": has_grad, "release": release,
            "ancestors": ancestors}


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _milp_model(problem: budgets.BudgetProblem, max_pairs: int | None = None):
    """The MILP (see :func:`solve_milp`) as a dict of numpy/scipy parts.

    Variables per node v: x_v (kept, binary), t_v (in the top segment, binary), y_v (a retained
    output of the top), h_v / l_v (the largest / smallest t over v's readers); and per pair
    (u, v), u an ancestor of v: s_uv, at least 1 when u is not kept and reaches v along nodes
    that are not kept (so u is recomputed in v's segment, or is in the top with v).

    The memory rows ``A z + c <= budget`` are a *valid relaxation*: for every closed kept set
    (with t its top, and y, s at their smallest) each left-hand side is at most the replay's
    peak (``memory_model.plan_peak_bytes``); tests/test_solvers.py checks this by enumeration.
    Rows: (a) bytes alive when the forward pass ends; (b) when node v is allocated in the
    forward pass; (c) at the backward step of a top node v: every kept node, the top's
    retained outputs not freed yet, v's step (its gradient, its inputs' gradients, its
    variables' gradients); (d) at the backward step of any node v, in whatever segment: the
    kept ancestors of v (a kept ancestor has a higher level than v's segment, so it is still
    held), v's inputs its gradient reads (kept, or retained in v's segment), the retained
    outputs of v's own segment not freed yet (the s terms), v's own output if its gradient
    reads it, gradients already produced for its ancestors, and v's step. A buffer that an
    elementwise op may take over (``forwards_buffer``) is counted once. Single-owner rows
    between segments: see the comment above them. Returns the MILP's parts, the memory rows'
    constants and labels, and the pair variables' columns.
    """
    import numpy as np  # pylint: disable=import-outside-toplevel
    from scipy import sparse  # pylint: disable=import-outside-toplevel

    max_pairs = MILP_MAX_PAIRS if max_pairs is None else max_pairs
    graph = problem.graph
    n = graph.num_nodes
    consumers = graph.consumers()
    size = graph.size_bytes
    buffer = [0 if graph.is_view(v) else size[v] for v in range(n)]
    facts = _milp_facts(graph, problem.not_replayed, problem.candidates)
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
            if graph.gradient_reads_input(c, v):
                add([(y(v), 1), (t(c), -1), (x(v), 1)], 0, np.inf)
        # Read by the top and by a recomputed segment: kept (single owner).
        add([(x(v), 1), (h(v), -1), (l(v), 1)], 0, np.inf)
        if graph.gradient_reads_output(v) or sink:
            add([(y(v), 1), (t(v), -1)], 0, np.inf)

    # Single owner between recomputed segments: a kept w that does not post-dominate u (here:
    # w strictly between u and its nearest post-dominator) gives u two owners unless u is kept
    # or some node between u and w is (then w need not own u). x_w <= x_u + sum of x between.
    descendants = [0] * n
    for v in reversed(range(n)):
        for c in consumers[v]:
            descendants[v] |= (1 << c) | descendants[c]
    sink_bit = 1 << n
    post = [0] * n  # post-dominators (bit n: the virtual sink)
    for v in reversed(range(n)):
        if not consumers[v] and not graph.feeds_sink[v]:
            continue  # dead: nothing reads it
        common = sink_bit if graph.feeds_sink[v] else -1
        for c in consumers[v]:
            common &= post[c] if post[c] else 0
        post[v] = (1 << v) | (common if common != -1 else 0)
    for u in range(n):
        nearer = post[u] & ~(1 << u)
        if not nearer or u in problem.must_keep:
            continue
        nearest = (nearer & -nearer).bit_length() - 1
        if nearest == n:
            continue  # only the virtual sink post-dominates u: the top owns it anyway
        region = descendants[u] & ~descendants[nearest] & ~(1 << nearest)
        region_nodes = _bits(region)
        if len(region_nodes) > MILP_REGION_NODES:
            continue
        for w in region_nodes:
            between = [a for a in region_nodes if a != w and (descendants[a] >> w) & 1]
            if w in problem.candidates:
                add([(x(w), 1), (x(u), -1)] + [(x(a), -1) for a in between], -np.inf, 0)

    # Pair variables s_uv, for the nodes v that get a row (d), over a window of ancestors.
    step = [(size[v] if facts["has_grad"][v] else 0)
            + memory_model.VARIABLE_UPDATE_FACTOR * graph.params_of(v)
            + sum(size[p] for p in set(graph.inputs[v])) for v in range(n)]
    for v in range(n):
        # An elementwise op's gradient may become one input's gradient: count that once.
        if facts["has_grad"][v] and graph.forwards_buffer(v) and any(
                size[p] == size[v] for p in graph.inputs[v]):
            step[v] -= size[v]
    row_nodes = [v for v in range(n) if facts["runs"][v] and not facts["bad"][v]]
    ancestors = facts["ancestors"]
    # later[v]: descendants of v whose step runs; reader_bits[u]: u's readers whose step runs.
    later, reader_bits = [0] * n, [0] * n
    for v in reversed(range(n)):
        for c in consumers[v]:
            if facts["runs"][c]:
                later[v] |= 1 << c
                reader_bits[v] |= 1 << c
            later[v] |= later[c]
    window = n
    while window > 1 and sum(len(_bits(ancestors[v] >> max(v - window, 0)))
                             for v in row_nodes) > max_pairs:
        window //= 2
    pair_index: dict[tuple[int, int], int] = {}
    pair_rows = []  # (v, [(u, coefficient)]) of row (d), built below
    for v in row_nodes:
        first = max(v - window, 0)
        near = [u + first for u in _bits(ancestors[v] >> first)]
        reads_inputs = {p for p in graph.inputs[v] if graph.gradient_reads_input(v, p)}
        release = facts["release"]
        # Retained outputs of v's segment that are still held at v's step.
        held = {u for u in near if u not in reads_inputs and buffer[u]
                and release[u] is not None and release[u] <= v}
        # Nodes on paths from a held node to v (descendants of one, in the window): their s
        # variables carry the path.
        on_path = set()
        for u in sorted(near):
            if u in held or any(p in on_path for p in graph.inputs[u]):
                on_path.add(u)
        for u in on_path:
            pair_index[(u, v)] = 5 * n + len(pair_index)
        pair_rows.append((v, near, reads_inputs, held, on_path))

    # s_uv >= s_cv - x_u for each reader c of u on the way to v (s_vv = 1).
    for (u, v), col in pair_index.items():
        for c in consumers[u]:
            if c == v:
                add([(col, 1), (x(u), 1)], 1, np.inf)
            elif (c, v) in pair_index:
                add([(col, 1), (pair_index[(c, v)], -1), (x(u), 1)], 0, np.inf)

    # Memory rows come last: A z <= budget - c, with c in ``constants``.
    first_memory_row = len(lower)
    constants, labels = [], []

    def memory(terms, constant, label):
        labels.append(label)
        terms = [(col, val) for col, val in terms if val]
        add(terms, -np.inf, 0.0)  # the upper bound is set per budget
        constants.append(float(constant))

    kept_terms = [(x(v), size[v]) for v in range(n) if size[v]]
    # (a) when the forward pass ends.
    memory(kept_terms + [(y(v), buffer[v]) for v in range(n) if buffer[v]], 0, "end")
    # (b) when v is allocated in the forward pass.
    for v in range(n):
        inputs = set(graph.inputs[v])
        terms = [(x(u), size[u]) for u in range(v) if size[u] and u not in inputs]
        terms += [(y(u), buffer[u]) for u in range(v) if buffer[u] and u not in inputs]
        terms += [(x(p), size[p] - buffer[p]) for p in inputs]
        terms.append((x(v), size[v] - buffer[v]))
        # An elementwise op may take over an input's buffer instead of allocating its own.
        donated = max((buffer[p] for p in inputs if buffer[p] in (buffer[v], size[v])),
                      default=0) if graph.forwards_buffer(v) else 0
        memory(terms, buffer[v] + sum(buffer[p] for p in inputs) - donated, ("forward", v))
    # (c) at the backward step of top node v.
    last_reader = [max(consumers[u], default=u) for u in range(n)]
    for v in range(n):
        if not facts["runs"][v] or not step[v]:
            continue
        alive = [(y(u), buffer[u]) for u in range(v + 1) if buffer[u] and last_reader[u] <= v]
        memory(kept_terms + alive + [(t(v), step[v])], 0, ("top", v))
    # (d) at the backward step of v, in any segment.
    for v, near, reads_inputs, held, on_path in pair_rows:
        coefficient = {}
        for u in near:
            coefficient[x(u)] = size[u] - (buffer[u] if u in reads_inputs else 0)
        for u in held:
            coefficient[pair_index[(u, v)]] = buffer[u]
        own = buffer[v] if facts["release"][v] == v else 0
        # Gradients already allocated and not yet freed: of every ancestor u (not an input of
        # v: counted in the step) that a descendant of v reads, whose step has run (it comes
        # before v's: in v's segment, the top or a lower level); u's own step comes after.
        inputs = set(graph.inputs[v])
        pending = sum(size[u] for u in _bits(ancestors[v])
                      if u not in inputs and reader_bits[u] & later[v])
        memory(list(coefficient.items()),
               step[v] + own + pending + sum(buffer[u] for u in reads_inputs), ("step", v))
    num_vars = 5 * n + len(pair_index)
    cost = np.zeros(num_vars)
    for v in range(n):
        # Minimise what is neither kept nor top. An ancestor of a never-replayed node may be
        # in no segment at all (free): it counts 0, so the optimum stays a lower bound.
        if v not in problem.must_keep and not facts["bad"][v]:
            cost[x(v)] = cost[t(v)] = -graph.cost_of(v)
    lo_bounds, hi_bounds = np.zeros(num_vars), np.ones(num_vars)
    hi_bounds[5 * n:] = np.inf
    for v in range(n):
        # A node that is not a candidate may still be kept by the single-owner closure, so
        # its x stays free: the plan taken from a solution keeps candidates only.
        if v in problem.must_keep:
            lo_bounds[x(v)] = 1
        if graph.feeds_sink[v]:
            lo_bounds[h(v)] = 1
    integrality = np.zeros(num_vars)
    integrality[:2 * n] = 1
    matrix = sparse.csr_matrix((vals, (rows, cols)), shape=(len(lower), num_vars))
    return {"cost": cost, "matrix": matrix, "lower": np.array(lower), "upper": np.array(upper),
            "lo_bounds": lo_bounds, "hi_bounds": hi_bounds, "integrality": integrality,
            "first_memory_row": first_memory_row, "constants": np.array(constants),
            "labels": labels,
            "pairs": pair_index, "window": window,
            "fixed_cost": -float(cost.sum()) / 2}


def _natural_assignment(problem: budgets.BudgetProblem, model: dict, kept):
    """The MILP variables of a closed kept set: x, its top, and y, h, l, s at their smallest."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    graph = problem.graph
    n = graph.num_nodes
    consumers = graph.consumers()
    kept = set(kept)
    top = set(memory_model.segments(graph, kept, problem.not_replayed).top)
    z = np.zeros(len(model["cost"]))
    for v in range(n):
        z[v] = v in kept
        z[n + v] = v in top
    for v in range(n):
        readers_top = [z[n + c] for c in consumers[v]]
        y = [z[n + c] - z[v] for c in consumers[v] if graph.gradient_reads_input(c, v)]
        if graph.gradient_reads_output(v) or graph.feeds_sink[v]:
            y.append(z[n + v])
        z[2 * n + v] = max([0.0] + y)
        z[3 * n + v] = max(readers_top + ([1.0] if graph.feeds_sink[v] else []) + [0.0])
        z[4 * n + v] = min(readers_top + [1.0])
    pairs = model["pairs"]
    for (u, v), col in sorted(pairs.items(), key=lambda kv: (kv[0][1], -kv[0][0])):
        best = 0.0
        for c in consumers[u]:
            if c == v:
                best = max(best, 1.0 - z[u])
            elif (c, v) in pairs:
                best = max(best, z[pairs[(c, v)]] - z[u])
        z[col] = best
    return z


def milp_lower_bound(problem: budgets.BudgetProblem, kept, model: dict | None = None) -> int:
    """The largest left-hand side of the MILP's memory rows for a closed kept set: a lower
    bound of its replayed peak (for tests: the relaxation is valid)."""
    model = _milp_model(problem) if model is None else model
    z = _natural_assignment(problem, model, kept)
    first = model["first_memory_row"]
    values = model["matrix"][first:] @ z + model["constants"]
    return int(round(max(values)))


def solve_milp(problem: budgets.BudgetProblem,
               time_limit_seconds: float = MILP_TIME_LIMIT_SECONDS) -> budgets.BudgetPlan:
    """The cheapest kept set under the budget (exact; small graphs; needs scipy).

    The greedy plan comes first: its cost caps the MILP's objective (a plan must not recompute
    more) and it is the answer if the MILP finds nothing better in time. Each MILP solution is
    closed and replayed; one the replay rejects is excluded (a no-good cut) and the MILP solved
    again. Because the memory rows are a valid relaxation, the MILP's optimum is a lower bound
    of the true optimum at every round, so the plan is proven optimal as soon as the best plan
    replayed costs no more than that bound (``optimal=True``); never otherwise.
    """
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
    try:
        scorer(solve_greedy(problem).kept)
        seed_error = None
    except errors.InfeasibleBudgetError as e:
        seed_error = e
    if scorer.best is not None and scorer.best[2] == 0:
        return scorer.plan("milp", started, optimal=True)
    model = _milp_model(problem)
    num_vars = len(model["cost"])
    upper = model["upper"].copy()
    first = model["first_memory_row"]
    scale = 1.0 / max(problem.budget_bytes, 1)
    matrix = model["matrix"].tocsr().copy()
    matrix = sparse.diags(np.concatenate([np.ones(first), np.full(
        matrix.shape[0] - first, scale)])) @ matrix
    upper[first:] = (problem.budget_bytes - model["constants"]) * scale
    cost_scale = 1.0 / max(model["fixed_cost"], 1e-30)
    objective = model["cost"] * cost_scale
    free = [v for v in sorted(problem.candidates) if model["lo_bounds"][v] == 0]
    extra_rows, extra_lower = [], []
    if scorer.best is not None:
        # No plan worth finding recomputes more than the greedy one.
        extra_rows.append(sparse.csr_matrix(-objective))
        extra_lower.append(model["fixed_cost"] * cost_scale - scorer.best[2] * cost_scale
                           * (1 + 1e-9))
    proven = False
    for round_index in range(MILP_MAX_ROUNDS):
        remaining = time_limit_seconds - (time.perf_counter() - started)
        if remaining <= 0:
            break
        constraints = [optimize.LinearConstraint(matrix, model["lower"], upper)]
        if extra_rows:
            constraints.append(optimize.LinearConstraint(
                sparse.vstack(extra_rows), np.array(extra_lower), np.inf))
        result = optimize.milp(objective, constraints=constraints,
                               integrality=model["integrality"],
                               bounds=optimize.Bounds(model["lo_bounds"], model["hi_bounds"]),
                               options={"time_limit": remaining, "mip_rel_gap": 1e-7})
        if result.status == 2:
            # Infeasible: no kept set not yet excluded beats (or, without a greedy plan,
            # meets) the budget's lower bounds, so the best plan replayed is optimal.
            proven = True
            break
        if result.x is None:
            break  # out of time without a solution
        bound = getattr(result, "mip_dual_bound", None)
        if bound is None or not np.isfinite(bound):
            bound = result.fun if result.status == 0 else -np.inf
        lowest_cost = (model["fixed_cost"] * cost_scale + bound) / cost_scale
        kept = {v for v in problem.candidates if result.x[v] > 0.5}
        _, peak, _ = scorer(kept)
        logging.vlog(1, "memsave_grads: milp round %d (%.2f s): status %d, bound %.4g, "
                     "replay peak %d of %d, best %s", round_index,
                     time.perf_counter() - started, result.status, lowest_cost, peak,
                     problem.budget_bytes, scorer.best and scorer.best[2])
        if scorer.best is not None and scorer.best[2] <= lowest_cost * (1 + 1e-6) + 1e-9:
            proven = True
            break
        if result.status != 0:
            break  # out of time: the bound does not close
        # The replay rejects this kept set: exclude it, and every set of candidates between
        # it and its closure (they close to the same plan), and solve again.
        closed = scorer(kept)[0]
        row = np.zeros(num_vars)
        for v in free:
            if v in kept:
                row[v] = -1.0
            elif v not in closed:
                row[v] = 1.0
        extra_rows.append(sparse.csr_matrix(row))
        extra_lower.append(1 - sum(1 for v in free if v in kept))
    if scorer.best is None:
        # Nothing fits (proven when the MILP is infeasible): the greedy solver's error, whose
        # smallest peak is one its plans reach.
        raise seed_error
    return scorer.plan("milp", started, optimal=proven)


SOLVERS: dict[str, Callable[[budgets.BudgetProblem], budgets.BudgetPlan]] = {
    "greedy": solve_greedy,
    "dp": solve_dp,
    "milp": solve_milp,
    "revolve": multilevel.solve_revolve,  # nested levels (design note "multi-level")
}


def solve(problem: budgets.BudgetProblem, solver: str = budgets.DEFAULT_SOLVER) -> budgets.BudgetPlan:
    """``SOLVERS[solver]``; a budget below every single-level plan goes to ``"revolve"``, whose
    nested levels reach lower peaks (if it fails too, the error states the lower of the two
    smallest peaks)."""
    try:
        plan = SOLVERS[solver](problem)
    except errors.InfeasibleBudgetError as single_level:
        if solver == "revolve":
            raise
        try:
            plan = SOLVERS["revolve"](problem)
        except errors.InfeasibleBudgetError as nested:
            # State the lower of the two minimums: on wide graphs revolve's can be higher.
            if nested.min_feasible_bytes <= single_level.min_feasible_bytes:
                raise nested from single_level
            raise single_level from None
        logging.info("memsave_grads: the budget of %d bytes is below every single-level plan "
                     "(%s: smallest %d); planned %d recomputation levels with 'revolve' "
                     "(peak %d, cost %.3g)", problem.budget_bytes, solver,
                     single_level.min_feasible_bytes,
                     multilevel.NestedPlan(plan.kept, plan.nested).levels,
                     plan.predicted_peak_bytes, plan.recompute_cost)
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
