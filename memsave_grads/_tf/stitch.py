"""Run a schedule in TensorFlow: backpropagate segment by segment and add up the partials.

What to copy and in which order comes from the schedule (``memsave_grads.core.schedule``, the
same one the memory model replays; docs/design.md, notes "levels" and "plan and schedule"):
the top segment is differentiated through the original ops; then, level by level, the segments
of the kept ops whose gradients are complete are copied and differentiated in one
``tf.gradients`` call. Copies read fresh identity *boundaries* of the kept tensors and ``xs``
(note "boundaries"); those, and the inputs of original ops, are the call's sources and
``stop_gradients``: backprop stops there and the partial w.r.t. each is read off. Deferred ops
(variable reads) are differentiated in one final call.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
from typing import Iterable, Mapping, Sequence

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import op_def_registry
from tensorflow.python.util import tf_stack

from memsave_grads._tf import exposure
from memsave_grads._tf import ordering
from memsave_grads._tf import rewrite
from memsave_grads._tf import graph as tf_graph
from memsave_grads import errors
from memsave_grads.core import graph as graph_lib
from memsave_grads.core import op_types
from memsave_grads.core import schedule as schedule_lib

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)


def zeros_like(x: tf.Tensor) -> tf.Tensor:
    """What ``tf.gradients(..., unconnected_gradients='zero')`` returns for ``x``."""
    if x.dtype == tf.resource:
        from tensorflow.python.ops import resource_variable_ops  # pylint: disable=import-outside-toplevel
        from tensorflow.python.ops import default_gradient  # pylint: disable=import-outside-toplevel
        return tf.zeros(resource_variable_ops.variable_shape(x),
                        dtype=default_gradient.get_zeros_dtype(x))
    return tf.zeros_like(x)


def _densify(g, t: tf.Tensor) -> tf.Tensor:
    if isinstance(g, tf.IndexedSlices):
        if g.dense_shape is None:
            raise errors.SparseGradientError(
                f"The gradient of {t.name!r} adds a sparse partial (IndexedSlices) to a dense one, "
                f"but the sparse partial has no dense_shape, so it cannot be densified. Give the "
                f"tensor a known shape, or keep the gather/embedding output as a checkpoint so the "
                f"sparse partial reaches the variable unmixed.")
        return tf.convert_to_tensor(g)
    return g


def aggregate(partials: Sequence, t: tf.Tensor):
    """Sum the partials of one tensor: dense stays dense, sparse stays sparse (concatenated),
    and only a mix of both is densified (as tf.gradients does)."""
    partials = [g for g in partials if g is not None]
    if not partials:
        return None
    if len(partials) == 1:
        return partials[0]
    if all(isinstance(g, tf.IndexedSlices) for g in partials):
        indices = [g.indices for g in partials]
        if len({i.dtype for i in indices}) > 1:
            indices = [tf.cast(i, tf.int64) for i in indices]
        return tf.IndexedSlices(tf.concat([g.values for g in partials], axis=0),
                                tf.concat(indices, axis=0), partials[0].dense_shape)
    return _add_per_device([_densify(g, t) for g in partials])


def _add_per_device(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """``add_n`` as tf.gradients does it (``_MultiDeviceAddN``): one sum per device, each
    colocated with its first summand, then the sum of those; so a summed gradient stays on
    the device of the forward op that produced its first partial."""
    by_device = collections.defaultdict(list)
    for t in tensors:
        by_device[t.device or ""].append(t)
    sums = []
    for device in sorted(by_device):
        with tf_graph.colocated_with(by_device[device][0].op):
            sums.append(tf.add_n(by_device[device]))
    return sums[0] if len(sums) == 1 else tf.add_n(sums)


def _gradient_ops(g) -> list[tf.Operation]:
    if isinstance(g, tf.IndexedSlices):
        return [g.values.op, g.indices.op]
    return [g.op]


def _arrival_ops(g) -> list[tf.Operation]:
    """The ops a level's copies wait for to start after gradient ``g`` exists: the ops
    producing it, except a bias gradient's, for which the op producing the gradient it reduces
    (design note "scheduling": oneDNN fuses that op with a later one, closing a cycle)."""
    return [op.inputs[0].op if op.type in op_types.FUSED_WITH_LATER_GRADIENT_OP_TYPES else op
            for op in _gradient_ops(g)]


def _left_behind_ops(weight_grads: Sequence, grads: Sequence) -> list[tf.Operation]:
    """The ops producing ``weight_grads`` (one call's partials of xs and variable reads, of
    all its partials ``grads``) that the next level's copies wait for besides their own
    incoming gradients: the cheap ones, a bias's gradient (a sum over the batch) foremost.
    Nothing of the next level reads it, and until it runs it holds its level's incoming
    gradient, the recomputed buffers forwarded in place; with one inter-op thread TensorFlow
    ran such an op last (design note "scheduling"). Not the expensive ones (a weight's
    gradient, a matmul or convolution): they already wait for their siblings (note "writes
    after reads"), run as soon as those have, and overlap the next level's recomputation.
    Not a bias gradient that reduces a partial passed on: oneDNN fuses it with the filter
    gradient that reads the same partial in a later level, which the copies would then both
    wait for and feed. (The partials passed on, a kept view of a bias's among them, are the
    next level's incoming gradients: ``_arrival_ops``.)"""
    passed = {g.ref() for g in grads if isinstance(g, tf.Tensor)}
    ops = []
    for g in weight_grads:
        if g is None:
            continue
        for op in _gradient_ops(g):
            if tf_graph.is_expensive(op) or (
                    op.type in op_types.FUSED_WITH_LATER_GRADIENT_OP_TYPES
                    and op.inputs[0].ref() in passed):
                continue
            ops.append(op)
    return list(dict.fromkeys(ops))


@dataclasses.dataclass(frozen=True)
class CallOptions:
    """What every ``tf.gradients`` call of one rewrite shares.

    Attributes:
      user_stops: the caller's ``stop_gradients``.
      tf_kwargs: the other ``tf.gradients`` keyword arguments, passed on.
      unconnected_zero: return zeros, not None, for an x no y depends on.
      scope_prefix: name scope of the copies and boundaries.
      xla: the step is compiled by XLA (``ordering.xla_in_effect``): copies also wait for
        their gradients through dataflow.
      materialize: the step is certainly compiled by XLA (``ordering.compiled_by_xla``): each
        level's boundaries and incoming gradients also pass through conditionals, or barriers
        for a GPU (``ordering.materialized``; design note "memory under XLA").
    """

    user_stops: Sequence[tf.Tensor]
    tf_kwargs: dict
    unconnected_zero: bool
    scope_prefix: str
    xla: bool = False
    materialize: bool = False


class _Backprop:
    """State of one rewritten gradient computation (a single use, then discarded)."""

    def __init__(self, ops: Mapping[int, tf.Operation], sched: schedule_lib.Schedule,
                 xs: Sequence[tf.Tensor], options: CallOptions,
                 waiters: Iterable[tf.Operation] = ()):
        self.ops = ops
        self.waiters = set(waiters)
        self.region_set = set(ops.values()) | self.waiters
        self.kept = {ops[k] for k in sched.kept}
        self.x_refs = {x.ref() for x in xs}
        self.options = options
        self.partials: dict = collections.defaultdict(list)
        self.totals: dict = {}
        #: The cheap producers of the last tf.gradients call's partials of xs and variable
        #: reads: the next level's copies wait for them (:func:`_left_behind_ops`; design
        #: note "scheduling").
        self.left_behind: list[tf.Operation] = []

    def ends_segment(self, t: tf.Tensor) -> bool:
        """Kept tensors and xs: where a segment walk stops and partials are collected."""
        return (t.op in self.region_set and t.op in self.kept) or t.ref() in self.x_refs

    def with_waiters(self, segment_ops: Iterable[tf.Operation]) -> list[tf.Operation]:
        """``segment_ops`` plus the waiting identities that feed them, in creation order."""
        waiting_inputs = lambda op: [t.op for t in op.inputs if t.op in self.waiters]  # noqa: E731
        return sorted(tf_graph.walk(segment_ops, waiting_inputs), key=tf_graph.creation_index)

    def sources(self, segment_ops: Iterable[tf.Operation]) -> list[tf.Tensor]:
        """The tensors ``segment_ops`` read where a segment ends (kept tensors and xs)."""
        seen, out = set(), []
        for op in segment_ops:
            for t in op.inputs:
                if self.ends_segment(t) and t.ref() not in seen:
                    seen.add(t.ref())
                    out.append(t)
        return out

    def total(self, t: tf.Tensor):
        """The complete gradient of ``t`` (call only once every partial has arrived)."""
        key = t.ref()
        if key not in self.totals:
            # tf.gradients sums an op's output gradients inside _maybe_colocate_with(op): with
            # colocate_gradients_with_ops the final add_n of the per-device sums sits with the
            # forward op, not on the default device (docs/design.md, note "colocation").
            colocate = self.options.tf_kwargs.get("colocate_gradients_with_ops")
            with (tf_graph.colocated_with(t.op) if colocate else contextlib.nullcontext()):
                self.totals[key] = aggregate(self.partials.get(key, ()), t)
        return self.totals[key]

    def run(self, targets, target_grads, sources, readers=None) -> None:
        """One tf.gradients call; its results become partials of ``sources``.

        ``readers[i]`` is the tensor the differentiated ops actually read for ``sources[i]``:
        a boundary for copied segments, the source itself for original ops. All of them are
        stop_gradients, so backprop ends there and the partial is read off.
        """
        if not targets or not sources:
            return
        readers = list(sources) if readers is None else readers
        # Every op this call creates is newer than what it differentiates and reads.
        floors: dict = {}
        for t in list(targets) + list(readers):
            floors[t.graph] = max(floors.get(t.graph, 0), tf_graph.creation_index(t.op))
        grads = tf_graph.gradients_stopped_at(
            targets, readers, target_grads, list(readers) + list(self.options.user_stops),
            **self.options.tf_kwargs)
        rewrite.credit_gradients_to_originals(grads, floors)
        for t, g in zip(sources, grads):
            if g is not None:
                self.partials[t.ref()].append(g)
        self.left_behind = _left_behind_ops(
            [g for t, g in zip(sources, grads)
             if t.ref() in self.x_refs or t.op.type in op_types.VARIABLE_READ_OP_TYPES], grads)


def backprop(ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor], grad_ys: Sequence,
             model: graph_lib.ForwardGraph, ops: Mapping[int, tf.Operation],
             sched: schedule_lib.Schedule, options: CallOptions,
             waiters: Iterable[tf.Operation] = ()) -> list:
    """Gradients of ``ys`` w.r.t. ``xs``, running ``sched`` (its nodes are ``ops``' keys: node
    numbers of ``model``; ``ops`` covers the schedule's members).

    ``waiters``: identities through which copied While ops read their inputs
    (``rewrite.copy_ops``); they belong to the segment of the op they feed.
    """
    state = _Backprop(ops, sched, xs, options, waiters)
    for v in sorted({v for members in sched.owned.values() for v in members}):
        exposure.expose_for_replay(ops[v])  # before any gradient is built
    _top(state, ys, grad_ys, state.with_waiters(ops[v] for v in sched.top))
    for level in sched.levels:
        _level(state, model, sched, level.number, level.kept)
    _level(state, model, sched, "final", sched.deferred)  # design note "levels"
    results = []
    for x in xs:
        g = state.total(x)
        if g is None and options.unconnected_zero:
            g = zeros_like(x)
        results.append(g)
    return results


def _top(state: _Backprop, ys, grad_ys, top: list[tf.Operation]) -> None:
    """Level 0: the top segment, through the original ops."""
    targets, target_grads, extra_sources = [], [], []
    for y, gy in zip(ys, grad_ys):
        if state.ends_segment(y):
            extra_sources.append(y)
        elif y.op not in state.region_set:
            continue  # y does not depend on xs
        targets.append(y)
        target_grads.append(gy)
    sources = state.sources(top)
    known = {t.ref() for t in sources}
    for t in extra_sources:  # a y that is itself kept or an x: its gradient is its grad_y
        if t.ref() not in known:
            known.add(t.ref())
            sources.append(t)
    state.run(targets, target_grads, sources)


def _boundary(t: tf.Tensor, scope: str, stack=None) -> tf.Tensor:
    """``tf.identity(t)`` colocated with ``t``, made the way ``colocate_with(t.op)`` would
    make it (``t.op``'s colocation groups and device) but without the context managers and the
    op-definition library, through ``rewrite.create_op`` as the copies are: a level makes one
    per source, and on a 1000-block chain the ``tf.identity`` route was a tenth of the whole
    rewrite's time (design note "boundaries"). Recorded on the tapes recording now, as
    ``tf.identity`` would be. ``stack``: the creating stack trace, extracted once for a
    level's boundaries (``rewrite.create_op``)."""
    graph = t.graph
    # TF1 reference variables (tf.identity reads the value behind the reference), and a call
    # inside a colocate_with block, whose groups colocate_with(t.op) would add to t.op's: the
    # ordinary route.
    if t.dtype._is_ref_dtype or graph._colocation_stack:  # pylint: disable=protected-access
        with graph.name_scope(scope.rstrip("/")), graph.colocate_with(t.op):
            return tf.identity(t)
    groups = sorted(set(rewrite.colocation_groups(t.op)))
    attrs = {"T": attr_value_pb2.AttrValue(type=t.dtype.as_datatype_enum),
             "_class": attr_value_pb2.AttrValue(
                 list=attr_value_pb2.AttrValue.ListValue(s=groups))}
    op = rewrite.create_op(graph, "Identity", [t], name=f"{scope}Identity", attrs=attrs,
                           op_def=op_def_registry.get("Identity"), device=t.op.device,
                           stack=stack)
    out = op.outputs[0]
    out.set_shape(t.shape)
    rewrite.copy_handle_data(t, out)  # a resource's or variant's, as tf.identity passes on
    rewrite.record_on_tapes(op)
    return out


def _read_gradients_passed_on(state: _Backprop, kept_nodes: Sequence[int]) -> list[int]:
    """The final level's variable reads whose gradient is their incoming gradient, passed to
    their variable as its partial without a ``tf.gradients`` call; the other nodes are left
    for the call. A ``ReadVariableOp``'s registered gradient returns its incoming gradient
    unchanged, so the call would only wrap it in a ``grad_ys`` identity: one op per variable
    (a thousand on a 1000-layer MLP). Not where the caller stops gradients at the read, nor
    where ``gradient_override_map`` gave the read another gradient."""
    stopped = {t.ref() for t in state.options.user_stops}
    left = []
    for k in kept_nodes:
        op = state.ops[k]
        if (op.type == "ReadVariableOp" and op.inputs[0].ref() in state.x_refs
                and "_gradient_op_type" not in op.node_def.attr  # gradient_override_map
                and op.outputs[0].ref() not in stopped and op.inputs[0].ref() not in stopped):
            d = state.total(op.outputs[0])
            if d is not None:
                state.partials[op.inputs[0].ref()].append(d)
            continue
        left.append(k)
    return left


def _materialized(boundaries: Mapping, active: list, arrival: tf.Tensor) -> Mapping:
    """Pass a level's floating boundaries that sum activations (``ordering.sums_activations``)
    and its dense incoming gradients each through a conditional on the arrival zero, or a
    barrier with it for a GPU (``ordering.materialized``; design note "memory under XLA"):
    what the copies read instead of the boundaries, ``{ref: tensor}``; ``active``'s gradients
    are replaced in place by theirs. XLA then reads each checkpoint and each
    gradient sum from a buffer instead of fusing the elementwise chain that made it (a
    residual stream, forward or backward) into every reader. The differentiated readers stay
    the boundaries, so the partials are read off there as before."""
    refs = [ref for ref, b in boundaries.items()
            if ordering.can_wait(b) and ordering.sums_activations(ref.deref())]
    slots = [(i, j) for i, (_, ds) in enumerate(active) for j, d in enumerate(ds)
             if isinstance(d, tf.Tensor) and ordering.can_wait(d)]
    if not refs and not slots:
        return boundaries
    outs = ordering.materialized([boundaries[ref] for ref in refs]
                                 + [active[i][1][j] for i, j in slots], arrival)
    for (i, j), d in zip(slots, outs[len(refs):]):
        active[i][1][j] = d
    return {**boundaries, **dict(zip(refs, outs[:len(refs)]))}


def _level(state: _Backprop, model: graph_lib.ForwardGraph, sched: schedule_lib.Schedule,
           label: int | str, kept_nodes: Sequence[int]) -> None:
    """One level: copy the segments of its active kept ops and differentiate them in one call
    (or, where they have sub-plans, run the level's own schedule over the copies)."""
    if label == "final":
        kept_nodes = _read_gradients_passed_on(state, kept_nodes)
    active = []
    for k in kept_nodes:
        op = state.ops[k]
        ds = [state.total(t) for t in op.outputs]
        if any(d is not None for d in ds):
            active.append((k, ds))
    if not active:
        return
    recomputed = sched.recomputed_by(k for k, _ in active)
    to_copy = state.with_waiters(state.ops[v] for v in recomputed)
    scope = f"{state.options.scope_prefix}/recompute_level{label}"
    # Copies read fresh identity boundaries, not the kept tensors themselves: tf.gradients
    # walks everything downstream of its sources, and the originals have the whole rest of
    # the graph downstream. Identities, not StopGradient, so that a later derivative of
    # these gradients still reaches the checkpoints (design note "boundaries").
    copied_sources = state.sources(to_copy)
    stack = tf_stack.extract_stack(stacklevel=1)  # one creating stack for the boundaries
    boundaries = {t.ref(): _boundary(t, f"{scope}/boundary/", stack) for t in copied_sources}
    incoming = [d for _, ds in active for d in ds if d is not None]
    control = list(dict.fromkeys([c for d in incoming for c in _arrival_ops(d)]
                                 + state.left_behind))
    # Under XLA, which drops control inputs, the copies also wait for the level's gradients
    # through dataflow (design note "ordering under XLA").
    arrival = None
    if state.options.xla and to_copy:
        with tf.name_scope(f"{scope}/arrival"):
            arrival = ordering.gradient_arrival(incoming)
    copy_inputs, materializing_ops = boundaries, []
    if state.options.materialize and arrival is not None:
        graph = arrival.graph
        ops_before = len(graph.get_operations())
        with tf.name_scope(f"{scope}/arrival"):
            copy_inputs = _materialized(boundaries, active, arrival)
        materializing_ops = graph.get_operations()[ops_before:]
    copies = rewrite.copy_ops(to_copy, scope, control, replacements=copy_inputs,
                              arrival=arrival, replay=exposure.replay_copy)
    # The conditional (or barrier) belongs to the copied region, as the waiting stand-ins do
    # (note "ordering under XLA", "Nested levels copy the stand-ins too"): a nested level's
    # copies must read its copy of it, not the one outside its sources, or the partials of
    # what passes through it are lost.
    copies.update((op, op) for op in materializing_ops)
    targets, target_grads, copied = [], [], []
    for k, ds in active:
        op = state.ops[k]
        produced = copies.get(op, op)
        for t, d in zip(produced.outputs, ds):
            # A boolean or integer output's "gradient" (zeros a tape hands back for a call's
            # outputs) flows nowhere, and tf.gradients refuses it as a target's.
            if d is not None and tf_graph.carries_gradients(t):
                targets.append(t)
                target_grads.append(d)
                copied.append(produced is not op)
    original_sources = state.sources([state.ops[k] for k, _ in active
                                      if state.ops[k] not in copies])
    readers = [boundaries[t.ref()] for t in copied_sources]
    nested = sched.nested(model, [k for k, _ in active])
    if nested is not None:  # design note "multi-level"
        # The level's copies are a region of their own: ys = the copied kept outputs, xs = the
        # boundaries; its schedule keeps the sub-plans' nodes and copies each sub-segment once
        # more, later, recursively.
        sub_ops = {v: copies[state.ops[v]] for v in nested.members}
        # A replayed op's stand-in is among the ops its replay made, but it is the op's copy,
        # a node of the sub-plan: not a waiter, or a sub-segment starting at it would copy the
        # whole replay again instead of reading its boundary (and lose the partials of what
        # the replay read).
        nodes = set(sub_ops.values())
        sub_waiters = {c for o, c in copies.items()
                       if (o is c or o in state.waiters) and c not in nodes}
        sub_options = dataclasses.replace(state.options, unconnected_zero=False,
                                          scope_prefix=f"{scope}/nested")
        grads = backprop([t for t, c in zip(targets, copied) if c],
                         readers, [d for d, c in zip(target_grads, copied) if c], model,
                         sub_ops, nested, sub_options, sub_waiters)
        for t, g in zip(copied_sources, grads):
            if g is not None:
                state.partials[t.ref()].append(g)
        state.run([t for t, c in zip(targets, copied) if not c],
                  [d for d, c in zip(target_grads, copied) if not c], original_sources)
    else:
        state.run(targets, target_grads, copied_sources + original_sources,
                  readers=readers + original_sources)
    _LOG.debug("memsave_grads: level %s: %d kept ops, %d ops recomputed",
               label, len(active), len(to_copy))
