"""The schedule: how the backward pass runs a plan, segment by segment and level by level.

Derived from a :class:`~memsave_grads.core.plan.Plan` and the graph, and consumed by both the
memory model (``memory_model.replay``, in bytes) and the TensorFlow rewrite
(``memsave_grads._tf.stitch``, in ops): one walk decides what each level recomputes, so the two
cannot drift apart (docs/design.md, notes "levels" and "plan and schedule").

* Each kept node owns a *segment*: itself plus the non-kept nodes above it (never-replayed nodes
  own none). The nodes above the sinks that no segment owns form the *top* segment, which is not
  recomputed.
* A kept node's *level* is one more than the deepest level of any segment that reads it (top =
  0): all its partials come from lower levels, so its gradient is complete when its level runs.
* A level recomputes the segments of its *active* kept nodes (those a gradient reached), as one
  forward sweep and one backward call; where the plan has sub-plans for them, the level is itself
  a schedule over the recomputed nodes (:meth:`Schedule.nested`, design note "multi-level").
* *Deferred* nodes: never-replayed kept nodes that read nothing inside the region (variable
  reads: they read only ``xs``). They belong to a level like any kept node, but the rewrite takes
  all their gradients in one final call, since they pass their partials on to ``xs`` only.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Mapping

from memsave_grads.core import graph as graph_lib
from memsave_grads.core import plan as plan_lib


@dataclasses.dataclass(frozen=True)
class Level:
    """Kept nodes whose gradients complete together (lowest level first).

    Attributes:
      number: 1 for kept nodes read by the top segment only, and so on down.
      kept: the kept nodes whose gradients the level's own ``tf.gradients`` call takes, in
        topological order: every kept node of the level but the deferred ones.
      deferred: the level's deferred nodes (see the module docstring), whose gradients the
        rewrite takes in its final call.
    """

    number: int
    kept: tuple
    deferred: tuple = ()

    @property
    def nodes(self) -> list[int]:
        """Every kept node of the level, deferred ones included, in topological order."""
        return sorted(self.kept + self.deferred)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Segments and levels of a plan over ``members`` (the whole graph, or a recomputed region).

    Attributes:
      members: the nodes this schedule runs forward, in topological order.
      top: nodes of the top segment (not recomputed), in topological order.
      owned: for each kept node, the nodes its segment recomputes (itself included), in
        topological order; empty for never-replayed kept nodes.
      levels: the levels, lowest first.
      children: sub-plans of kept nodes (multi-level plans).
    """

    members: tuple
    top: tuple
    owned: Mapping[int, tuple]
    levels: tuple
    children: Mapping[int, plan_lib.Plan] = dataclasses.field(default_factory=dict)

    @property
    def kept(self) -> frozenset:
        return frozenset(self.owned)

    @property
    def deferred(self) -> list[int]:
        """Deferred nodes of every level, in topological order."""
        return sorted(v for lv in self.levels for v in lv.deferred)

    def recomputed_by(self, active: Iterable[int]) -> list[int]:
        """The nodes a level recomputes when its ``active`` kept nodes received a gradient
        (their segments, kept nodes included: the copies produce the level's targets)."""
        return sorted({v for k in active for v in self.owned[k]})

    def recomputed_nodes(self) -> set[int]:
        """Every node recomputed when every kept node receives a gradient: segment members
        that are not kept themselves (what a plan's recompute cost sums over)."""
        return {v for members in self.owned.values() for v in members if v not in self.owned}

    def nested(self, graph: graph_lib.ForwardGraph, active: Iterable[int]) -> "Schedule | None":
        """The schedule of a level whose ``active`` kept nodes have sub-plans: the union of
        their sub-kept nodes is kept while the level's segments are replayed, and the level's
        active nodes are its sinks. None for an ordinary level."""
        active = sorted(active)
        if not any(k in self.children for k in active):
            return None
        recomputed = self.recomputed_by(active)
        allowed = set(recomputed) - set(active)
        sub_kept: set = set()
        sub_children: dict = {}
        for k in active:  # the rewrite recurses once per level: one union
            child = self.children.get(k)
            if child is not None:
                sub_kept |= set(child.kept) & allowed
                sub_children.update(child.children)
        if not sub_kept:
            return None
        return build(graph, sub_kept, members=recomputed, sinks=active,
                     children={k: c for k, c in sub_children.items() if k in sub_kept})


def of_plan(graph: graph_lib.ForwardGraph, plan: plan_lib.Plan) -> Schedule:
    """The schedule of a whole-graph plan."""
    return build(graph, plan.kept, plan.not_replayed, children=plan.children)


def build(graph: graph_lib.ForwardGraph, kept: Iterable[int], not_replayed: Iterable[int] = (),
          *, members: Iterable[int] | None = None, sinks: Iterable[int] | None = None,
          children: Mapping[int, plan_lib.Plan] | None = None) -> Schedule:
    """The segments and levels that ``kept`` makes (the one segment walk of the package).

    ``members``/``sinks``: the same inside one recomputed region (design note "multi-level"):
    only ``members`` are walked, and the top segment ends at ``sinks`` instead of the ``ys``.
    """
    kept = set(kept)
    not_replayed = set(not_replayed)
    member_list = list(range(graph.num_nodes)) if members is None else sorted(members)
    inside = set(member_list)
    if sinks is None:
        sinks = (v for v in member_list if graph.feeds_sink[v])

    def walk(seeds):
        seen, stack = set(), list(seeds)
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            stack.extend(p for p in graph.inputs[v]
                         if p in inside and p not in kept and p not in seen)
        return tuple(sorted(seen))

    top = walk(v for v in sinks if v not in kept)
    owned = {k: (() if k in not_replayed else walk([k])) for k in kept}
    level = {k: 1 for k in kept}
    for k in sorted(kept, reverse=True):
        for v in owned[k] or (k,):
            for p in graph.inputs[v]:
                if p in kept and p != k:
                    level[p] = max(level[p], level[k] + 1)
    by_level = collections.defaultdict(lambda: ([], []))
    for k in sorted(kept):
        deferred = k in not_replayed and not any(p in inside for p in graph.inputs[k])
        by_level[level[k]][1 if deferred else 0].append(k)
    levels = tuple(Level(number, tuple(by_level[number][0]), tuple(by_level[number][1]))
                   for number in sorted(by_level))
    return Schedule(members=tuple(member_list), top=top, owned=owned, levels=levels,
                    children=dict(children or {}))
