"""The graph model as XLA keeps it: elementwise ops fused into their consumers.

Under ``jit_compile`` XLA fuses elementwise ops (adds, multiplies, activations, the
arithmetic of a batch or layer norm) into the kernels of the ops that read them, duplicating
them into each reader. Such an op's output is no buffer of its own; where the backward pass
needs it, XLA recomputes it inside the gradient's fusion from the op's inputs, and it is those
inputs that stay alive (measured on the conv ResNet: a kept ``relu(bn(conv) + h)`` was held
as the convolutions' outputs; docs/design.md, note "memory under XLA").

:func:`fused_model` turns the executor's model into that one, once, where XLA is in effect;
the memory model, the fast replay and the planners then run unchanged on it:

* a fused node allocates nothing unless it is kept (it is counted as a view:
  ``ForwardGraph.views``), so a segment's working set is its unfused outputs (matmuls,
  convolutions, reductions) and kept tensors;
* where a later step needs a fused node's value (its own gradient reads its output, or a
  reader's gradient reads it), the step needs its inputs instead, all of them, since it
  recomputes the node from them; through a chain of fused nodes that reaches the unfused
  outputs they start from.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from memsave_grads.core import graph as graph_lib


def fused_model(graph: graph_lib.ForwardGraph, fused: Sequence[bool]) -> graph_lib.ForwardGraph:
    """``graph`` with the nodes marked ``fused`` (XLA computes them inside their consumers'
    fusions) modelled as XLA keeps them (module docstring); ``graph`` itself where none is."""
    n = graph.num_nodes
    if len(fused) != n:
        raise ValueError("fused_model: one flag per node expected")
    if not any(fused):
        return graph
    consumers = graph.consumers()
    reads_inputs = [graph.gradient_reads_inputs(v) for v in range(n)]
    reads_output = [bool(graph.grad_reads_output) and graph.grad_reads_output[v]
                    for v in range(n)]
    unread = [graph.unread_inputs[v] if graph.unread_inputs else frozenset() for v in range(n)]
    views = [graph.is_view(v) or bool(fused[v]) for v in range(n)]
    # Reverse topological order: whether a fused node is needed depends on its readers, which
    # may be fused themselves and already turned into readers of their inputs.
    for v in reversed(range(n)):
        if not fused[v] or not graph.carries_gradient(v):
            continue
        read_by = [c for c in consumers[v]
                   if reads_inputs[c] and v not in unread[c] and graph.carries_gradient(c)]
        if any(not fused[c] for c in read_by):
            # An unfused reader's gradient (a matmul's or convolution's) takes it as an operand:
            # XLA materializes it and keeps that buffer, as the executor does.
            views[v] = graph.is_view(v)
            continue
        needed = reads_output[v] or bool(read_by)
        reads_output[v] = False
        if needed:
            reads_inputs[v] = True
            unread[v] = frozenset()
    return dataclasses.replace(
        graph, grad_reads_inputs=tuple(reads_inputs), grad_reads_output=tuple(reads_output),
        unread_inputs=tuple(unread), views=tuple(views), fused=tuple(bool(f) for f in fused))
