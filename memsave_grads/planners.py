"""Whole-graph checkpoint selection: graph model in, kept nodes out.

Every planner has the same contract: it takes a :class:`~memsave_grads.graph.ForwardGraph`, the
nodes that must be kept anyway (stateful ops, intermediate ``xs``) and the candidate nodes, and
returns the nodes to keep as checkpoints. Planners never touch TensorFlow.
"""

from __future__ import annotations

import bisect
import math
from typing import Iterable

from memsave_grads import graph as graph_lib

#: Candidates whose outputs are smaller than this fraction of the largest activation are not
#: worth keeping: they save no memory and cost a tf.gradients call level each.
MIN_RELATIVE_SIZE = 0.01


def worth_keeping(graph: graph_lib.ForwardGraph, nodes: Iterable[int],
                  candidates: Iterable[int]) -> list[int]:
    """Drop nodes whose outputs are tiny next to the largest candidate activation.

    The reference is the largest *candidate*, not the largest tensor: weights are kept anyway,
    and with an unknown batch dimension (counted as 1) they dwarf every activation.
    """
    nodes = list(nodes)
    largest = max((graph.size_bytes[v] for v in candidates), default=0)
    floor = max(1, MIN_RELATIVE_SIZE * largest)
    return [v for v in nodes if graph.size_bytes[v] >= floor]


def estimated_peak_bytes(graph: graph_lib.ForwardGraph, kept: Iterable[int]) -> int:
    """Rough peak of the backward pass: every kept tensor plus the largest recomputed segment."""
    kept = sorted(set(kept))
    kept_bytes = sum(graph.size_bytes[v] for v in kept)
    return kept_bytes + max(graph_lib.segment_bytes_between(graph, kept))


def _spaced(candidates: list[int], cumulative: list[int], count: int) -> list[int]:
    """Pick ``count`` candidates closest to evenly spaced cumulative-byte positions."""
    total = cumulative[-1]
    positions = [cumulative[c] for c in candidates]
    chosen = []
    for i in range(1, count + 1):
        target = total * i / (count + 1)
        j = bisect.bisect_left(positions, target)
        best = min((k for k in (j - 1, j) if 0 <= k < len(candidates)),
                   key=lambda k: abs(positions[k] - target))
        chosen.append(candidates[best])
    return sorted(set(chosen))


def sqrt_n_separators(graph: graph_lib.ForwardGraph, must_keep: Iterable[int],
                      candidates: Iterable[int]) -> list[int]:
    """The ``"memory"`` planner: about sqrt(N) single-node separators, evenly spaced by bytes.

    Candidates are restricted to separators (a checkpoint that is not one leaves a bypass whose
    activations stay alive). Among counts around sqrt(N) we keep the one with the lowest
    :func:`estimated_peak_bytes`, so graphs with uneven activation sizes are not forced into a
    fixed count. Returns ``[]`` when no separator is worth keeping.
    """
    must_keep = set(must_keep)
    candidate_set = set(candidates) - must_keep
    pool = [v for v in worth_keeping(graph, graph_lib.separators(graph, must_keep), candidate_set)
            if v in candidate_set]
    if not pool:
        return []
    cumulative, running = [], 0
    for size in graph.size_bytes:
        running += size
        cumulative.append(running)
    sized_nodes = sum(1 for s in graph.size_bytes if s > 0)
    around = max(1, round(math.sqrt(sized_nodes)))
    best, best_peak = None, None
    for count in range(max(1, around // 2), min(len(pool), 2 * around) + 1):
        chosen = _spaced(pool, cumulative, count)
        peak = estimated_peak_bytes(graph, must_keep | set(chosen))
        if best_peak is None or peak < best_peak:
            best, best_peak = chosen, peak
    return best or []
