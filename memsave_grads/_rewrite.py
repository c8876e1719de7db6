"""Copy forward operations so that they run again during the backward pass.

``tf.contrib.graph_editor`` is gone; we create each copy with ``Graph._create_op_internal``
(measured in docs/design.md to reproduce MatMul, Conv2D, FusedBatchNorm, gathers and
If/While ops exactly). This and ``_tf_graph.py`` are the only modules touching private TF API.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

#: Attributes on If/While ops that cache their FuncGraphs. A copy must not share them: the
#: gradient of cond_v2/while_v2 rewrites the forward op's function graphs in place, so a shared
#: cache would let the copy's gradient rewrite the original (docs/design.md, note "func graphs").
#: Without the cache the gradient code rebuilds fresh FuncGraphs from the function library.
_CACHED_FUNC_GRAPH_ATTRS = ("_true_graph", "_false_graph", "_cond_graph", "_body_graph",
                            "_branch_graphs")


def copy_ops(ops: Sequence[tf.Operation], scope: str,
             control_inputs: Sequence[tf.Operation]) -> dict[tf.Operation, tf.Operation]:
    """Copy ``ops`` (topologically ordered, one graph) and return ``{original: copy}``.

    A copy reads the copies of its inputs where those were copied and the original tensors
    otherwise. It keeps the original's attributes (colocation ``_class`` included), device and
    control inputs. Copies that read no other copy get ``control_inputs`` as extra control
    dependencies: without them TensorFlow schedules the recomputation during the forward pass
    and nothing is saved (docs/design.md, note "scheduling").
    """
    if not ops:
        return {}
    graph = ops[0].graph
    copies: dict[tf.Operation, tf.Operation] = {}
    with graph.name_scope(scope):
        for op in ops:
            inputs = [copies[t.op].outputs[t.value_index] if t.op in copies else t
                      for t in op.inputs]
            new = graph._create_op_internal(  # pylint: disable=protected-access
                op.type, inputs, dtypes=[t.dtype for t in op.outputs], name=op.name,
                attrs=dict(op.node_def.attr), op_def=op.op_def, compute_device=False)
            new._set_device(op.device)  # pylint: disable=protected-access
            for original, copied in zip(op.outputs, new.outputs):
                copied.set_shape(original.shape)
            extra = [copies.get(c, c) for c in op.control_inputs]
            if not any(t.op in copies for t in op.inputs):
                extra.extend(control_inputs)
            if extra:
                new._add_control_inputs(extra)  # pylint: disable=protected-access
            for attr in _CACHED_FUNC_GRAPH_ATTRS:
                if hasattr(new, attr):
                    delattr(new, attr)
            copies[op] = new
    return copies
