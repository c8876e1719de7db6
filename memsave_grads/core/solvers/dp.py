"""An exact dynamic program over cut positions (``"dp"``), for chains of segments."""

from __future__ import annotations

import bisect
import math
import time
from typing import Sequence


from memsave_grads.core import graph as graph_lib
from memsave_grads.core import memory_model
from memsave_grads.core import plan as plan_lib
from memsave_grads.core import planners
from memsave_grads.core.solvers import problem as problem_lib

#: The dynamic program considers at most this many cut positions; on larger graphs it thins
#: them evenly and no longer claims optimality.
DP_MAX_POSITIONS = 400
#: Times the DP tightens its budget when the replay finds its plan over budget.
DP_RETRIES = 6
#: A position's pending labels are pruned to their Pareto front once they number this many
#: (and twice the last front's size after that).
_COMPACT_AT_LABELS = 4096


def _prefix(values) -> list:
    out, running = [0], 0
    for value in values:
        running += value
        out.append(running)
    return out


def dp_cuts(problem: problem_lib.BudgetProblem, search: planners.CutSearch, positions: list[int],
             budget_bytes: int, keep_ratios: Sequence[float | None] = (None,),
             quantum: int = 0) -> tuple[tuple, set] | None:
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
    compact_at = [_COMPACT_AT_LABELS] * len(positions)

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
                    reaching = pending[b_index]
                    reaching.extend(
                        (label[0] + new_bytes, label[1] + seg_cost, (a_index, label, mode))
                        for label in at_a[:fitting])
                    if len(reaching) > compact_at[b_index]:
                        # Drop dominated labels now, not only once b is reached: every earlier
                        # position adds its whole front here, and Keras 3 ResNet50's 400
                        # positions filled 24 GiB before b was reached. Exact: a label
                        # dominated now stays dominated, and ties keep the first, as before.
                        pending[b_index] = reaching = pareto(reaching)
                        compact_at[b_index] = max(_COMPACT_AT_LABELS, 2 * len(reaching))
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


def solve_dp(problem: problem_lib.BudgetProblem) -> plan_lib.Plan:
    """Exact cuts under the decomposed peak, checked by the replay (see :func:`dp_cuts`)."""
    started = time.perf_counter()
    scorer = problem_lib.Scorer(problem)
    scorer(problem.must_keep)
    search = planners.CutSearch(problem.graph, problem.must_keep, problem.candidates)
    exact = len(search.positions()) <= DP_MAX_POSITIONS
    positions = search.positions(DP_MAX_POSITIONS)
    budget_bytes = problem.budget_bytes
    proven = False
    for _ in range(DP_RETRIES):
        found = dp_cuts(problem, search, positions, budget_bytes) if positions else None
        if found is None:
            break
        _, peak, _ = scorer(search.kept_for(found[0]))
        if peak <= problem.budget_bytes:
            proven = exact and budget_bytes == problem.budget_bytes
            break
        budget_bytes -= peak - problem.budget_bytes  # the replay disagrees: ask for less
    return scorer.plan("dp", started, optimal=proven)

