"""Whole-graph checkpoint selection: graph model in, kept nodes out.

Every planner has the same contract: it takes a :class:`~memsave_grads.core.graph.ForwardGraph`, the
nodes that must be kept anyway (stateful ops, intermediate ``xs``) and the candidate nodes, and
returns a :class:`~memsave_grads.core.plan.Plan`. Planners never touch TensorFlow.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Iterable, Sequence

import numpy as np

from memsave_grads.core import budgets
from memsave_grads.core import fast_replay
from memsave_grads.core import graph as graph_lib
from memsave_grads.core import memory_model
from memsave_grads.core import plan as plan_lib

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# Frontier cuts: the "memory" planner for any DAG
# --------------------------------------------------------------------------------------------

#: Cuts whose newly kept bytes are within this factor are ties; among ties the output of an
#: expensive op (matmul, convolution) is preferred, so that cheap ops are the ones recomputed.
EXPENSIVE_TIE_FACTOR = 0.99
#: Plans whose predicted peak is within this factor of the best are equal in memory; among them
#: the one that recomputes least (expensive ops weighing :data:`EXPENSIVE_RECOMPUTE_WEIGHT`) wins.
EQUAL_PEAK_FACTOR = 1.02
EXPENSIVE_RECOMPUTE_WEIGHT = 10
#: Segment caps tried: a geometric grid of this many points between the largest node and the
#: whole region, then half as many again around the best one.
CAP_GRID_POINTS = 24
#: How many of the plans ranked best by the quick estimate the memory model replays.
SIMULATED_PLANS = 6


def _greedy_cuts(search: "CutSearch", cap_bytes: int, tapered: bool = False) -> list[int]:
    """Chen et al.'s budget walk on the live frontier.

    Walk the topological order accumulating ``segment_bytes`` of the nodes a segment would
    recompute; before they pass the cap, cut at the position (in the second half of the window,
    if any allows a cut) whose frontier adds the fewest bytes to what the previous cut keeps;
    the later position wins ties, an expensive op's output wins near-ties.

    The cap is ``cap_bytes`` for every segment, or, ``tapered``, ``cap_bytes`` less the bytes
    the cuts before the segment keep: those are held while the segment is replayed, so a
    segment near the inputs may be longer than one near the ``ys`` (see design note "tapered
    cuts").
    """
    n = search.graph.num_nodes
    size = search.graph.size_bytes
    # The walk's per-position numbers, made once per search (CutSearch.__init__).
    counted = search.retained_bytes if tapered else search.counted_segment_bytes
    delta, oldest, factor, ends_at, allowed = (search.frontier_delta, search.oldest_ending,
                                               search.tie_factor, search.ends_at,
                                               search.allowed)
    cuts = []
    prev = -1
    held = 0
    while True:
        run = new = 0
        cap = cap_bytes - held if tapered else cap_bytes
        # The best position so far (the lowest score, the later position among equal ones:
        # positions only grow), and the best in the window's second half.
        best = best_late = None
        best_new = best_late_new = 0
        best_score = best_late_score = 0.0
        p = prev + 1
        while p < n:
            run += counted[p]
            new += delta[p]
            if oldest[p] <= prev:  # what ends here was not the segment's: the last cut keeps it
                for v in ends_at[p]:
                    if v <= prev:
                        new += size[v]
            if run > cap and best is not None:  # (a best late position is a best one)
                break
            if allowed[p]:
                score = new * factor[p]
                if best is None or score <= best_score:
                    best, best_score, best_new = p, score, new
                if 2 * run >= cap and (best_late is None or score <= best_late_score):
                    best_late, best_late_score, best_late_new = p, score, new
                if run > cap:
                    break
            p += 1
        if p >= n:  # the rest fits under the cap: it is the top segment
            return cuts
        chosen, chosen_new_bytes = ((best_late, best_late_new) if best_late is not None
                                    else (best, best_new))
        cuts.append(chosen)
        prev = chosen
        held += chosen_new_bytes


def _segment_bytes(graph: graph_lib.ForwardGraph) -> list[int]:
    """Bytes each node adds to a recomputed segment: its output, and what a function op keeps
    inside for its gradient (``ForwardGraph.internal_saved_bytes``)."""
    return [s + graph.internal_saved(v) for v, s in enumerate(graph.size_bytes)]


class CutSearch:
    """The positions where a graph can be cut, and the plan each cap on segment bytes gives.

    Shared by the ``"memory"`` planner (:func:`frontier_cuts`) and the budget solvers: both
    generate plans here and differ only in how they choose among them.
    """

    @classmethod
    def of(cls, graph: graph_lib.ForwardGraph, must_keep: Iterable[int],
           candidates: Iterable[int]) -> "CutSearch":
        """The search of these arguments, made once per graph model (``graph.memo``): the
        ``"memory"`` planner and the solvers after it share its cuts and kept sets."""
        must_keep, candidates = frozenset(must_keep), frozenset(candidates)
        key = ("cut search", must_keep, candidates)
        memo = graph_lib.memo(graph)
        if key not in memo:
            memo[key] = cls(graph, must_keep, candidates)
        return memo[key]

    def __init__(self, graph: graph_lib.ForwardGraph, must_keep: Iterable[int],
                 candidates: Iterable[int]):
        self._cuts: dict[int, tuple] = {}
        self._kept: dict[tuple, set] = {}
        self._cut_arrays: _CutArrays | None = None
        self.graph = graph
        self.must_keep = set(must_keep)
        candidate_set = set(candidates) | self.must_keep
        n = graph.num_nodes
        self.uses = graph_lib.last_uses(graph, self.must_keep)
        self.ends_at: list[list[int]] = [[] for _ in range(n + 1)]
        for v, last in enumerate(self.uses):
            if last >= 0:
                self.ends_at[last].append(v)
        # A position can be cut when every node of its frontier may be kept.
        self.allowed, open_bad = [], 0
        for p in range(n):
            if self.uses[p] > p and p not in candidate_set:
                open_bad += 1
            open_bad -= sum(1 for v in self.ends_at[p] if v != p and v not in candidate_set)
            self.allowed.append(open_bad == 0 and self.uses[p] > p and p < n - 1)
        self.segment_bytes = _segment_bytes(graph)
        counted = [s if self.uses[v] >= 0 else 0 for v, s in enumerate(self.segment_bytes)]
        #: What the budget walk (:func:`_greedy_cuts`) reads at each position, made once for
        #: its tens of walks: the bytes a segment accumulates (0 for a node no one reads),
        #: the frontier's change (the bytes of a node read later, less those of the nodes
        #: whose last reader it is: ``ends_at``, never the node itself, whose readers come
        #: after it) and the oldest node ending there (n: none), so that the walk corrects
        #: the change only where a node before the segment ends; the near-tie factor of an
        #: expensive op.
        self.counted_segment_bytes = counted
        self.frontier_delta = [(graph.size_bytes[p] if self.uses[p] > p else 0)
                               - sum(graph.size_bytes[v] for v in self.ends_at[p])
                               for p in range(n)]
        self.oldest_ending = [min(self.ends_at[p], default=n) for p in range(n)]
        self.tie_factor = [EXPENSIVE_TIE_FACTOR if graph.is_expensive(p) else 1.0
                           for p in range(n)]
        self.total_bytes = sum(counted)
        self.largest_bytes = max(counted, default=0)
        self.cumulative = list(itertools.accumulate(counted))
        # What a replayed segment holds of each node for its backward pass (the tapered walk's
        # unit, comparable with the kept bytes held beside it).
        self.retained_bytes = [r if self.uses[v] >= 0 else 0
                               for v, r in enumerate(memory_model.retained_bytes(graph))]
        self.retained_cumulative = list(itertools.accumulate(self.retained_bytes))

    @property
    def feasible(self) -> bool:
        """Some position can be cut, and there are bytes to save."""
        return any(self.allowed) and self.total_bytes > 0 and self.largest_bytes > 0

    def positions(self, at_most: int | None = None) -> list[int]:
        """The positions a cut may be placed at, thinned evenly to ``at_most`` (the solvers' DPs
        bound their work so)."""
        allowed = [p for p in range(self.graph.num_nodes) if self.allowed[p]]
        if at_most is None or len(allowed) <= at_most:
            return allowed
        step = len(allowed) / at_most
        return sorted({allowed[int(i * step)] for i in range(at_most)})

    def caps(self, points: int) -> list[int]:
        """A geometric grid of segment caps from the largest node to the whole graph."""
        ratio = self.cap_ratio(points)
        return [int(self.largest_bytes * ratio ** i) for i in range(points)]

    def cap_ratio(self, points: int) -> float:
        if self.total_bytes <= self.largest_bytes:
            return 2.0
        return (self.total_bytes / self.largest_bytes) ** (1.0 / (points - 1))

    def cuts_for(self, cap_bytes: int, tapered: bool = False) -> tuple:
        """The cuts of the budget walk under ``cap_bytes``: on the bytes a segment recomputes,
        or, ``tapered``, on the bytes it retains less what earlier cuts keep (design note
        "tapered cuts")."""
        key = (cap_bytes, tapered)
        if key not in self._cuts:
            self._cuts[key] = tuple(_greedy_cuts(self, cap_bytes, tapered=tapered))
        return self._cuts[key]

    def kept_for(self, cuts: Iterable[int]) -> set:
        """The live frontiers of ``cuts`` plus ``must_keep``, closed for single ownership
        (``graph_lib.close_segments``' set, made by :meth:`_closed_frontiers`)."""
        cuts = tuple(sorted(cuts))
        if cuts not in self._kept:
            self._kept[cuts] = frozenset(self._closed_frontiers(cuts))
        return set(self._kept[cuts])

    def _closed_frontiers(self, cuts: tuple) -> set:
        """:meth:`kept_for` in a few array operations: the searches score thousands of plans,
        and a sweep over every node for each was a third of the cut search (design note
        "planning cost").

        A node is in some cut's frontier (``graph_lib.frontiers``) when the first cut at or
        after it comes before its last reader. A node of range i (after cut i - 1, up to cut
        i; after the last cut, the top range) that no frontier keeps is read only within its
        range: a reader after cut i would put it in cut i's frontier. So closing the set for
        single ownership (``graph_lib.close_segments``) is a matter of each range alone: a
        node is kept only where two owners meet, and where the unkept nodes of a range read
        into at most one owner between them (a kept node of the range, or the top segment,
        which owns a ``y``'s producer and a node no one reads), none of them can meet two.
        The ranges with two or more go through ``close_segments``' sweep, restricted to
        them, and the set is the one the sweep over the whole graph makes."""
        arrays = self._arrays()
        n = self.graph.num_nodes
        cut_array = np.asarray(cuts, dtype=np.int64)
        # Each node's range: the first cut at or after it (len(cuts): the top range).
        range_of = np.searchsorted(cut_array, arrays.nodes)
        kept = arrays.must_keep.copy()
        if len(cuts):
            first_cut = cut_array[np.minimum(range_of, len(cuts) - 1)]
            kept |= (range_of < len(cuts)) & (first_cut < arrays.uses)
        owners_read = ~kept[arrays.edge_from] & kept[arrays.edge_to]
        pairs = np.unique(range_of[arrays.edge_from[owners_read]] * n
                          + arrays.edge_to[owners_read])
        owners = np.bincount(pairs // n, minlength=len(cuts) + 1)
        owners[np.unique(range_of[~kept & arrays.to_top])] += 1
        kept_set = set(np.flatnonzero(kept).tolist())
        conflicted = owners > 1
        if conflicted.any():
            # One sweep over all of them: their unkept nodes read only inside their own range.
            # Their kept nodes are members too: the sweep counts only readers among members.
            members = np.flatnonzero(conflicted[range_of]).tolist()
            kept_set = graph_lib.close_segments(
                self.graph, kept_set, members=members,
                sinks=[v for v in members if self.graph.feeds_sink[v]])
        return kept_set

    def _arrays(self) -> "_CutArrays":
        if self._cut_arrays is None:
            graph, n = self.graph, self.graph.num_nodes
            consumers = graph.consumers()
            edges = [(p, c) for c in range(n) for p in set(graph.inputs[c])]
            must_keep = np.zeros(n, dtype=bool)
            must_keep[list(self.must_keep)] = True
            self._cut_arrays = _CutArrays(
                nodes=np.arange(n, dtype=np.int64),
                uses=np.asarray(self.uses, dtype=np.int64),
                must_keep=must_keep,
                edge_from=np.asarray([p for p, _ in edges], dtype=np.int64),
                edge_to=np.asarray([c for _, c in edges], dtype=np.int64),
                to_top=np.asarray([bool(graph.feeds_sink[v]) or not consumers[v]
                                   for v in range(n)], dtype=bool),
                size=np.asarray(graph.size_bytes, dtype=np.int64),
                # Prefix sums with a leading 0: the sum over (a, b] is [b + 1] - [a + 1].
                cumulative=np.concatenate(([0], np.asarray(self.cumulative, dtype=np.int64))),
                retained_cumulative=np.concatenate(
                    ([0], np.asarray(self.retained_cumulative, dtype=np.int64))))
        return self._cut_arrays

    def quick_bytes(self, cuts: Sequence[int], kept: Iterable[int]) -> int:
        """A fast estimate of a plan's peak: kept bytes plus the largest gap between cuts."""
        arrays = self._arrays()
        starts = np.asarray([-1, *cuts], dtype=np.int64)
        ends = np.asarray([*cuts, self.graph.num_nodes - 1], dtype=np.int64)
        cumulative = arrays.cumulative
        gap = int(np.max(cumulative[ends + 1] - cumulative[starts + 1]))
        return int(arrays.size[self._kept_array(kept)].sum()) + gap

    def held_bytes(self, cuts: Sequence[int], kept: Iterable[int]) -> int:
        """A fast estimate of a plan's peak that knows the backward order: while a segment is
        replayed, only the kept nodes before it are held (a kept node is freed when its own
        level starts), beside what the segment retains; the top segment runs with every kept
        node held. The largest of these sums (design note "tapered cuts")."""
        arrays = self._arrays()
        # kept_bytes[i]: the bytes of the kept nodes before position i.
        kept_bytes = np.zeros(self.graph.num_nodes + 1, dtype=np.int64)
        nodes = self._kept_array(kept)
        kept_bytes[nodes + 1] = arrays.size[nodes]
        np.cumsum(kept_bytes, out=kept_bytes)
        # Segment i runs from after cut i-1 (-1: the start) to cut i; the top segment to the
        # end, with every kept node held.
        starts = np.asarray([-1, *cuts], dtype=np.int64)
        ends = np.asarray([*cuts, self.graph.num_nodes - 1], dtype=np.int64)
        retained = arrays.retained_cumulative
        gaps = retained[ends + 1] - retained[starts + 1]
        held = kept_bytes[starts + 1]
        held[-1] = kept_bytes[-1]
        return int(np.max(held + gaps))

    @staticmethod
    def _kept_array(kept: Iterable[int]) -> np.ndarray:
        return np.fromiter(kept, dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class _CutArrays:
    """What :meth:`CutSearch._closed_frontiers` reads, as arrays made once per search: node
    numbers, each node's last reader (``CutSearch.uses``), ``must_keep`` as a mask, the edges
    (each input to its reader, once), the nodes whose owner may be the top segment (a ``y``'s
    producer, or a node no one reads: ``graph_lib.close_segments``' top rule), and for the
    estimates the nodes' bytes and the prefix sums (a 0 first) of the walk's and the retained
    bytes."""

    nodes: np.ndarray
    uses: np.ndarray
    must_keep: np.ndarray
    edge_from: np.ndarray
    edge_to: np.ndarray
    to_top: np.ndarray
    size: np.ndarray
    cumulative: np.ndarray
    retained_cumulative: np.ndarray


def _proposals(search: CutSearch, tapered: bool) -> dict[tuple, tuple]:
    """The plans of one walk (even or tapered) over a geometric grid of caps, then a finer grid
    around the best: cuts -> (quick estimate, cap, kept set, tapered). The even walk's estimate is kept
    bytes plus the largest gap (:meth:`CutSearch.quick_bytes`); the tapered walk's, the held
    bytes at each segment (:meth:`CutSearch.held_bytes`)."""
    estimate = search.held_bytes if tapered else search.quick_bytes
    quick: dict[tuple, tuple] = {}

    def propose(cap_bytes: int) -> None:
        cuts = search.cuts_for(cap_bytes, tapered)
        if not cuts or cuts in quick:
            return
        kept = search.kept_for(cuts)
        quick[cuts] = (estimate(cuts, kept), cap_bytes, kept, tapered)

    for cap in search.caps(CAP_GRID_POINTS):
        propose(cap)
    if not quick:
        return quick
    best_cap = min(quick.values(), key=lambda q: q[0])[1]
    fine = search.cap_ratio(CAP_GRID_POINTS) ** (2.0 / CAP_GRID_POINTS)
    for i in range(-CAP_GRID_POINTS // 4, CAP_GRID_POINTS // 4 + 1):
        propose(int(best_cap * fine ** i))
    return quick


def frontier_cuts(graph: graph_lib.ForwardGraph, must_keep: Iterable[int],
                  candidates: Iterable[int],
                  not_replayed: Iterable[int] = ()) -> plan_lib.Plan | None:
    """The ``"memory"`` planner: cut the graph where its live frontier is small.

    Any topological position cuts the graph if every tensor alive across it (its *live
    frontier*) is kept; on a chain or a residual stream that is one tensor, across a U-Net's
    encoder it is the current activation plus every skip connection still open. For a range of
    caps on the bytes recomputed between cuts, :func:`_greedy_cuts` places the cuts; each plan is
    closed for single ownership and scored with the static memory model; the plan with the
    lowest predicted peak wins, and among plans of (nearly) equal peak the one that recomputes
    least. Returns ``None`` when no position can be cut (every frontier holds a non-candidate,
    or the graph has a single op). A plan that predicts no saving is still returned and logged;
    whether to run it is the never-worse rule's call (``selection.decide_schedule``).
    """
    not_replayed = set(not_replayed)
    search = CutSearch.of(graph, must_keep, candidates)
    if not search.feasible:
        return None
    n = graph.num_nodes
    plain_peak = fast_replay.plain_peak_bytes(graph)
    # Each cap gives a plan; a quick estimate ranks them, and only the best few of each walk
    # are replayed by the memory model, which is slower. The even walk's plans are ranked as
    # before the tapered walk existed, so adding it never loses the plan the even walk found.
    candidates_to_replay: dict[tuple, tuple] = {}
    for tapered in (False, True):
        quick = _proposals(search, tapered)
        for cuts, entry in sorted(quick.items(), key=lambda kv: kv[1][0])[:SIMULATED_PLANS]:
            candidates_to_replay.setdefault(cuts, entry)
    if not candidates_to_replay:
        return None

    replayer = fast_replay.replayer(graph, not_replayed)
    # Expensive ops weigh more: among plans of equal peak, recompute the cheap ones.
    weights = np.asarray([EXPENSIVE_RECOMPUTE_WEIGHT if graph.is_expensive(v) else 1
                          for v in range(n)], dtype=np.float64)
    # Replayed best estimate first; a replay stops once its peak passes EQUAL_PEAK_FACTOR
    # times the lowest peak so far: such a plan is neither the lowest nor within 2% of it,
    # so it cannot be chosen, and the choice below is the one full replays give (design
    # note "planning cost").
    entries = list(candidates_to_replay.items())
    scores: dict[int, tuple[int, float]] = {}
    lowest_peak = None
    for index in sorted(range(len(entries)), key=lambda i: entries[i][1][0]):
        bound = None if lowest_peak is None else int(EQUAL_PEAK_FACTOR * lowest_peak)
        scores[index] = peak, _ = replayer.score(entries[index][1][2], weights,
                                                 stop_above_bytes=bound)
        if bound is None or peak <= bound:
            lowest_peak = peak if lowest_peak is None else min(lowest_peak, peak)
    plans = []
    for index, (cuts, (_, cap_bytes, kept, tapered)) in enumerate(entries):
        peak, cost = scores[index]
        cap_text = budgets.format_bytes(cap_bytes, 'MiB')
        between = (f"segments retaining at most {cap_text} less what the cuts before them keep"
                   if tapered else f"at most {cap_text} recomputed between cuts")
        plans.append(plan_lib.Plan(
            kept, not_replayed, planner="memory", cuts=cuts, segment_cap_bytes=cap_bytes,
            predicted_peak_bytes=peak,
            recompute_cost=cost,
            reason=f"cut at {len(cuts)} position{'' if len(cuts) == 1 else 's'} where the "
                   f"live frontier is small, {between}; the lowest predicted "
                   "peak, and the least recomputation among plans within 2% of it"))
    best_peak = min(p.predicted_peak_bytes for p in plans)
    if best_peak >= plain_peak:
        # Returned all the same: explain() reports it, and gradients() keeps tf.gradients'
        # schedule for it (selection.decide_schedule, docs/design.md note "never worse"),
        # which tells the user once; here for debugging only (a recomputed loop step plans
        # on every trace).
        _LOG.debug("memsave_grads: no plan of %d nodes predicts a lower peak than "
                  "tf.gradients (%d bytes)", n, plain_peak)
    equal = [p for p in plans if p.predicted_peak_bytes <= EQUAL_PEAK_FACTOR * best_peak]
    return min(equal, key=lambda p: (p.recompute_cost, p.predicted_peak_bytes))
