"""A TensorFlow-free model of the forward graph between ``xs`` and ``ys``.

Nodes are operations numbered ``0..n-1`` in a topological order; edges are data dependencies.
The planners and the memory estimate work on this model only, so they can be tested fast and
property-tested without building TensorFlow graphs.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Iterable, Sequence


@dataclasses.dataclass(frozen=True)
class ForwardGraph:
    """The forward region between ``xs`` and ``ys`` as a DAG of operations.

    Attributes:
      inputs: for each node, the nodes whose outputs it reads (all with a smaller index).
      size_bytes: bytes of each node's outputs (static shapes; unknown dimensions count as 1).
      reads_source: node reads an ``x`` directly (an edge from the virtual source).
      feeds_sink: node produces a ``y`` (an edge to the virtual sink).
      names: node names, for reports and errors.
      expensive: node is costly to recompute (matmul, convolution); empty means none is.
      grad_reads_inputs: the node's gradient reads its inputs (matmul, convolution, mul),
        so they stay alive until its backward step; empty means every node's does (the
        conservative default).
      grad_reads_output: the node's gradient reads its own output (relu, tanh, softmax);
        empty means none does.
      views: the node's output shares its input's buffer (reshape, identity): it allocates no
        memory of its own unless it is kept; empty means no node is a view.
      param_bytes: bytes of the variables (``xs``) the node reads: its backward step produces
        gradients of that size; empty means 0.
      costs: the cost of recomputing the node (floating-point operations from static shapes,
        or seconds calibrated by ``budgets.calibrated_costs``; finite, >= 0); empty means every
        node costs 1.
      unread_inputs: for each node, input nodes its gradient does *not* read although
        ``grad_reads_inputs`` says it reads its inputs (``0.5 * x`` keeps no ``x``: only the
        constant's gradient would read it); empty means none.
      forwards: the node's output may take over the buffer of an input that nothing else holds
        (elementwise ops), and its gradient that of its incoming gradient; empty means none.
      no_gradient: the node's outputs carry no gradient (booleans, integers: a comparison
        feeding a ``tf.cond``), so backprop passes nothing to them; empty means every node's
        outputs carry one.
      internal_saved_bytes: bytes a function-bodied node (a cond, a loop, a function call)
        keeps *inside* for its gradient, beyond its inputs and outputs: the branch, iteration
        or body intermediates that TensorFlow's gradient of the op makes its forward pass
        output (cond_v2's optionals, while_v2's accumulators). Held from the node's forward
        step to its backward step wherever it is differentiated: where it ran (plain
        tf.gradients, the top segment, never-replayed kept nodes) or in the copy that a level
        recomputes (design note "control flow and calls"); empty means none.
      exposed_bytes: bytes a stateful cond or call outputs in addition where a plan replays it
        (its random draws, or the cheapest values computed from them alone), held from the
        forward pass until the level that recomputes it; empty means none.
      gradients_held: the variables' gradients (``param_bytes``) stay alive until the backward
        pass ends, because an optimizer applies them together (Keras ``fit`` sums them in one
        op first); False: each is used up at its node's backward step, as v1 optimizers'
        per-variable updates, ``minimize`` and early release do (design note "memory model").
    """

    inputs: tuple[tuple[int, ...], ...]
    size_bytes: tuple[int, ...]
    reads_source: tuple[bool, ...]
    feeds_sink: tuple[bool, ...]
    names: tuple[str, ...] = ()
    expensive: tuple[bool, ...] = ()
    grad_reads_inputs: tuple[bool, ...] = ()
    grad_reads_output: tuple[bool, ...] = ()
    param_bytes: tuple[int, ...] = ()
    views: tuple[bool, ...] = ()
    costs: tuple[float, ...] = ()
    unread_inputs: tuple[frozenset, ...] = ()
    forwards: tuple[bool, ...] = ()
    no_gradient: tuple[bool, ...] = ()
    internal_saved_bytes: tuple[int, ...] = ()
    exposed_bytes: tuple[int, ...] = ()
    gradients_held: bool = False

    def __post_init__(self):
        n = len(self.inputs)
        if not (len(self.size_bytes) == len(self.reads_source) == len(self.feeds_sink) == n):
            raise ValueError("ForwardGraph fields must all have one entry per node")
        for name in ("names", "expensive", "grad_reads_inputs", "grad_reads_output",
                     "param_bytes", "views", "costs", "unread_inputs", "forwards", "no_gradient",
                     "internal_saved_bytes", "exposed_bytes"):
            if getattr(self, name) and len(getattr(self, name)) != n:
                raise ValueError(f"ForwardGraph.{name} must be empty or have one entry per node")
        if self.costs and not all(math.isfinite(c) and c >= 0 for c in self.costs):
            # The planners sum costs by prefix sums and compare plans by them: an infinite or
            # NaN cost makes differences NaN, and a negative one rewards recomputation.
            raise ValueError("ForwardGraph.costs must be finite and >= 0 (FLOPs or measured "
                             "seconds)")
        for node, preds in enumerate(self.inputs):
            for p in preds:
                if not 0 <= p < node:
                    raise ValueError(f"node {node} reads node {p}: nodes must be in topological "
                                     "order")

    @property
    def num_nodes(self) -> int:
        return len(self.inputs)

    def is_expensive(self, node: int) -> bool:
        return bool(self.expensive) and self.expensive[node]

    def gradient_reads_inputs(self, node: int) -> bool:
        return not self.grad_reads_inputs or self.grad_reads_inputs[node]

    def gradient_reads_input(self, node: int, input_node: int) -> bool:
        """Whether ``node``'s gradient reads the output of ``input_node`` (one of its inputs);
        never where ``node`` passes no gradient back (a comparison): backprop runs no gradient
        function for it."""
        return (self.carries_gradient(node) and self.gradient_reads_inputs(node)
                and not (self.unread_inputs and input_node in self.unread_inputs[node]))

    def forwards_buffer(self, node: int) -> bool:
        return bool(self.forwards) and self.forwards[node]

    def carries_gradient(self, node: int) -> bool:
        return not (self.no_gradient and self.no_gradient[node])

    def gradient_reads_output(self, node: int) -> bool:
        return (bool(self.grad_reads_output) and self.grad_reads_output[node]
                and self.carries_gradient(node))

    def is_view(self, node: int) -> bool:
        return bool(self.views) and self.views[node]

    def internal_saved(self, node: int) -> int:
        """Bytes ``node`` keeps inside for its gradient (``internal_saved_bytes``)."""
        return self.internal_saved_bytes[node] if self.internal_saved_bytes else 0

    def exposed(self, node: int) -> int:
        """Bytes ``node`` outputs in addition where a plan replays it (``exposed_bytes``)."""
        return self.exposed_bytes[node] if self.exposed_bytes else 0

    def params_of(self, node: int) -> int:
        return self.param_bytes[node] if self.param_bytes else 0

    def cost_of(self, node: int) -> float:
        """Cost of recomputing ``node`` (1 per node when no costs are known)."""
        return self.costs[node] if self.costs else 1.0

    def forward_cost(self) -> float:
        """The whole forward pass's cost: what recomputing every node once would cost."""
        return sum(self.cost_of(v) for v in range(self.num_nodes))

    def consumers(self) -> list[list[int]]:
        """For each node, the distinct nodes that read it (computed once; do not mutate)."""
        return self._consumer_lists

    @functools.cached_property
    def _consumer_lists(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for node, preds in enumerate(self.inputs):
            for p in sorted(set(preds)):
                out[p].append(node)
        return out

    @functools.cached_property
    def facts(self) -> "NodeFacts":
        """The per-node answers of the methods above, as lists, made once per model: the
        memory model's steps read them hundreds of thousands of times in a search (design
        note "planning cost"). Do not mutate."""
        n = self.num_nodes
        consumers = self.consumers()
        return NodeFacts(
            unique_inputs=[tuple(sorted(set(preds))) for preds in self.inputs],
            gradient_readers=[[c for c in consumers[v] if self.gradient_reads_input(c, v)]
                              for v in range(n)],
            reads_output=[self.gradient_reads_output(v) for v in range(n)],
            forwards=[self.forwards_buffer(v) for v in range(n)],
            carries=[self.carries_gradient(v) for v in range(n)],
            buffer_bytes=[0 if self.is_view(v) else self.size_bytes[v] for v in range(n)],
            params=[self.params_of(v) for v in range(n)],
            internal=[self.internal_saved(v) for v in range(n)])


@dataclasses.dataclass(frozen=True)
class NodeFacts:
    """:attr:`ForwardGraph.facts`: for each node, its distinct inputs (ascending), the readers
    whose gradient reads it (ascending), whether its gradient reads its output, whether it
    forwards a buffer, whether it carries a gradient, the bytes it allocates unless kept (0
    for a view), its variables' bytes, its internal saved bytes."""

    unique_inputs: list
    gradient_readers: list
    reads_output: list
    forwards: list
    carries: list
    buffer_bytes: list
    params: list
    internal: list


def memo(graph: ForwardGraph) -> dict:
    """A dictionary that lives as long as ``graph``, for what the planners compute once per
    graph model and share (``fast_replay.replayer``, ``planners.CutSearch.of``). The model is
    immutable, so nothing in it goes stale; it sits in the instance dictionary, as
    ``functools.cached_property`` values do (``consumers``)."""
    return graph.__dict__.setdefault("_memo", {})


def without_memo(graph: ForwardGraph) -> ForwardGraph:
    """An equal model that shares ``graph``'s fields but none of what :func:`memo` holds
    (replays' caches, cut searches: megabytes on large graphs) nor its per-node
    :attr:`ForwardGraph.facts` (made again where read), for a long-lived key."""
    bare = copy.copy(graph)
    bare.__dict__.pop("_memo", None)
    bare.__dict__.pop("facts", None)
    return bare


def close_segments(graph: ForwardGraph, kept: Iterable[int], members: Iterable[int] | None = None,
                   sinks: Iterable[int] | None = None) -> set[int]:
    """``kept`` plus every node whose outputs feed more than one segment, in linear time.

    A node's *owner* is the kept node (or the top segment, above the ``ys``) whose segment would
    copy it. A node read by two segments would be copied, and recomputed, twice; on a residual
    stream whose adds are not kept, every segment would replay the stream back to the input and
    the rewrite would grow quadratically. Keeping such nodes makes every node's owner unique:
    each forward op is recomputed at most once (design note "single owner").

    ``members``/``sinks``: the same inside one recomputed region whose outputs the backward pass
    needs are ``sinks`` (design note "multi-level"): only readers among ``members`` count.

    ``planners.CutSearch`` closes the frontiers of its cuts with arrays and this sweep only
    where owners meet: a change to the rules here (which nodes the top owns) belongs there too.
    """
    top = -1
    kept = set(kept)
    consumers = graph.consumers()
    if members is None:
        order, inside, sink_set = range(graph.num_nodes - 1, -1, -1), None, None
    else:
        inside, sink_set = set(members), set(sinks or ())
        order = sorted(inside, reverse=True)
    owner: list[int | None] = [None] * graph.num_nodes
    feeds_sink = graph.feeds_sink
    for v in order:
        if v in kept:
            continue
        # The first owner among the sink and v's readers; a second, different one: two owners.
        first = top if (feeds_sink[v] if sink_set is None else v in sink_set) else None
        shared = False
        for c in consumers[v]:
            if inside is not None and c not in inside:
                continue
            o = c if c in kept else owner[c]
            if first is None:
                first = o
            elif o != first:
                shared = True
                break
        if shared:
            kept.add(v)
        else:
            owner[v] = top if first is None else first
    return kept


def last_uses(graph: ForwardGraph, always_live: Iterable[int] = ()) -> list[int]:
    """For each node, the last node (in topological order) that reads it; ``num_nodes`` for a
    node that produces a ``y``, and ``-1`` for ``always_live`` nodes (they cost nothing to keep).
    """
    n = graph.num_nodes
    last = [n if graph.feeds_sink[v] else -1 for v in range(n)]
    for node, preds in enumerate(graph.inputs):
        for p in preds:
            if last[p] < node:
                last[p] = node
    for v in always_live:
        last[v] = -1
    return last


def frontier(graph: ForwardGraph, position: int, always_live: Iterable[int] = (),
             uses: Sequence[int] | None = None) -> list[int]:
    """The *live frontier* after ``position``: nodes up to it that a later node (or a ``y``)
    reads. Keeping all of them cuts the graph there: nothing after ``position`` needs anything
    before it but these (design note "frontier cuts")."""
    return frontiers(graph, [position], always_live, uses)[0]


def frontiers(graph: ForwardGraph, positions: Sequence[int], always_live: Iterable[int] = (),
              uses: Sequence[int] | None = None) -> list[list[int]]:
    """:func:`frontier` of each of the increasing ``positions``, in one sweep."""
    uses = last_uses(graph, always_live) if uses is None else uses
    result, live, start = [], set(), 0
    for position in positions:
        for v in range(start, position + 1):
            if uses[v] > v:
                live.add(v)
        start = position + 1
        live = {v for v in live if uses[v] > position}
        result.append(sorted(live))
    return result
