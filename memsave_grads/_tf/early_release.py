"""Order variable updates into the backward pass so that each gradient dies early.

Used by :func:`memsave_grads.optimize.minimize` (design note "early release" in
docs/design.md). Like ``rewrite.py`` it adds control inputs to operations, which is private
TensorFlow API (``Operation._add_control_inputs``, ``Operation._id``); it only ever adds them to
operations created by the current ``minimize`` call, never to the user's forward graph.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import tensorflow as tf
from absl import logging

#: Ops whose output is (a sum of) its inputs' values without new information: a gradient that
#: comes out of one of them was allocated by the ops feeding it. Followed backward from a
#: gradient to find the ops that allocate it (``tf.gradients`` wraps gradients in identities;
#: partials are added with AddN).
_PASS_THROUGH_OP_TYPES = frozenset({"Identity", "IdentityN", "AddN", "StopGradient"})

#: Ops whose output shares its input's buffer: a consumer of one holds the variable's buffer
#: as much as a direct reader of the variable does.
_VIEW_OP_TYPES = frozenset({"Identity", "IdentityN", "StopGradient", "PreventGradient",
                            "Reshape", "ExpandDims", "Squeeze"})

_READ_OP_TYPES = frozenset({"ReadVariableOp"})


def op_id(op: tf.Operation) -> int:
    """Creation index of ``op`` in its graph (increasing: inputs are created first)."""
    return op._id  # pylint: disable=protected-access


def last_op_id(graph: tf.Graph) -> int:
    """The creation index of the newest op in ``graph`` (ops created later have larger ones)."""
    return max((op_id(op) for op in graph.get_operations()), default=0)


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
    #: ops of the forward and backward passes that read the variable's value before the update.
    readers: list = dataclasses.field(default_factory=list)


def _grad_ops(grad) -> list[tf.Operation]:
    if isinstance(grad, tf.IndexedSlices):
        return [grad.values.op, grad.indices.op]
    return [grad.op]


def gradient_producers(grad, floor: int) -> list[tf.Operation]:
    """The ops newer than ``floor`` that allocate ``grad``: followed back through identities
    and partial sums to the ops computing the values (a weight gradient's MatMul)."""
    seen, leaves, stack = set(), [], [op for op in _grad_ops(grad) if op_id(op) > floor]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        feeding = [t.op for t in op.inputs if op_id(t.op) > floor]
        if op.type in _PASS_THROUGH_OP_TYPES and feeding:
            stack.extend(feeding)
        else:
            leaves.append(op)
    return sorted(leaves, key=op_id)


def update_ops(grad, handle: tf.Tensor, floor: int) -> tuple[list, list]:
    """The ops newer than ``floor`` (made by ``apply_gradients``) that update the variable.

    Returns ``(fed, all_ops)``: ``fed`` are the ops that read ``grad`` (directly or through
    other such ops) or take the variable's ``handle``, and what they feed; ``all_ops`` adds the
    newer ops those depend on: learning-rate casts, slot reads, and terms that do not need the
    gradient, such as ``momentum * m`` (which dataflow would compute at the start of the step
    and hold until the gradient arrives).
    """
    stack = [c for op in _grad_ops(grad) for t in op.outputs for c in t.consumers()]
    stack += list(handle.consumers())
    fed = set()
    while stack:
        op = stack.pop()
        if op in fed or op_id(op) <= floor:
            continue
        fed.add(op)
        stack.extend(c for t in op.outputs for c in t.consumers())
    every = set(fed)
    stack = [t.op for op in fed for t in op.inputs] + [c for op in fed for c in op.control_inputs]
    while stack:
        op = stack.pop()
        if op in every or op_id(op) <= floor:
            continue
        every.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return sorted(fed, key=op_id), sorted(every, key=op_id)


def value_readers(handle: tf.Tensor, floor: int) -> list[tf.Operation]:
    """Ops holding a value of the variable read at or before ``floor`` (the forward reads):
    consumers of those reads, and of views of them (identities, identity boundaries,
    reshapes)."""
    readers, seen = [], set()
    stack = [t for op in handle.consumers()
             if op.type in _READ_OP_TYPES and op_id(op) <= floor for t in op.outputs]
    while stack:
        t = stack.pop()
        for op in t.consumers():
            if op in seen:
                continue
            seen.add(op)
            readers.append(op)
            if op.type in _VIEW_OP_TYPES:
                stack.extend(op.outputs)
    return sorted(readers, key=op_id)


def mark_early_roots(updates: Sequence[VariableUpdate]) -> None:
    """Fill ``early_roots``: per update, the first ops that need neither the gradient nor
    anything another update shares (``momentum * m`` reads a slot and a constant)."""
    owners: dict = {}
    for update in updates:
        for op in update.update_ops:
            owners[op] = owners.get(op, 0) + 1
    for update in updates:
        fed = set(update.fed_ops)
        candidates = {op for op in update.update_ops
                      if owners[op] == 1 and op not in fed and op.inputs
                      and op.type not in ("Placeholder", "Const")}
        update.early_roots = sorted(
            (op for op in candidates if not any(t.op in candidates for t in op.inputs)),
            key=op_id)


def _sinks(ops: Sequence[tf.Operation]) -> list[tf.Operation]:
    """The ops of ``ops`` that no other op of ``ops`` consumes (by data): waiting for them
    waits for all of ``ops`` that they depend on."""
    members = set(ops)
    return [op for op in ops
            if not any(c in members for t in op.outputs for c in t.consumers())]


def _ancestors(ops: Iterable[tf.Operation], floor: int) -> set:
    """Ops newer than ``floor`` that ``ops`` depend on (data or control), ``ops`` included.

    Ops at or below ``floor`` existed before the ``minimize`` call; none of them was given new
    inputs, so they cannot depend on newer ops and the walk stops there.
    """
    seen, stack = set(), [op for op in ops if op_id(op) > floor]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs if op_id(t.op) > floor and t.op not in seen)
        stack.extend(c for c in op.control_inputs if op_id(c) > floor and c not in seen)
    return seen


def _add_control_inputs(op: tf.Operation, deps: Sequence[tf.Operation]) -> None:
    existing = set(op.control_inputs)
    new = [d for d in deps if d not in existing and d is not op]
    if new:
        op._add_control_inputs(new)  # pylint: disable=protected-access


def order_updates(updates: Sequence[VariableUpdate], grad_floor: int) -> dict:
    """Add the control inputs that make each update run as soon as its gradient is complete
    and before the next gradient is allocated; returns counts of edges added and skipped.

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
    3. *release before allocate*: the ops allocating the next gradient wait for the update
       that consumes the previous one, so one weight gradient is alive at a time. Dataflow
       alone does not do this: the backward pass runs ahead of the updates and several
       gradients coexist (measured in docs/minimize.md).

    An edge that would close a cycle (its source depends on the op that would wait, e.g. a
    weight used by two layers, gamma and beta from one batch-norm gradient op, or gradients
    clipped by their global norm) is skipped and counted; values stay right, the step only
    saves less.
    """
    stats = {"read_before_write": 0, "release_before_allocate": 0, "wait_for_gradient": 0,
             "skipped_cycles": 0}
    for update in updates:
        # The ops taking the handle other than reads: the assignments, fused apply kernels,
        # or a function call that does the update.
        writers = [op for op in update.update_ops
                   if any(t is update.handle for t in op.inputs)
                   and op.type not in _READ_OP_TYPES]
        writer_set = set(writers)
        for reader in update.readers:
            if reader in writer_set:
                continue
            if op_id(reader) > grad_floor and writer_set & _ancestors([reader], grad_floor):
                stats["skipped_cycles"] += 1
                continue
            for writer in writers:
                _add_control_inputs(writer, [reader])
            stats["read_before_write"] += 1
    for update in updates:
        if not update.producers or not update.early_roots:
            continue
        upstream = _ancestors(update.producers, grad_floor)
        for root in update.early_roots:
            if root in upstream:
                stats["skipped_cycles"] += 1
                continue
            _add_control_inputs(root, update.producers)
            stats["wait_for_gradient"] += 1
    for previous, current in zip(updates, updates[1:]):
        sinks = _sinks(previous.update_ops)
        if not sinks or not current.producers:
            continue
        upstream = _ancestors(sinks, grad_floor)
        for producer in current.producers:
            if producer in upstream:
                stats["skipped_cycles"] += 1
                logging.vlog(1, "memsave_grads: %s cannot wait for the update of %s (it feeds "
                             "that update); left unordered", producer.name, previous.name)
                continue
            _add_control_inputs(producer, sinks)
            stats["release_before_allocate"] += 1
    return stats
