"""The one module that reads TensorFlow graph internals for analysis.

It walks the forward graph, classifies operations (replayable or not), sizes tensors and turns
the region between ``xs`` and ``ys`` into the TensorFlow-free :class:`ForwardGraph`. Anything
private we depend on is named here (and in ``_rewrite.py``), nowhere else.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import gradients_impl
from tensorflow.python.ops import resource_variable_ops

from memsave_grads import graph as graph_lib
from memsave_grads import policies

#: The real ``tf.compat.v1.gradients``, captured when this module is imported (a reference, not a
#: patch): every gradient we build goes through it, so a patched ``tf.gradients`` never recurses.
ORIGINAL_GRADIENTS = gradients_impl.gradients
#: The real TF2 ``tf.gradients`` (``gradients_v2``: the same, without colocate_gradients_with_ops).
ORIGINAL_GRADIENTS_V2 = gradients_impl.gradients_v2


def is_resource_variable(value) -> bool:
    return resource_variable_ops.is_resource_variable(value)


def is_eager_tensor(value) -> bool:
    """An eager tensor: a value, with no graph for us to rewrite."""
    return isinstance(value, tf_ops.EagerTensor)


def carries_gradients(t: tf.Tensor) -> bool:
    """Whether gradients can flow through ``t``: float and complex values, and the resource
    handles and variants (TensorLists) that stand for them."""
    dtype = t.dtype.base_dtype
    return dtype.is_floating or dtype.is_complex or dtype in (tf.resource, tf.variant)


def forward_region(ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor],
                   stop_ops: Iterable[tf.Operation] = ()) -> list[tf.Operation]:
    """Operations on some data path from an ``x`` to a ``y``, in topological (creation) order.

    Ops whose gradient the caller stops (``stop_gradients``) are not crossed going forward: what
    lies beyond them is constant with respect to ``xs``.
    """
    stop_ops = set(stop_ops)
    downstream: set[tf.Operation] = set()
    frontier = [c for x in xs for c in x.consumers()]
    while frontier:
        op = frontier.pop()
        if op in downstream:
            continue
        downstream.add(op)
        if op in stop_ops:
            continue
        for out in op.outputs:
            frontier.extend(c for c in out.consumers() if c not in downstream)
    upstream: set[tf.Operation] = set()
    frontier = [y.op for y in ys]
    while frontier:
        op = frontier.pop()
        if op in upstream or op not in downstream:
            continue
        upstream.add(op)
        frontier.extend(t.op for t in op.inputs if t.op not in upstream)
    region = [op for op in upstream if op not in stop_ops]
    region.sort(key=lambda op: op._id)  # creation order is a topological order of data edges
    return region


def uses_v1_control_flow(op: tf.Operation) -> bool:
    return (op.type in policies.V1_CONTROL_FLOW_OP_TYPES
            or getattr(op, "_control_flow_context", None) is not None)


def is_replayable(op: tf.Operation) -> bool:
    """Whether running a copy of ``op`` again is guaranteed to give the same outputs.

    Stateful ops (random draws, variable reads, iterators, stateful If/While) are not: their
    outputs are kept instead (design note "never replay state" in docs/design.md).
    """
    if uses_v1_control_flow(op):
        return False
    try:
        return not op.op_def.is_stateful
    except (AttributeError, ValueError):
        return False


def tensor_bytes(t: tf.Tensor) -> int:
    """Static byte size of ``t``; unknown dimensions count as 1, unknown rank as one element.

    Counting every unknown (batch) dimension as 1 keeps sizes consistent *relative* to each
    other, which is all the planners need.
    """
    try:
        itemsize = t.dtype.size
    except (AttributeError, TypeError):
        itemsize = 0
    if t.shape.rank is None:
        return itemsize
    elements = 1
    for dim in t.shape.as_list():
        elements *= dim if dim is not None else 1
    return elements * itemsize


def op_bytes(op: tf.Operation) -> int:
    return sum(tensor_bytes(t) for t in op.outputs)


def _elements(shape) -> int:
    """Elements of a static shape; unknown dimensions count as 1 (as in :func:`tensor_bytes`)."""
    if shape.rank is None:
        return 1
    count = 1
    for dim in shape.as_list():
        count *= dim if dim is not None else 1
    return count


def _dim(shape, axis: int) -> int:
    if shape.rank is None or not -shape.rank <= axis < shape.rank:
        return 1
    return shape[axis] if shape[axis] is not None else 1


def _einsum_flops(op: tf.Operation) -> float:
    """2 x (elements of the output) x (product of the contracted dimensions)."""
    equation = op.get_attr("equation").decode().replace(" ", "")
    inputs_spec, _, output_spec = equation.partition("->")
    sizes: dict[str, int] = {}
    for spec, t in zip(inputs_spec.split(","), op.inputs):
        letters = spec.replace("...", "")
        if t.shape.rank is None:
            continue
        offset = t.shape.rank - len(letters)  # dims covered by the ellipsis come first
        if "..." not in spec:
            offset = 0
        for i, letter in enumerate(letters):
            sizes[letter] = max(sizes.get(letter, 1), _dim(t.shape, offset + i))
    contracted = 1
    for letter, size in sizes.items():
        if letter not in output_spec:
            contracted *= size
    return 2.0 * _elements(op.outputs[0].shape) * contracted


def op_flops(op: tf.Operation) -> float:
    """Floating-point operations to run ``op`` once, from static shapes.

    Exact for matmul, batch matmul, convolutions and einsum (multiply-adds count 2); every other
    op counts one per element of its largest input or output (elementwise ops, reductions,
    copies). Aliases of resident memory (variable reads, constants) cost nothing.
    """
    if op.type in policies.ALIAS_OP_TYPES or not op.outputs:
        return 0.0
    out = op.outputs[0].shape
    try:
        if op.type in ("MatMul", "_FusedMatMul", "SparseMatMul"):
            transpose = op.get_attr("transpose_a")
            return 2.0 * _elements(out) * _dim(op.inputs[0].shape, 0 if transpose else 1)
        if op.type.startswith("BatchMatMul"):
            adjoint = op.get_attr("adj_x")
            return 2.0 * _elements(out) * _dim(op.inputs[0].shape, -2 if adjoint else -1)
        if op.type in ("Conv1D", "Conv2D", "Conv3D", "_FusedConv2D", "FusedConv2DBiasActivation"):
            kernel = op.inputs[1].shape  # [*spatial, in/groups, out]
            return 2.0 * _elements(out) * _elements(kernel) / max(_dim(kernel, -1), 1)
        if op.type == "DepthwiseConv2dNative":
            kernel = op.inputs[1].shape  # [h, w, in, multiplier]
            return 2.0 * _elements(out) * _dim(kernel, 0) * _dim(kernel, 1)
        if op.type in ("Conv2DBackpropInput", "Conv3DBackpropInputV2"):  # transposed conv
            kernel, grad = op.inputs[1].shape, op.inputs[2].shape  # kernel [*s, out, in]
            return 2.0 * _elements(grad) * _elements(kernel) / max(_dim(kernel, -1), 1)
        if op.type in ("Einsum", "XlaEinsum"):
            return _einsum_flops(op)
    except (ValueError, TypeError):  # an attr or shape we cannot read: fall back to elements
        pass
    return float(max([_elements(t.shape) for t in list(op.inputs) + list(op.outputs)
                      if t.dtype != tf.resource] or [1]))


def to_forward_graph(region: Sequence[tf.Operation], xs: Sequence[tf.Tensor],
                     ys: Sequence[tf.Tensor]) -> graph_lib.ForwardGraph:
    """The TF-free model of ``region`` (node ``i`` is ``region[i]``).

    Variable reads count 0 bytes: their output aliases the variable's buffer, which is resident
    anyway.
    """
    index = {op: i for i, op in enumerate(region)}
    x_refs = {x.ref() for x in xs}
    y_ops = {y.op for y in ys}
    inputs, reads_source, params = [], [], []
    for op in region:
        preds = sorted({index[t.op] for t in op.inputs if t.op in index})
        inputs.append(tuple(preds))
        reads_source.append(any(t.ref() in x_refs for t in op.inputs))
        params.append(sum(tensor_bytes(t) for t in op.inputs
                          if t.dtype != tf.resource and (t.ref() in x_refs or (
                              t.op in index and t.op.type in policies.ALIAS_OP_TYPES))))
    # Which inputs each gradient reads: an input needed only for a constant's gradient is not
    # read (``0.5 * x``), since that gradient is pruned from the step.
    reads_inputs = [policies.gradient_reads_inputs(op.type) for op in region]
    unread = []
    for op in region:
        differentiable = [carries_gradients(t) and (t.op in index or t.ref() in x_refs)
                          for t in op.inputs]
        read = {}
        for i, t in enumerate(op.inputs):
            if t.op in index:
                read[index[t.op]] = read.get(index[t.op], False) or \
                    policies.gradient_reads_input(op.type, i, differentiable)
        unread.append(frozenset(p for p, r in read.items() if not r))
    # A view (reshape, identity) costs no bytes, but "reads" its input whenever a consumer's
    # gradient reads the view: that keeps the shared buffer alive in the memory model.
    for i in reversed(range(len(region))):
        if region[i].type in policies.VIEW_OP_TYPES:
            reads_inputs[i] = any(reads_inputs[index[c]] and i not in unread[index[c]]
                                  for t in region[i].outputs for c in t.consumers() if c in index)
    return graph_lib.ForwardGraph(
        inputs=tuple(inputs),
        size_bytes=tuple(0 if op.type in policies.ALIAS_OP_TYPES else op_bytes(op)
                         for op in region),
        reads_source=tuple(reads_source),
        feeds_sink=tuple(op in y_ops for op in region),
        names=tuple(op.name for op in region),
        expensive=tuple(policies.is_expensive_op_type(op.type) for op in region),
        grad_reads_inputs=tuple(reads_inputs),
        grad_reads_output=tuple(policies.gradient_reads_output(op.type) for op in region),
        param_bytes=tuple(params),
        views=tuple(op.type in policies.VIEW_OP_TYPES for op in region),
        flops=tuple(op_flops(op) for op in region),
        unread_inputs=tuple(frozenset(u) if reads else frozenset()
                            for u, reads in zip(unread, reads_inputs)),
        forwards=tuple(policies.forwards_input_buffer(op.type) for op in region),
    )
