"""The memory model's replay of single-level plans, fast enough to score hundreds of plans on
graphs of thousands of ops (docs/design.md, note "planning cost").

:func:`memory_model.replay` walks every node of the graph in Python for every plan: 47 ms a
plan on a 2000-node chain (2 CPU cores under load), and the planners score tens to hundreds of
plans. :class:`FastReplay` gives the *same* peak (``tests/test_fast_replay.py``
compares the two on random graphs and plans) by splitting the replay into its phases and
doing each as cheaply as it can be done:

* **the forward pass** over the whole graph depends on the plan only through which outputs
  are retained (kept, or read by the top segment's backward pass) and which views are kept;
  its frees and allocations are vectors, its peak a cumulative sum (NumPy);
* **the top segment's backward pass** depends only on the top segment's nodes;
* **each level** depends only on the nodes it recomputes, which of them a gradient reached,
  and which of the gradients it adds to (kept nodes outside it) already exist.

The last two run memory_model's own steps (``backward_readers``, ``forward_sweep``,
``backward_step``) on a ledger of their own, and their effect (the highest point above where
they started, the bytes they leave, the gradients alive after them) is cached: the plans a
search scores share most of their segments (a fill keeps one more node in one segment,
dropping a trailing cut changes the top alone). Phases add up because the ledger is a sum.

Only single-level schedules of a whole graph: nested plans go to memory_model.replay.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Sequence

import numpy as np

from memsave_grads.core import graph as graph_lib
from memsave_grads.core import memory_model
from memsave_grads.core import schedule as schedule_lib

#: Owner of a top-segment node (:meth:`FastReplay.closed_owners`).
TOP = -1
#: Owner of a node in no segment: it reaches no ``y`` and no kept node.
NOWHERE = -2


class FastReplay:
    """Scores single-level plans on one graph (fast for kept sets closed for single
    ownership, the only ones the planners score, on graphs without function ops' internal or
    exposed bytes; anything else through memory_model.replay).

    ``not_replayed``: kept nodes never copied (their segments are empty); ``workspace_bytes``
    as in :func:`memory_model.replay`.
    """

    def __init__(self, graph: graph_lib.ForwardGraph, not_replayed: Iterable[int] = (),
                 workspace_bytes: Sequence[int] | None = None):
        self.graph = graph
        self.not_replayed = frozenset(not_replayed)
        self.workspace_bytes = workspace_bytes
        n = graph.num_nodes
        self.n = n
        self.consumers = graph.consumers()
        self.unique_inputs = [sorted(set(preds)) for preds in graph.inputs]
        self.size = np.asarray(graph.size_bytes, dtype=np.int64)
        self.view = (np.asarray(graph.views, dtype=bool) if graph.views
                     else np.zeros(n, dtype=bool))
        self.sink = np.asarray(graph.feeds_sink, dtype=bool)
        self.costs = np.asarray([graph.cost_of(v) for v in range(n)], dtype=np.float64)
        # The forward pass over every node: each output's last reader, and which inputs end
        # at each node (in the sorted order memory_model.forward_sweep visits them).
        last = np.full(n, -1, dtype=np.int64)
        for v, preds in enumerate(self.unique_inputs):
            for p in preds:
                last[p] = v  # nodes run in order: the last assignment is the last reader
        self.last = last
        self.has_reader = last >= 0
        ending: list[list[int]] = [[] for _ in range(n)]
        for p in range(n):
            if last[p] >= 0:
                ending[int(last[p])].append(p)
        # Elementwise nodes that may write into an input ending at them of their own size, as
        # (node, input) pairs in the order memory_model.forward_sweep tries them.
        pairs = [(v, p) for v in range(n) if graph.forwards_buffer(v) and graph.size_bytes[v]
                 for p in sorted(ending[v]) if graph.size_bytes[p] == graph.size_bytes[v]]
        self.donor_node = np.asarray([v for v, _ in pairs], dtype=np.int64)
        self.donor_input = np.asarray([p for _, p in pairs], dtype=np.int64)
        # Edges whose gradient reads the input (for the top segment's retained outputs).
        read_from, read_by = [], []
        for c in range(n):
            for p in self.unique_inputs[c]:
                if graph.gradient_reads_input(c, p):
                    read_from.append(p)
                    read_by.append(c)
        self.read_from = np.asarray(read_from, dtype=np.int64)
        self.read_by = np.asarray(read_by, dtype=np.int64)
        self.reads_output_or_sink = self.sink | np.asarray(
            [graph.gradient_reads_output(v) for v in range(n)], dtype=bool)
        self.replayed = [v not in self.not_replayed for v in range(n)]
        # Function ops' internal and exposed bytes (design note "control flow and calls")
        # depend on where each node is differentiated, which the phases below do not track:
        # such graphs get the full replay.
        self.phases_exact = not any(graph.internal_saved_bytes) and not any(graph.exposed_bytes)
        self._top_cache: dict = {}
        self._level_cache: dict = {}
        self._external_cache: dict = {}

    # ----------------------------------------------------------------------------------------
    # The schedule
    # ----------------------------------------------------------------------------------------

    def closed_owners(self, kept: Iterable[int]) -> tuple[frozenset, tuple | None]:
        """``kept`` closed for single ownership (``graph.close_segments``'s set) and, where
        this replayer scores by phases, the single-level schedule's ownership of it
        (``schedule.build``'s, without building it): each node's owner (the kept node whose
        segment recomputes it, itself for a kept node, :data:`TOP`, or :data:`NOWHERE`) and
        each kept node's level; None in its place otherwise.

        One downward sweep, as ``close_segments``' own: a search closes and scores hundreds of
        plans (design note "planning cost"). A node's owner is its readers' (a kept reader
        that is never replayed, or a node no segment reads, owns nothing), and a node whose
        readers' owners differ, by ``close_segments``' rules, is kept; those rules tell fewer
        owners apart (a never-replayed reader is its own owner there, an unread node the
        top's), so the closed set never has a node with two owners. A kept node's level is one
        below the deepest segment that reads it, whose level is final when it is reached."""
        if not self.phases_exact:
            return frozenset(graph_lib.close_segments(self.graph, kept)), None
        n, consumers, sink, replayed = self.n, self.consumers, self.graph.feeds_sink, \
            self.replayed
        is_kept = [False] * n
        for k in kept:
            is_kept[k] = True
        closing = [TOP] * n  # close_segments' owner of an unkept node (TOP also if unread)
        owner = [NOWHERE] * n
        level = [0] * n
        for v in range(n - 1, -1, -1):
            readers = consumers[v]
            if not is_kept[v] and len(readers) == 1 and not sink[v]:
                c = readers[0]  # most nodes: one reader, its owner's (a chain)
                if is_kept[c]:
                    closing[v] = c
                    owner[v] = c if replayed[c] else NOWHERE
                else:
                    closing[v] = closing[c]
                    owner[v] = owner[c]
                continue
            if not is_kept[v]:
                first = reader = TOP if sink[v] else None
                shared = False
                for c in readers:
                    if is_kept[c]:
                        o = c
                        if replayed[c]:
                            reader = c
                    else:
                        o = closing[c]
                        if owner[c] != NOWHERE:
                            reader = owner[c]
                    if first is None:
                        first = o
                    elif o != first:
                        shared = True
                        break
                if not shared:
                    if first is not None:
                        closing[v] = first
                    owner[v] = NOWHERE if reader is None else reader
                    continue
                is_kept[v] = True  # read by two segments: kept (close_segments)
            owner[v] = v
            deeper = 1  # one level below the deepest segment that reads it
            for c in readers:
                o = c if is_kept[c] else owner[c]
                if o >= 0 and level[o] >= deeper:
                    deeper = level[o] + 1
            level[v] = deeper
        closed = frozenset(itertools.compress(range(n), is_kept))
        return closed, (owner, {k: level[k] for k in closed})

    # ----------------------------------------------------------------------------------------
    # The replay
    # ----------------------------------------------------------------------------------------

    def peak_bytes(self, kept: Iterable[int]) -> int:
        """memory_model.replay's peak of the single-level schedule of ``kept`` (fast where
        ``kept`` is closed for single ownership, ``graph.close_segments``, as the planners'
        plans are; the full replay otherwise)."""
        return self.score(kept)[0]

    def score(self, kept: Iterable[int], costs: np.ndarray | None = None,
              stop_above_bytes: int | None = None) -> tuple[int, float]:
        """(peak, recompute cost) of the single-level schedule of ``kept``: the
        peak of memory_model.replay and the cost of ``problem.score``, the sum of ``costs``
        (default: ``ForwardGraph.cost_of``) over every node a segment recomputes that is not
        kept itself (``Schedule.recomputed_nodes``).

        ``stop_above_bytes``: a caller that only asks whether the plan fits under it (a
        budget solver's probe) gets the peak so far as soon as it passes that, without the
        phases left: a peak only rises, so the answer is the same, and a plan that does not
        fit mostly shows it at the top segment or the first level (see design note
        "planning cost"). The peak returned is then a lower bound of the replay's, above
        ``stop_above_bytes``; a plan that fits always gets the replay's own."""
        kept = frozenset(kept)
        if not self.phases_exact:
            return self._replayed(kept, costs)
        closed, owned = self.closed_owners(kept)
        # A set that is not closed (a node two segments read is recomputed by both) gets the
        # full replay: the phases assume one owner a node.
        return self.score_owned(kept, owned if closed == kept else None, costs,
                                stop_above_bytes)

    def score_owned(self, kept: frozenset, owned: tuple | None,
                    costs: np.ndarray | None = None,
                    stop_above_bytes: int | None = None) -> tuple[int, float]:
        """:meth:`score` of ``kept`` (closed) with its ownership (:meth:`closed_owners`)
        given; None: not scored by phases, the full replay."""
        if owned is None:
            return self._replayed(kept, costs)
        owner, level = owned
        owner_array = np.asarray(owner, dtype=np.int64)
        in_top = owner_array == TOP
        kept_mask = np.zeros(self.n, dtype=bool)
        if kept:
            kept_mask[list(kept)] = True
        weights = self.costs if costs is None else costs
        cost = float(weights[(owner_array >= 0) & ~kept_mask].sum())
        live, peak = self.forward_sweep(kept_mask, in_top)
        over = stop_above_bytes if stop_above_bytes is not None else np.inf
        if peak > over:
            return int(peak), cost
        top = np.flatnonzero(in_top)
        top_peak, top_delta, grads = self._top(top)
        peak = max(peak, live + top_peak)
        if peak > over:
            return int(peak), cost
        live += top_delta
        grads = set(grads)
        by_level: dict[int, list[int]] = {}
        for k in sorted(kept):
            by_level.setdefault(level[k], []).append(k)
        segments = self._segments(owner_array)
        size = self.graph.size_bytes
        for number in sorted(by_level):
            group = by_level[number]
            live -= sum(size[k] for k in group)
            active = tuple(k for k in group if k in grads)
            if not active:
                continue
            recomputed = _merged([segments.of(k) for k in active])
            external = self._external(recomputed, active)
            arrived = tuple(p for p in external if p in grads)
            level_peak, level_delta, after = self._level(recomputed, active, external, arrived)
            peak = max(peak, live + level_peak)
            if peak > over:
                return int(peak), cost
            live += level_delta
            grads.difference_update(recomputed)
            grads.difference_update(active)
            grads.difference_update(external)
            grads.update(after)
        return int(peak), cost

    def _replayed(self, kept: frozenset, costs: np.ndarray | None) -> tuple[int, float]:
        """A kept set that is not closed: memory_model.replay itself (a node in two segments
        is recomputed by both), and the cost of ``Schedule.recomputed_nodes``."""
        sched = schedule_lib.build(self.graph, kept, self.not_replayed)
        weights = self.costs if costs is None else costs
        cost = float(sum(weights[v] for v in sched.recomputed_nodes()))
        return memory_model.replay(self.graph, sched, self.workspace_bytes)[0], cost

    def forward_sweep(self, kept_mask: np.ndarray, in_top: np.ndarray) -> tuple[int, int]:
        """memory_model.forward_sweep over every node: (bytes live after it, its peak)."""
        n = self.n
        reader_in_top = np.zeros(n, dtype=bool)
        if self.read_from.size:
            reader_in_top[self.read_from[in_top[self.read_by]]] = True
        retained = kept_mask | (in_top & (self.reads_output_or_sink | reader_in_top))
        buffer = np.where(kept_mask | ~self.view, self.size, 0)
        alloc = buffer.copy()
        freeing = self.has_reader & ~retained
        frees = np.bincount(self.last[freeing], weights=buffer[freeing],
                            minlength=n).astype(np.int64)
        frees += np.where(~self.has_reader & ~retained, buffer, 0)
        if self.donor_node.size:
            # The first input of each node that it may write into (memory_model.forward_sweep).
            v, p = self.donor_node, self.donor_input
            usable = (buffer[v] > 0) & ~retained[p] & (buffer[p] == buffer[v])
            nodes, first = np.unique(v[usable], return_index=True)
            donors = p[usable][first]
            alloc[nodes] = 0
            frees[nodes] -= buffer[donors]
        step = alloc - frees
        before = np.concatenate(([0], np.cumsum(step)[:-1])) if n else np.zeros(0, np.int64)
        peak = int(max(0, (before + alloc).max())) if n else 0
        return int(step.sum()), peak

    def _top(self, top: np.ndarray) -> tuple[int, int, frozenset]:
        """The top segment's backward pass: (peak above its start, bytes it leaves, gradients
        alive after it)."""
        key = top.tobytes()
        if key not in self._top_cache:
            members = top.tolist()
            graph = self.graph
            release_at, _ = memory_model.backward_readers(graph, self.consumers, members)
            ledger = memory_model.Ledger()
            grads: set = set()
            memory_model.backward_steps(graph, reversed(members), grads, ledger, release_at,
                                        self.workspace_bytes)
            self._top_cache[key] = (ledger.peak, ledger.live, frozenset(grads))
        return self._top_cache[key]

    def _segments(self, owner: np.ndarray) -> "_Segments":
        """Each replayed kept node's segment, in topological order, on demand."""
        owned = np.flatnonzero(owner >= 0)
        owners = owner[owned]
        order = np.argsort(owners, kind="stable")
        return _Segments(owners[order], owned[order], self.replayed)

    def _external(self, recomputed: tuple, active: tuple) -> tuple:
        """Nodes outside ``recomputed`` whose gradients its backward pass (and the steps of
        ``active`` never-replayed nodes) add to."""
        key = (recomputed, active)
        if key not in self._external_cache:
            inside = set(recomputed)
            out = {p for v in recomputed + active for p in self.unique_inputs[v]
                   if p not in inside}
            self._external_cache[key] = tuple(sorted(out))
        return self._external_cache[key]

    def _level(self, recomputed: tuple, active: tuple, external: tuple,
               arrived: tuple) -> tuple[int, int, frozenset]:
        """One level of memory_model._Replayer.run: (peak above its start, bytes it leaves,
        the gradients among ``recomputed``, ``active`` and ``external`` alive after it)."""
        key = (recomputed, active, arrived)
        if key not in self._level_cache:
            graph, workspace = self.graph, self.workspace_bytes
            ledger = memory_model.Ledger()
            grads = set(active) | set(arrived)
            if recomputed:
                release, saved = memory_model.backward_readers(graph, self.consumers,
                                                                recomputed)
                memory_model.forward_sweep(graph, recomputed, self.consumers, saved, ledger,
                                      kept=())
                memory_model.backward_steps(graph, reversed(recomputed), grads, ledger, release,
                                            workspace)
            for k in active:
                if k in grads:  # a never-replayed kept node: its gradient goes to xs
                    memory_model.backward_step(graph, k, grads, ledger, {}, workspace)
            self._level_cache[key] = (ledger.peak, ledger.live, frozenset(grads))
        return self._level_cache[key]



def replayer(graph: graph_lib.ForwardGraph, not_replayed: Iterable[int] = (),
             workspace_bytes: Sequence[int] | None = None) -> FastReplay:
    """The :class:`FastReplay` of ``graph`` for these arguments, made once and kept on the
    graph model (which is immutable), so that the planners of one ``gradients()`` call (the
    cut search, the refinement, the never-worse rule) share its tables and caches."""
    workspace = _scratch(workspace_bytes)
    key = ("replayer", frozenset(not_replayed), workspace)
    cache = graph_lib.memo(graph)
    if key not in cache:
        cache[key] = FastReplay(graph, not_replayed, workspace)
    return cache[key]


def plain_peak_bytes(graph: graph_lib.ForwardGraph,
                     workspace_bytes: Sequence[int] | None = None) -> int:
    """memory_model.plain_peak_bytes, computed once per graph model and workspace."""
    workspace = _scratch(workspace_bytes)
    key = ("plain", workspace)
    cache = graph_lib.memo(graph)
    if key not in cache:
        cache[key] = memory_model.plain_peak_bytes(graph, workspace)
    return cache[key]


def _scratch(workspace_bytes: Sequence[int] | None) -> tuple | None:
    """``workspace_bytes`` as a key, None where no node has scratch: the never-worse rule's
    all-zero workspace (a graph without convolutions) then shares the planners' replays."""
    if workspace_bytes is None or not any(workspace_bytes):
        return None
    return tuple(workspace_bytes)


class _Segments:
    """Kept node -> its segment, from the nodes sorted by owner (FastReplay._segments)."""

    def __init__(self, owners: np.ndarray, nodes: np.ndarray, replayed: list):
        self.nodes = nodes
        self.replayed = replayed
        if owners.size:
            starts = np.flatnonzero(np.diff(owners)) + 1
            bounds = np.concatenate(([0], starts, [owners.size]))
            self.where = dict(zip(owners[bounds[:-1]].tolist(),
                                  zip(bounds[:-1].tolist(), bounds[1:].tolist())))
        else:
            self.where = {}

    def of(self, k: int) -> tuple:
        if not self.replayed[k] or k not in self.where:
            return ()
        start, end = self.where[k]
        return tuple(self.nodes[start:end].tolist())


def _merged(segments: list) -> tuple:
    segments = [s for s in segments if s]
    if not segments:
        return ()
    if len(segments) == 1:
        return segments[0]
    return tuple(sorted({v for s in segments for v in s}))
