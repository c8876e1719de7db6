"""The default budget solver: frontier-cut searches, DP seeds and fills (``"greedy"``).

See the package docstring for the phases."""

from __future__ import annotations

import logging
import time
from typing import Callable

from memsave_grads.core import plan as plan_lib
from memsave_grads.core import planners
from memsave_grads.core import schedule as schedule_lib
from memsave_grads.core.solvers import problem as problem_lib
from memsave_grads.core.solvers import dp as dp_lib

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

#: Segment caps the greedy solver tries (a geometric grid, as for ``"memory"``).
GREEDY_CAP_POINTS = 24
#: Plans (the cheapest that fit) the greedy solver tries to improve by keeping more nodes.
GREEDY_FILL_PLANS = 3
#: The fill does not try nodes whose cost is under this share of the plan's recompute cost.
GREEDY_FILL_MIN_SHARE = 1e-3
#: The greedy solver's bound on work (:func:`plan_limit`), not on time, so that its plan does
#: not depend on the machine's speed: once a plan fits, it scores at most GREEDY_MAX_PLANS
#: plans, fewer past 1600 ops so that it replays at most GREEDY_REPLAYED_NODES nodes in all,
#: but never fewer than GREEDY_MIN_PLANS. Unbounded (cut search first), its best plan on the
#: budget benchmark's networks (<= 800 ops, 75/50/35% budgets) came by the 206th plan, and
#: within 1% of it by the 163rd; the search went on to 815 plans; bounded, it found the same
#: plans (docs/budgets.md). A replay costs about 10 us per node on 2 CPU cores: up to ~2.7 s
#: on 800 ops, ~5 s on 4000.
GREEDY_MAX_PLANS = 256
GREEDY_REPLAYED_NODES = GREEDY_MAX_PLANS * 1600
GREEDY_MIN_PLANS = 64
#: The greedy solver's DP seeds: at most this many cut positions (thinned evenly), one label
#: per bucket of 1/GREEDY_DP_LABELS of the budget, at most GREEDY_DP_RETRIES replays per seed.
GREEDY_DP_POSITIONS = 80
GREEDY_DP_LABELS = 64
GREEDY_DP_RETRIES = 6
#: One seed recomputes whole segments; each other keeps the nodes of a segment whose cost per
#: byte is at least this quantile (over the candidates), and recomputes the rest.
GREEDY_DP_QUANTILES = (0.75, 0.9, 0.5)
#: :func:`cheapest_within` scores at most this many plans. On the benchmark networks and Keras 3
#: ResNet50/EfficientNetB0 the cheapest plan came by the 65th (MobileNetV2: 0.201 of the forward
#: FLOPs by the 62nd, 0.178 by the 156th); each costs a replay (3-12 ms on 2 CPU cores).
REFINE_MAX_PLANS = 64


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


def _fill(problem: problem_lib.BudgetProblem, scorer: problem_lib.Scorer, kept: frozenset,
          skip: bool = True) -> None:
    """Spend the budget left by ``kept`` on keeping recomputed nodes, most cost per byte first.

    Runs of nodes that fit are found by galloping then binary search (one replay per probe);
    a node that does not fit is skipped, not the end: smaller or cheaper-to-hold ones after it
    still get their turn (``skip=False``: the first such node ends the fill). Nodes whose cost
    is negligible (under ``GREEDY_FILL_MIN_SHARE`` of the plan's recompute cost) are not
    tried.
    """
    graph = problem.graph
    current, _, cost = scorer(kept)
    floor = GREEDY_FILL_MIN_SHARE * cost
    recomputed = schedule_lib.build(graph, current, problem.not_replayed).recomputed_nodes()
    extra = sorted((v for v in recomputed
                    if v in problem.candidates and graph.cost_of(v) > floor),
                   key=lambda v: (-graph.cost_of(v) / max(graph.size_bytes[v], 1), v))
    i = 0
    while i < len(extra):
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


def plan_limit(num_nodes: int) -> int:
    """How many plans the greedy solver scores at most on a graph of ``num_nodes`` nodes."""
    return max(GREEDY_MIN_PLANS, min(GREEDY_MAX_PLANS, GREEDY_REPLAYED_NODES // max(num_nodes, 1)))


def solve_greedy(problem: problem_lib.BudgetProblem) -> plan_lib.Plan:
    """Budget search over frontier-cut plans, fast DP seeds, then fill (module docstring)."""
    started = time.perf_counter()
    scorer = problem_lib.Scorer(problem, max_plans=plan_limit(problem.graph.num_nodes))
    nothing = scorer(problem.must_keep)  # plain tf.gradients (kept: only what must be)
    if nothing[1] <= problem.budget_bytes and nothing[2] == 0:
        return scorer.plan("greedy", started, optimal=True)
    try:
        _greedy_search(problem, scorer, dp_seeds=True)
    except problem_lib.OutOfPlans:
        _LOG.debug("memsave_grads: greedy: %d plans scored, the best so far stands",
                   scorer.scored)
    return scorer.plan("greedy", started)


def cheapest_within(problem: problem_lib.BudgetProblem, kept: frozenset
                    ) -> tuple[tuple[frozenset, int, float], tuple[frozenset, int, float]]:
    """The plan that recomputes least, among ``kept`` (which must fit ``problem``'s budget) and
    those the greedy solver's phases without DP seeds find, and ``kept``'s own score: each as
    ``(kept, peak, cost)``.

    The ``"memory"`` strategy's second step (design note "frontier cuts"): with the budget at
    the lowest peak found, the same peak for less recomputation. Bounded by work, not time
    (at most :data:`REFINE_MAX_PLANS` plans scored), so one graph always gets one plan. The
    DP seeds are left out: they look for plans far from the cuts, and it has the cut plan.
    """
    scorer = problem_lib.Scorer(problem, max_plans=REFINE_MAX_PLANS)
    start = scorer(kept)
    try:
        _greedy_search(problem, scorer, dp_seeds=False)
    except problem_lib.OutOfPlans:
        _LOG.debug("memsave_grads: refining the plan: %d plans scored, best so far",
                   scorer.scored)
    return scorer.best or start, start


def _greedy_search(problem: problem_lib.BudgetProblem, scorer: problem_lib.Scorer,
                   dp_seeds: bool) -> None:
    """The greedy solver's phases, best plans first; ``scorer`` keeps the best that fits and
    ends the search once it has scored as many plans as it may."""
    search = planners.CutSearch.of(problem.graph, problem.must_keep, problem.candidates)
    if search.feasible:
        if dp_seeds:
            # First: on graphs of thousands of ops the cut search alone can spend the
            # scorer's plans, and the seeds found 13x cheaper plans there (docs/budgets.md).
            _dp_seeds(problem, scorer, search)
        seen = set()
        for cap in search.caps(GREEDY_CAP_POINTS):
            cuts = search.cuts_for(cap)
            if not cuts or cuts in seen:
                continue
            seen.add(cuts)
            # Fewer trailing cuts: a larger top segment, less recomputed, more memory.
            _last_true(0, len(cuts) - 1,
                       lambda drop, cuts=cuts: scorer.fits(
                           search.kept_for(cuts[:len(cuts) - drop])))
    fitting = [r for r in scorer.cache.values() if r[1] <= problem.budget_bytes]
    # Fill the cheapest plans and the ones with the most budget left (fewest bytes kept).
    bases = sorted(fitting, key=lambda r: (r[2], r[1]))[:GREEDY_FILL_PLANS]
    bases += sorted(fitting, key=lambda r: (r[1], r[2]))[:GREEDY_FILL_PLANS]
    for kept in dict.fromkeys(r[0] for r in bases):
        _fill(problem, scorer, kept, skip=False)
    # With the plans left, fill the best plans again, now skipping nodes that do not fit.
    fitting = [r for r in scorer.cache.values() if r[1] <= problem.budget_bytes]
    for result in sorted(fitting, key=lambda r: (r[2], r[1]))[:GREEDY_FILL_PLANS]:
        _fill(problem, scorer, result[0])


def _dp_seeds(problem: problem_lib.BudgetProblem, scorer: problem_lib.Scorer,
              search: planners.CutSearch) -> None:
    """Fast, inexact DP plans (few positions, rounded labels; see :func:`dp.dp_cuts`), each
    checked by the replay (the DP budget tightened by the overshoot if it disagrees), then
    filled. The ways a segment may be recomputed: whole, or keeping its nodes that cost at
    least a quantile of cost per byte (``GREEDY_DP_QUANTILES``). Bounded by work: at most
    ``1 + len(GREEDY_DP_QUANTILES)`` seeds of ``GREEDY_DP_RETRIES`` DP runs each, on at
    most ``GREEDY_DP_POSITIONS`` positions and ``GREEDY_DP_LABELS`` labels per position; the
    scorer's bound on plans may end it sooner."""
    graph = problem.graph
    ratios = sorted(graph.cost_of(v) / max(graph.size_bytes[v], 1) for v in problem.candidates
                    if v not in problem.must_keep and graph.cost_of(v) > 0)
    if not ratios or not search.positions():
        return
    quantum = max(problem.budget_bytes // GREEDY_DP_LABELS, 1)
    positions = search.positions(GREEDY_DP_POSITIONS)
    # (A second round on half as many positions, the DP's model not being the replay's, found
    # a cheaper plan on 1 of 15 graph/budget pairs, by 0.04%, took the plans that gave 2 others
    # a cheaper fill, and cost a tenth of the build: design note "planning cost".)
    for quantile in (None,) + GREEDY_DP_QUANTILES:
        modes = (None,) if quantile is None else (
            None, ratios[min(int(quantile * len(ratios)), len(ratios) - 1)])
        budget_bytes, previous, factor = problem.budget_bytes, None, 1
        for _ in range(GREEDY_DP_RETRIES):
            found = dp_lib.dp_cuts(problem, search, positions, budget_bytes, modes, quantum)
            if found is None:
                break
            kept, peak, _ = scorer(search.kept_for(found[0]) | found[1])
            if peak <= problem.budget_bytes:
                _fill(problem, scorer, kept, skip=False)
                break
            # The replay disagrees: ask for less (twice as much less each time the same plan
            # comes back, and then at least a label's bucket less: the DP rounds bytes to
            # buckets of ``quantum``, so a smaller step brought the same plan back again).
            step = peak - problem.budget_bytes
            if kept == previous:
                factor *= 2
                step = max(factor * step, quantum)
            else:
                factor = 1
            previous = kept
            budget_bytes -= step

