"""Order variable updates into the backward pass so that each gradient dies early.

Used by :func:`memsave_grads.optimize.minimize` and the Keras step of ``wrap_model``, both
through :func:`order_updates_early` (design note "early release" in docs/design.md). Like
``rewrite.py`` it adds control inputs to operations, which is private TensorFlow API
(``Operation._add_control_inputs``); it only ever adds them to operations created by the
current training step's gradients and updates, never to the user's forward graph. The graph walks
are ``_tf.graph.walk``; "newer than ``floor``" compares creation indices
(``_tf.graph.creation_index``): a ``floor`` is ``_tf.graph.last_op_id`` taken before a phase
(backprop, ``apply_gradients``) adds its ops.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Sequence

import tensorflow as tf

from memsave_grads._tf import graph as tf_graph
from memsave_grads._tf import ordering
from memsave_grads.core import op_types

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)


def _newer_than(floor: int):
    """``walk``'s ``include`` for ops made after ``floor`` (by this ``minimize`` call)."""
    return lambda op: tf_graph.creation_index(op) > floor


@dataclasses.dataclass
class VariableUpdate:
    """One variable's gradient and the ops ``apply_gradients`` made from it."""

    name: str
    handle: tf.Tensor
    grad: object  # tf.Tensor or tf.IndexedSlices
    #: ops of the backward pass that allocate the gradient (we may delay them).
    producers: list = dataclasses.field(default_factory=list)
    #: ops of the update fed by the gradient or the handle (see :func:`update_ops`).
    fed_ops: list = dataclasses.field(default_factory=list)
    #: those and the newer ops they depend on (see :func:`update_ops`).
    update_ops: list = dataclasses.field(default_factory=list)
    #: ops of ``update_ops`` that no other variable's update shares and that do not need the
    #: gradient, with inputs: they are delayed until the gradient is computed.
    early_roots: list = dataclasses.field(default_factory=list)
    #: where the update reads its gradient through an ``IdentityN`` over every gradient
    #: (tf_keras' sum over replicas): the ops computed from the gradient where a term of
    #: ``early_roots`` joins it (``-g * lr`` in ``-g * lr + m * momentum``); else empty.
    joined_terms: list = dataclasses.field(default_factory=list)
    #: ops of the forward and backward passes that read the variable's value before the update.
    readers: list = dataclasses.field(default_factory=list)


def _grad_ops(grad) -> list[tf.Operation]:
    if isinstance(grad, tf.IndexedSlices):
        return [grad.values.op, grad.indices.op]
    return [grad.op]


def gradient_producers(grad, floor: int) -> list[tf.Operation]:
    """The ops newer than ``floor`` that allocate ``grad``: followed back through identities
    and partial sums to the ops computing the values (a weight gradient's MatMul)."""
    newer = _newer_than(floor)

    def passes_on(op: tf.Operation) -> bool:
        return (op.type in op_types.GRADIENT_PASS_THROUGH_OP_TYPES
                and any(newer(t.op) for t in op.inputs))

    followed = tf_graph.walk(_grad_ops(grad),
                             lambda op: tf_graph.input_ops(op) if passes_on(op) else (),
                             include=newer)
    return sorted((op for op in followed if not passes_on(op)), key=tf_graph.creation_index)


def _consumers_by_position(op: tf.Operation) -> list[tf.Operation]:
    """The ops reading ``op``'s outputs, an ``IdentityN`` among them followed through the
    output at the position it reads them (tf_keras' sum over one replica passes every
    gradient through one: each update reads its own gradient's position, not the others')."""
    found, seen = [], set()
    pending = list(op.outputs)
    while pending:
        tensor = pending.pop()
        for consumer in tensor.consumers():
            if consumer.type == "IdentityN":
                pending.extend(out for given, out in zip(consumer.inputs, consumer.outputs)
                               if given is tensor)
            elif consumer not in seen:
                seen.add(consumer)
                found.append(consumer)
    return found


def update_ops(grad, handle: tf.Tensor, floor: int) -> tuple[list, list]:
    """The ops newer than ``floor`` (made by ``apply_gradients``) that update the variable.

    Returns ``(fed, all_ops)``: ``fed`` are the ops that read ``grad`` (directly or through
    other such ops) or take the variable's ``handle``, and what they feed; ``all_ops`` adds the
    newer ops those depend on: learning-rate casts, slot reads, and terms that do not need the
    gradient, such as ``momentum * m`` (which dataflow would compute at the start of the step
    and hold until the gradient arrives).
    """
    newer = _newer_than(floor)
    seeds = [c for op in _grad_ops(grad) for c in _consumers_by_position(op)]
    fed = set(tf_graph.walk(seeds + list(handle.consumers()), _consumers_by_position,
                            include=newer))
    needed = tf_graph.walk([dep for op in fed for dep in tf_graph.dependency_ops(op)],
                           tf_graph.dependency_ops,
                           include=lambda op: op not in fed and newer(op))
    return (sorted(fed, key=tf_graph.creation_index),
            sorted(fed.union(needed), key=tf_graph.creation_index))


def value_readers(handle: tf.Tensor, floor: int) -> list[tf.Operation]:
    """Ops holding a value of the variable read at or before ``floor`` (the forward reads):
    consumers of those reads, and of views of them (identities, identity boundaries,
    reshapes)."""
    reads = [op for op in handle.consumers()
             if op.type in op_types.VARIABLE_READ_OP_TYPES
             and tf_graph.creation_index(op) <= floor]
    readers = tf_graph.walk(
        [c for read in reads for c in tf_graph.consumer_ops(read)],
        lambda op: (tf_graph.consumer_ops(op) if op.type in op_types.VALUE_VIEW_OP_TYPES
                    else ()))
    return sorted(readers, key=tf_graph.creation_index)


def producers_after_sibling_reads(grad, handle: tf.Tensor, floor: int) -> int:
    """Make the ops computing ``grad`` (the gradient of the variable behind ``handle``; its
    producers, :func:`gradient_producers`) wait for their *siblings* that read the variable's
    value: ops newer than ``floor`` that hold the value read at or before it and read the same
    incoming gradient as a producer (``g @ W^T`` beside ``h^T @ g``). Once the gradient exists,
    nothing of the step holds the weight's buffer any more, so an update that consumes it does
    not copy the weight (copy-on-write; design note "writes after reads"). Returns the number
    of edges added.

    Only siblings made before their producer (tf.gradients makes ``g @ W^T`` before
    ``h^T @ g``, a convolution's input gradient before its filter gradient): every edge of the
    graph then still runs from an older op to a newer one, so none closes a cycle (a producer
    that also feeds the backward pass, where a weight's gradient is the incoming gradient
    itself, is older than what it feeds)."""
    readers = [r for r in value_readers(handle, floor)
               if tf_graph.creation_index(r) > floor
               and r.type not in op_types.VALUE_VIEW_OP_TYPES]  # a view's readers hold it
    added = 0
    for producer in gradient_producers(grad, floor):
        if (producer.type in op_types.WHILE_OP_TYPES | op_types.COND_OP_TYPES
                or tf_graph.is_function_call(producer)):
            # A loop's, cond's or call's gradient op: a later derivative rewrites it to output
            # more (TensorFlow adds inputs), after which a control input is refused.
            continue
        inputs = {t.ref() for t in producer.inputs}
        made = tf_graph.creation_index(producer)
        siblings = [r for r in readers if tf_graph.creation_index(r) < made
                    and any(t.ref() in inputs for t in r.inputs)]
        if siblings:
            _add_control_inputs(producer, siblings)
            added += len(siblings)
    return added


def mark_early_roots(updates: Sequence[VariableUpdate]) -> None:
    """Fill ``early_roots``: per update, the first ops that need neither the gradient nor
    anything another update shares (``momentum * m`` reads a slot and a constant); and
    ``joined_terms`` where the update reads its gradient through an ``IdentityN`` over every
    gradient (tf_keras' sum over one replica). There a term computed as soon as its own
    gradient exists is held until the last gradient is, and one computed once the sum is
    done is computed for every variable at once: the roots wait for their own variable's
    gradient side where their terms join it, one update after another."""
    owners: dict = {}
    for update in updates:
        for op in update.update_ops:
            owners[op] = owners.get(op, 0) + 1
    for update in updates:
        fed = set(update.fed_ops)
        # ``op.inputs`` leaves out sources (constants, placeholders): nothing to wait for there.
        candidates = {op for op in update.update_ops
                      if owners[op] == 1 and op not in fed and op.inputs}
        update.early_roots = sorted(
            (op for op in candidates if not any(t.op in candidates for t in op.inputs)),
            key=tf_graph.creation_index)
        grad_ops = _grad_ops(update.grad)
        if not any(c.type == "IdentityN" for op in grad_ops for t in op.outputs
                   for c in t.consumers()):
            continue  # the roots wait for the ops producing the gradient
        # Computed from the gradient: ``fed`` also holds what the variable's handle feeds
        # (AdamW's decay ``w * wd * lr``), which needs no gradient.
        from_gradient = set(tf_graph.walk(
            [c for op in grad_ops for c in _consumers_by_position(op)], _consumers_by_position,
            include=lambda op: op in fed))
        gradient_free = set(update.update_ops) - fed
        joins = [op for op in from_gradient if any(t.op in gradient_free for t in op.inputs)]
        update.joined_terms = sorted({t.op for op in joins for t in op.inputs
                                      if t.op in from_gradient}, key=tf_graph.creation_index)


def _sinks(ops: Sequence[tf.Operation]) -> list[tf.Operation]:
    """The ops of ``ops`` that no other op of ``ops`` consumes (by data): waiting for them
    waits for all of ``ops`` that they depend on."""
    members = set(ops)
    return [op for op in ops
            if not any(c in members for t in op.outputs for c in t.consumers())]


class _Dependencies:
    """Who waits for whom among the ops newer than ``floor`` (made by this ``minimize`` call):
    data and control edges as the graph has them now, plus the edges a ``tf.function``'s
    automatic control dependencies will add when its trace ends
    (``tf_graph.automatic_control_edges``), which the graph does not show yet.

    Ops at or below ``floor`` existed before the ``minimize`` call; none of them was given new
    inputs, so they cannot depend on newer ops and the walks stop there.
    """

    def __init__(self, graph: tf.Graph, floor: int):
        self._newer = _newer_than(floor)
        self._before: dict = {}  # op -> ops it will wait for
        self._after: dict = {}   # op -> ops that will wait for it
        edges = tf_graph.automatic_control_edges(
            op for op in graph.get_operations() if self._newer(op))
        #: False where those edges cannot be predicted (TF1 control flow in a function).
        self.known = edges is not None
        for before, after in edges or ():
            self._before.setdefault(after, []).append(before)
            self._after.setdefault(before, []).append(after)

    def ancestors(self, ops: Iterable[tf.Operation]) -> set:
        """The newer ops that ``ops`` depend on, ``ops`` included."""
        return set(tf_graph.walk(
            ops, lambda op: tf_graph.dependency_ops(op) + self._before.get(op, []),
            include=self._newer))

    def descendants(self, ops: Iterable[tf.Operation]) -> set:
        """The newer ops that depend on ``ops``, ``ops`` included: one walk downstream answers
        "does this op depend on one of ``ops``" for many ops at once, where :meth:`ancestors`
        walks upstream from each (seconds on Keras 3 ResNet50)."""
        return set(tf_graph.walk(
            ops, lambda op: (tf_graph.consumer_ops(op)
                             + list(op._control_outputs)  # pylint: disable=protected-access
                             + self._after.get(op, [])),
            include=self._newer))


def _add_control_inputs(op: tf.Operation, deps: Sequence[tf.Operation]) -> None:
    existing = set(op.control_inputs)
    new = [d for d in deps if d not in existing and d is not op]
    if new:
        op._add_control_inputs(new)  # pylint: disable=protected-access


def order_updates(updates: Sequence[VariableUpdate], grad_floor: int,
                  release_order: bool = True) -> dict:
    """Add the control inputs that make each update run as soon as its gradient is complete
    and (``release_order``) before the next gradient is allocated; returns counts of edges
    added and skipped.

    ``updates`` must be in the order their gradients complete during backprop. Three kinds of
    edges, all into ops newer than ``grad_floor`` (made by this ``minimize`` call):

    1. *read before write*: the ops writing a variable wait for every op of the step that holds
       the value read in the forward pass (the MatMul that backpropagates through the weight,
       recomputed copies). TensorFlow would give the right values anyway, by copy-on-write:
       an update of a buffer that a read still references first copies the whole weight.
       Waiting avoids that copy (one weight of memory and a memcpy).
    2. *wait for the gradient*: update ops that need no gradient (``momentum * m``, slot and
       step-count reads) wait for the ops computing it; dataflow would run them at the start
       of the step and hold one weight-sized result per variable until its gradient arrives.
    3. *release before allocate* (only with ``release_order``): the ops allocating the next
       gradient wait for the update that consumes the previous one, so one weight gradient is
       alive at a time. Dataflow alone does not do this: the backward pass runs ahead of the
       updates and several gradients coexist (measured in docs/minimize.md).

    An edge that would close a cycle (its source depends on the op that would wait, e.g. a
    weight used by two layers, gamma and beta from one batch-norm gradient op, or gradients
    clipped by their global norm), counting the edges tf.function will add when its trace
    ends (``tf_graph.automatic_control_edges``), is skipped and counted; values stay right,
    the step only saves less. Release edges are added before waits for the gradient.
    """
    stats = {"read_before_write": 0, "release_before_allocate": 0, "wait_for_gradient": 0,
             "skipped_cycles": 0}
    if not updates:
        return stats
    dependencies = _Dependencies(updates[0].handle.graph, grad_floor)
    if not dependencies.known:
        # Any edge might close a cycle with edges tf.function adds later: leave the updates
        # to dataflow (values are the same; the step only saves less).
        _LOG.debug("memsave_grads: TF1 control flow in the traced step: the updates are "
                   "left unordered")
        return stats
    for update in updates:
        # The ops taking the handle other than reads: the assignments, fused apply kernels,
        # or a function call that does the update.
        writers = [op for op in update.update_ops
                   if any(t is update.handle for t in op.inputs)
                   and op.type not in op_types.VARIABLE_READ_OP_TYPES]
        writer_set = set(writers)
        # Edges into the writers do not change what depends on them, so one walk serves all
        # of this variable's readers.
        after_writers = dependencies.descendants(writers)
        for reader in update.readers:
            if reader in writer_set:
                continue
            if reader in after_writers:
                stats["skipped_cycles"] += 1
                continue
            for writer in writers:
                _add_control_inputs(writer, [reader])
            stats["read_before_write"] += 1
    handles = {id(update.handle) for update in updates}
    for previous, current in zip(updates, updates[1:]) if release_order else ():
        # Not the ops that take another variable's handle (use_ema's overwrite of every weight
        # with its average, after the last update, in tf_keras and Keras 3): the automatic
        # control dependencies run them after every variable's update, so the next gradient
        # would wait for all of them.
        sinks = _sinks([op for op in previous.update_ops
                        if not any(id(t) in handles and t is not previous.handle
                                   for t in op.inputs)])
        if not sinks or not current.producers:
            continue
        upstream = dependencies.ancestors(sinks)
        for producer in current.producers:
            if producer in upstream:
                stats["skipped_cycles"] += 1
                _LOG.debug("memsave_grads: %s cannot wait for the update of %s (it feeds "
                           "that update); left unordered", producer.name, previous.name)
                continue
            _add_control_inputs(producer, sinks)
            stats["release_before_allocate"] += 1
    # After the release edges: where the two kinds conflict, it is through optimizer state
    # that every update shares, which tf.function's automatic control dependencies chain in
    # the order apply_gradients made the updates, the reverse of the release order (tf_keras'
    # Nadam and its u_product). The terms that would wait there are scalars; a release edge
    # is a weight gradient.
    for update in updates:
        if not update.producers or not update.early_roots:
            continue
        producers = set(update.producers)
        for root in update.early_roots:
            # Walked from the root, not back from the producers: a root's descendants are a
            # few update ops, the producers' ancestors the backward pass.
            downstream = dependencies.descendants([root])
            joined = [op for op in update.joined_terms if op not in downstream]
            if joined:
                _add_control_inputs(root, joined)
            elif producers & downstream:
                stats["skipped_cycles"] += 1
                continue
            else:
                _add_control_inputs(root, update.producers)
            stats["wait_for_gradient"] += 1
    return stats


def order_updates_early(loss, var_list: Sequence, handles: Sequence, grads: Sequence,
                        grad_floor: int, apply_floor: int, optimizer_name: str,
                        caller: str, release_order: bool = True,
                        all_applied: bool = True) -> None:
    """Add the early-release edges to one training step (design note "early release"):
    ``grads`` of ``loss`` (a tensor, or the list of a call's targets) were built after op
    ``grad_floor``, the optimizer's update ops after
    ``apply_floor``, in the current graph. Shared by ``memsave_grads.minimize`` and Keras'
    ``wrap_model``: with ``release_gradients_early=True`` all of them, otherwise
    (``release_order=False``) only the edges that keep each update's gradient-free terms and
    writes from running early (:func:`order_updates`). ``all_applied``: every gradient is
    expected to be applied (a step of our own); a gradient without update is then warned
    about, where a model's own ``train_step`` may well leave one out."""
    step_ops = _step_ancestors(loss)
    updates = []
    for v, h, g in zip(var_list, handles, grads):
        if g is None:
            continue
        fed, every = update_ops(g, h, apply_floor)
        updates.append(VariableUpdate(
            name=v.name, handle=h, grad=g,
            producers=gradient_producers(g, grad_floor),
            fed_ops=fed, update_ops=every,
            readers=[r for r in value_readers(h, apply_floor)
                     if tf_graph.creation_index(r) > grad_floor or r in step_ops]))
    unordered = [u.name for u in updates if not u.fed_ops]
    if unordered:
        _LOG.log(logging.WARNING if all_applied else logging.DEBUG,
                 "%s: apply_gradients of %s built no op reading the gradient or the "
                 "variable of %s; those updates are left to dataflow.", caller,
                 optimizer_name, unordered[:3])
        updates = [u for u in updates if u.fed_ops]
    # Why control dependencies at all: dataflow alone already runs an update as soon as its
    # gradient exists, but nothing stops the backward pass from running ahead of the updates,
    # so several weight gradients are alive at once. Measured on a 6 x 2048^2 MLP
    # (docs/minimize.md): optimizer.minimize peaks at 2-3 gradients (GATE_OP) or all 6
    # (GATE_GRAPH), gradients + apply_gradients at 3-4; with these edges, at 1. And a write
    # racing a backward op that still reads the forward value of the weight makes TensorFlow
    # copy the whole weight (copy-on-write), one more weight of memory.
    # Backprop completes the gradients in this order (the op computing the last piece of a
    # gradient is created later for layers nearer the input).
    updates.sort(key=lambda u: max(map(tf_graph.creation_index, u.producers), default=0))
    mark_early_roots(updates)
    stats = order_updates(updates, grad_floor, release_order)
    if ordering.xla_in_effect(tf.compat.v1.get_default_graph()):
        # The release order is control edges only: a gradient cannot be made to wait for an
        # earlier variable's *update* through dataflow without reading the updated variable,
        # which would change the values.
        ordering.warn_once(
            f"{caller} under XLA",
            f"{caller}: under XLA (jit_compile) the early-release ordering is control "
            "dependencies, which XLA drops: updates stay exact, but when each gradient is "
            "released is up to XLA's scheduler. Recomputation savings are kept (design note "
            "\"ordering under XLA\").")
    _LOG.debug("%s: %d variables; control edges %s", caller, len(updates), stats)
    if stats["skipped_cycles"]:
        _LOG.info("%s: %d ordering edges would have closed a cycle and were left out (a "
                  "weight used twice, two gradients from one op such as batch norm's gamma "
                  "and beta, or gradients combined across variables such as a global-norm "
                  "clip); those updates run when dataflow allows.", caller,
                  stats["skipped_cycles"])


def _step_ancestors(loss) -> set:
    """Every op the forward pass of ``loss`` (a tensor or a list of them) depends on (data or
    control)."""
    return set(tf_graph.walk([t.op for t in tf.nest.flatten(loss)], tf_graph.dependency_ops))
