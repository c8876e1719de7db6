"""A static memory model of the backward pass, on the TensorFlow-free graph model.

It replays, in bytes, the schedule that the rewrite imposes (docs/design.md, note "memory
model") and returns the peak:

* **forward**: nodes run in topological order; a node's outputs are freed once its last
  consumer has run, unless the backward pass needs them: with plain ``tf.gradients`` every
  output the backward pass reads (``saved_for_backward``) stays; with a plan only kept nodes and
  the saved outputs of the top segment (which is not recomputed) stay.
* **backward**: plain ``tf.gradients`` walks the nodes in reverse topological order; a node's
  gradient is allocated when the first partial reaches it and freed once its own backward step
  has run, and a saved output is freed after its node's backward step. With a plan, the top
  segment is walked first, then one *level* at a time (design note "levels"): the level's
  segments are recomputed (forward, keeping what their backward reads), walked backward, and
  dropped; a kept output is freed when its own level begins, since every segment that reads it
  belongs to a lower level and is done by then.

Sizes come from static shapes (unknown dimensions count as 1, so the result scales linearly
with an unknown batch size). What the model leaves out: op workspaces (convolution scratch
buffers), the executor running independent ops in parallel, and partials that are summed
(each gradient is counted once). It is an estimate for comparing plans and for a report, not a
measurement; the benchmark prints both.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable

from memsave_grads import graph as graph_lib


class _Ledger:
    """Bytes in use and the highest value seen."""

    def __init__(self):
        self.live = 0
        self.peak = 0

    def alloc(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def free(self, nbytes: int) -> None:
        self.live -= nbytes


@dataclasses.dataclass(frozen=True)
class Segments:
    """How a kept set cuts the graph (mirrors ``_stitch.backprop``).

    Attributes:
      top: nodes of the top segment (not recomputed), in topological order.
      owned: for each kept node, the nodes its segment recomputes (itself included), in
        topological order; empty for kept nodes that are never replayed.
      level: for each kept node, its level (1 = read by the top segment only).
    """

    top: list[int]
    owned: dict[int, list[int]]
    level: dict[int, int]

    def levels(self) -> list[list[int]]:
        """Kept nodes grouped by level, lowest level first."""
        by_level = collections.defaultdict(list)
        for node, lvl in self.level.items():
            by_level[lvl].append(node)
        return [sorted(by_level[lvl]) for lvl in sorted(by_level)]

    def recomputed(self, group: Iterable[int]) -> list[int]:
        return sorted({v for k in group for v in self.owned[k]})


def segments(graph: graph_lib.ForwardGraph, kept: Iterable[int],
             not_replayed: Iterable[int] = ()) -> Segments:
    """The segments and levels that ``kept`` makes (see ``_stitch`` for the rewrite itself)."""
    kept = set(kept)
    not_replayed = set(not_replayed)

    def walk(seeds):
        seen, stack = set(), list(seeds)
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            stack.extend(p for p in graph.inputs[v] if p not in kept and p not in seen)
        return sorted(seen)

    top = walk(v for v in range(graph.num_nodes) if graph.feeds_sink[v] and v not in kept)
    owned = {k: ([] if k in not_replayed else walk([k])) for k in kept}
    level = {k: 1 for k in kept}
    for p in {p for v in top for p in graph.inputs[v] if p in kept}:
        level[p] = 1
    for k in sorted(kept, reverse=True):
        members = owned[k] or [k]
        for v in members:
            for p in graph.inputs[v]:
                if p in kept and p != k:
                    level[p] = max(level[p], level[k] + 1)
    return Segments(top=top, owned=owned, level=level)


def plain_peak_bytes(graph: graph_lib.ForwardGraph) -> int:
    """Predicted peak of forward + backward with plain ``tf.gradients``."""
    n = graph.num_nodes
    consumers = graph.consumers()
    retained = [graph.is_saved_for_backward(v) or graph.feeds_sink[v] for v in range(n)]
    ledger = _Ledger()
    _forward(graph, range(n), consumers, retained, ledger)
    grads = set()
    for v in reversed(range(n)):
        _backward_step(graph, v, grads, ledger)
        if retained[v]:
            ledger.free(graph.size_bytes[v])
    return ledger.peak


def plan_peak_bytes(graph: graph_lib.ForwardGraph, kept: Iterable[int],
                    not_replayed: Iterable[int] = ()) -> int:
    """Predicted peak of forward + backward when ``kept`` are the only outputs kept."""
    kept = set(kept)
    segs = segments(graph, kept, not_replayed)
    n = graph.num_nodes
    consumers = graph.consumers()
    top = set(segs.top)
    retained = [v in kept or (v in top and (graph.is_saved_for_backward(v) or graph.feeds_sink[v]))
                for v in range(n)]
    ledger = _Ledger()
    _forward(graph, range(n), consumers, retained, ledger)
    grads: set[int] = set()
    for v in reversed(segs.top):
        _backward_step(graph, v, grads, ledger)
        if retained[v]:
            ledger.free(graph.size_bytes[v])
    for group in segs.levels():
        for k in group:  # every reader of k is in a lower level, done by now
            ledger.free(graph.size_bytes[k])
        active = [k for k in group if k in grads]
        recomputed = segs.recomputed(active)
        members = set(recomputed)
        saved = {v: graph.is_saved_for_backward(v) or v in active for v in recomputed}
        _forward(graph, recomputed, consumers, saved, ledger, members=members)
        for v in reversed(recomputed):
            _backward_step(graph, v, grads, ledger)
            if saved[v]:
                ledger.free(graph.size_bytes[v])
        for k in active:
            if k not in members and k in grads:  # a never-replayed kept node
                grads.discard(k)
                ledger.free(graph.size_bytes[k])
    return ledger.peak


def _forward(graph, order, consumers, retained, ledger, members=None) -> None:
    """Run ``order`` forward, freeing each output after its last consumer (within ``members``)
    unless ``retained``."""
    order = list(order)
    member_set = set(order) if members is None else members
    pending = {v: sum(1 for c in consumers[v] if c in member_set) for v in order}
    for v in order:
        ledger.alloc(graph.size_bytes[v])
        for p in set(graph.inputs[v]):
            if p in pending:
                pending[p] -= 1
                if pending[p] == 0 and not retained[p]:
                    ledger.free(graph.size_bytes[p])
        if pending[v] == 0 and not retained[v]:
            ledger.free(graph.size_bytes[v])


def _backward_step(graph, v, grads: set, ledger) -> None:
    """Backprop through ``v``: allocate its inputs' gradients, free its own (partials for kept
    nodes stay in ``grads`` until their level)."""
    if v not in grads and not graph.feeds_sink[v]:
        return  # no gradient reaches v
    for p in set(graph.inputs[v]):
        if p not in grads and graph.size_bytes[p]:
            grads.add(p)
            ledger.alloc(graph.size_bytes[p])
    if v in grads:
        grads.discard(v)
        ledger.free(graph.size_bytes[v])
