"""Nested plans (revolve-style): cut trees, and the plans they make.

A single-level plan keeps some nodes and recomputes each segment once from them (design notes
"levels" and "single owner"). A *nested* plan gives a recomputed segment its own checkpoints
(``Plan.children``): while the segment is replayed, only its sub-kept nodes (and what its own
top sub-segment's backward reads) stay; its sub-segments are replayed again from them when
backprop reaches them, recursively. Memory falls to O(log n) on a chain at O(n log n) compute
(design note "multi-level" in docs/design.md).

This module is TensorFlow-free. The schedule of a nested plan (``schedule.Schedule.nested``) is
what both the memory model replays and the rewrite runs; here are the plans themselves:

* :class:`CutTree` and :func:`plan_from_tree`: the cuts made at each level of a region, and the
  nested plan that keeps their live frontiers (``"revolve"``, ``solvers.revolve``, finds trees);
* :func:`balanced_plan`: a plan of exactly ``levels`` levels, for tests and experiments.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from memsave_grads.core import graph as graph_lib
from memsave_grads.core import plan as plan_lib
from memsave_grads.core import planners
from memsave_grads.core import schedule as schedule_lib


# --------------------------------------------------------------------------------------------
# Cut trees -> nested plans
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CutTree:
    """Cuts (topological positions) made at one level of a region, and for each segment
    ``(cut_{l-1}, cut_l]`` the tree of its own replay."""

    cuts: list
    segments: list


def plan_from_tree(graph: graph_lib.ForwardGraph, search: planners.CutSearch, tree: CutTree,
                   not_replayed: Iterable[int] = ()) -> plan_lib.Plan:
    """The nested plan that keeps the live frontiers of a tree's cuts, level by level."""
    positions = sorted(_all_cuts(tree))
    fronts = dict(zip(positions, graph_lib.frontiers(graph, positions, uses=search.uses)))
    kept = search.kept_for(tree.cuts)
    sched = schedule_lib.build(graph, kept, not_replayed)
    return plan_lib.Plan(kept, not_replayed,
                         children=_children(graph, fronts, sched, set(kept), tree))


def _all_cuts(tree: CutTree):
    yield from tree.cuts
    for sub in tree.segments:
        yield from _all_cuts(sub)


def _children(graph, fronts, segs, kept, tree) -> dict:
    children: dict[int, plan_lib.Plan] = {}
    for sub in tree.segments:
        if not sub.cuts:
            continue
        wanted = {v for c in sub.cuts for v in fronts[c]}
        for k in sorted(kept):
            members = segs.owned.get(k) or []
            nodes = wanted & set(members) - {k}
            if not nodes:
                continue
            sub_kept = graph_lib.close_segments(graph, nodes, members=members, sinks=[k])
            inner = schedule_lib.build(graph, sub_kept, members=members, sinks=[k])
            plan = plan_lib.Plan(sub_kept, children=_children(graph, fronts, inner, sub_kept, sub))
            if k in children:  # two subtrees in one segment (not on chains): merge
                old = children[k]
                plan = plan_lib.Plan(old.kept | plan.kept,
                                     children={**old.children, **plan.children})
            children[k] = plan
    return children


def balanced_plan(graph: graph_lib.ForwardGraph, must_keep: Iterable[int],
                  candidates: Iterable[int], levels: int,
                  not_replayed: Iterable[int] = ()) -> plan_lib.Plan:
    """A nested plan of exactly ``levels`` recomputation levels (where the graph has enough cut
    positions): each region's positions are cut into about n^(1/(levels+1)) equal parts,
    recursively. For tests and experiments; budgets use ``solvers.revolve.solve_revolve``."""
    search = planners.CutSearch.of(graph, must_keep, candidates)
    positions = search.positions()
    parts = max(2, round((len(positions) + 1) ** (1.0 / (levels + 1))))

    def split(inside: list, depth: int) -> CutTree:
        if depth >= levels or not inside:
            return CutTree([], [])
        count = min(len(inside), parts - 1 if depth else parts)
        step = (len(inside) + 1) / (count + 1)
        cuts = sorted({inside[min(len(inside) - 1, int(step * (i + 1)) - 1)]
                       for i in range(count)})
        segments, previous = [], -1
        for c in cuts:
            segments.append(split([p for p in inside if previous < p < c], depth + 1))
            previous = c
        return CutTree(cuts, segments)

    return plan_from_tree(graph, search, split(positions, 0), not_replayed)
