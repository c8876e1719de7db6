"""Copy forward operations so that they run again during the backward pass.

``tf.contrib.graph_editor`` is gone; we create each copy with ``Graph._create_op_internal``
(measured in docs/design.md to reproduce MatMul, Conv2D, FusedBatchNorm, gathers and
If/While ops exactly). Private TF API is used only under ``_tf/``.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable, Mapping, Sequence

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.client import pywrap_tf_session
from tensorflow.python.eager import execute
from tensorflow.python.framework import errors as tf_errors
from tensorflow.python.framework import func_graph as func_graph_module
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util_v2
from tensorflow.python.ops import handle_data_util
from tensorflow.python.util import tf_stack

from memsave_grads import errors
from memsave_grads._tf import graph as tf_graph
from memsave_grads._tf import ordering
from memsave_grads.core import op_types

_function_counter = itertools.count()

#: Attributes on If/While ops that cache their FuncGraphs. A copy must not share them: the
#: gradient of cond_v2/while_v2 rewrites the forward op's function graphs in place, so a shared
#: cache would let the copy's gradient rewrite the original (docs/design.md, note "func graphs").
#: Without the cache the gradient code rebuilds fresh FuncGraphs from the function library.
#: Attributes a TF1 compilation context (``tf.compat.v1.xla.experimental.compile``, a TPU
#: replicate) sets on each op made inside it, and refuses on an op it is given: "XLA compiled
#: computations cannot be nested". The context sets them on the copy again.
_COMPILATION_CONTEXT_ATTRS = frozenset({"_xla_compile_id", "_tpu_replicate"})
_CACHED_FUNC_GRAPH_ATTRS = ("_true_graph", "_false_graph", "_cond_graph", "_body_graph",
                            "_branch_graphs")


def copy_ops(ops: Sequence[tf.Operation], scope: str, control_inputs: Sequence[tf.Operation],
             replacements: Mapping | None = None,
             graph: tf.Graph | None = None,
             arrival: tf.Tensor | None = None,
             replay: Callable | None = None) -> dict[tf.Operation, tf.Operation]:
    """Copy ``ops`` (topologically ordered, one graph) and return ``{original: copy}``, plus
    ``{op: op}`` for the few helper ops made along the way (identities that delay a While
    copy's inputs, the stand-ins that wait for ``arrival``), so that the values of the mapping
    are the whole copied region.

    The copies go into ``graph`` (default: the ops' own graph). Into another graph (the
    backward body of a loop), inputs from the ops' graph are captured by that function graph,
    and colocation attributes, which name ops of the source graph, are dropped.

    A copy reads the copies of its inputs where those were copied, ``replacements[t.ref()]``
    where given (the boundaries), and the original tensors otherwise. It keeps the original's
    attributes (colocation ``_class`` included), device and control inputs. Copies that read
    no other copy get ``control_inputs`` as extra control dependencies: without them
    TensorFlow schedules the recomputation during the forward pass and nothing is saved
    (docs/design.md, note "scheduling").

    ``arrival`` (under XLA, which drops control inputs): the zero of
    ``ordering.gradient_arrival``; each copy that reads no other copy reads one of its inputs
    through ``ordering.after`` (design note "ordering under XLA").

    ``replay(op, inputs, control_inputs, graph)``: where it returns a replay (a stateful
    cond or call that ``_tf.exposure.replay_copy`` recomputes from its exposed state), that is
    the op's copy: its ``stand_in`` takes the op's place, and every op it made belongs to the
    copied region (design note "control flow and calls").
    """
    if not ops:
        return {}
    replacements = replacements or {}
    source = ops[0].graph
    graph = graph or source
    copies: dict[tf.Operation, tf.Operation] = {}
    waiting: dict = {}  # tensor ref -> its ordering.after stand-in (one per tensor)
    # Every copy is created from here: one creating stack for all (design note "planning
    # cost", "The rewrite").
    stack = tf_stack.extract_stack(stacklevel=1)
    with graph.name_scope(scope):
        for op in ops:
            inputs = [copies[t.op].outputs[t.value_index] if t.op in copies
                      else replacements.get(t.ref(), t) for t in op.inputs]
            if arrival is not None and not any(t.op in copies for t in op.inputs):
                inputs = _wait_for_arrival(op, inputs, arrival, waiting, graph)
            if arrival is not None and op.type in op_types.EINSUM_OP_TYPES:
                inputs = _reordered_operands_wait(op, inputs, copies, arrival, waiting, graph)
            extra = [copies.get(c, c) for c in op.control_inputs
                     if c in copies or c.graph is graph]
            if not any(t.op in copies for t in op.inputs):
                extra.extend(control_inputs)
            replayed = replay(op, inputs, extra, graph) if replay is not None else None
            if replayed is not None:
                copies.update((made, made) for made in replayed.made)
                copies[op] = replayed.stand_in
                continue
            if replay is not None and not tf_graph.is_replayable(op):
                # A plan never recomputes a stateful op it cannot replay; copied, it would
                # draw or read again (design note "never replay state").
                raise errors.UnsupportedGraphError(
                    f"memsave_grads: the stateful op {op.name!r} ({op.type}) would be run again "
                    "in a recomputation, which would change the gradients; this is a bug in "
                    "memsave_grads. Use tf.gradients for this graph (fallback='warn' does).")
            if extra and op.type in op_types.WHILE_OP_TYPES:
                # while_v2's gradient appends accumulator inputs to the forward While op; a
                # NodeDef whose data inputs follow control inputs is invalid in a Session. The
                # inputs wait instead, through identities (free: views of the same buffers).
                with graph.as_default(), graph.control_dependencies(extra):
                    inputs = [tf.identity(t) for t in inputs]
                copies.update((t.op, t.op) for t in inputs)  # part of the copied region
                extra = []
            attrs = {name: value for name, value in op.node_def.attr.items()
                     if name not in _COMPILATION_CONTEXT_ATTRS}
            if graph is not source:
                attrs.pop("_class", None)
            elif "_class" not in attrs:
                # A copy belongs with its original: gradients colocated with the copy
                # (colocate_gradients_with_ops) then land where tf.gradients puts them.
                attrs["_class"] = attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
                    s=[f"loc:@{op.name}".encode()]))
            new = create_op(graph, op.type, inputs, name=op.name, attrs=attrs,
                            op_def=op.op_def, device=op.device, control_inputs=extra,
                            stack=stack)
            # A replica is "based on the op that was replicated" (Graph._original_op): error
            # messages about the copy then trace back to the user's forward op.
            new._original_op = op  # pylint: disable=protected-access
            setattr(new, _REPLAYS, op)
            # A call of a tf.function made inside another graph carries its gradient on the op
            # (set from the graph's override map at creation), not in the registry by type;
            # without it TF looks for a python_grad_func the AtomicFunction lacks.
            new._gradient_function = op._gradient_function  # pylint: disable=protected-access
            for original, copied in zip(op.outputs, new.outputs):
                copied.set_shape(original.shape)
                copy_handle_data(original, copied)
            for attr in _CACHED_FUNC_GRAPH_ATTRS:
                if hasattr(new, attr):
                    delattr(new, attr)
            _give_own_functions(new, op)
            record_on_tapes(new)
            copies[op] = new
    # The waiting stand-ins belong to the copied region: a nested level copies these copies
    # again, and its copies must read copies of the stand-ins. Read as they are, a stand-in
    # would sit between the nested level's boundary and its copy, outside the nested
    # tf.gradients call's sources, and the partial of what it waits on would be lost (None
    # gradients under XLA; design note "ordering under XLA").
    copies.update((t.op, t.op) for t in waiting.values())
    return copies


def create_op(graph: tf.Graph, op_type: str, inputs: Sequence[tf.Tensor], *, name: str,
              attrs: Mapping, op_def, device: str,
              control_inputs: Sequence[tf.Operation] = (), stack=None) -> tf.Operation:
    """The op ``graph._create_op_internal(op_type, inputs, name=name, attrs=attrs,
    op_def=op_def, compute_device=False)`` makes, on ``device`` and with ``control_inputs``
    added, made through the C API directly (design note "planning cost": 0.65 -> 0.24 s for
    the 4000 ops of a 1000-block chain's copies and boundaries).

    ``_create_op_internal`` rebuilds a ``NodeDef`` proto, validates it in Python and takes
    the graph's mutation lock around steps that the C API does itself; a copy's attributes
    (serialized from its original's) and its type are already known to be valid. What the
    ordinary route adds is kept: the name made unique in the current name scope, the
    graph's ``control_dependencies`` (pruned as TensorFlow prunes them), its attribute
    scope, kernel labels and gradient overrides, colocation stack and control-flow context
    (``Graph._create_op_helper``), the default original op and the creating stack trace.
    ``tests/test_rewrite.py`` compares the two routes' ops.

    ``stack``: the creating stack trace (``tf_stack.extract_stack``), where the caller
    creates many ops from one place and extracts it once for all; default: the caller's."""
    if not _plain_creation(graph, op_type, inputs):
        new = graph._create_op_internal(  # pylint: disable=protected-access
            op_type, list(inputs), name=name, attrs=attrs, op_def=op_def, compute_device=False)
        new._set_device(device)  # pylint: disable=protected-access
        if control_inputs:
            new._add_control_inputs(control_inputs)  # pylint: disable=protected-access
        return new
    graph._check_not_finalized()  # pylint: disable=protected-access
    name = graph.unique_name(name)
    inputs = list(inputs)
    controls = graph._control_dependencies_for_inputs(  # pylint: disable=protected-access
        {t.op for t in inputs})
    controls = list(dict.fromkeys([*controls, *control_inputs]))  # once each, in order
    grouped = tf_ops._reconstruct_sequence_inputs(op_def, inputs, attrs)  # pylint: disable=protected-access
    with graph._mutation_lock():  # pylint: disable=protected-access
        with graph._c_graph.get() as c_graph:  # pylint: disable=protected-access
            description = pywrap_tf_session.TF_NewOperation(c_graph, op_type, name)
        if device:
            pywrap_tf_session.TF_SetDevice(description, device)
        for grouped_input in grouped:
            if isinstance(grouped_input, list):
                pywrap_tf_session.TF_AddInputList(
                    description, [t._as_tf_output() for t in grouped_input])  # pylint: disable=protected-access
            else:
                pywrap_tf_session.TF_AddInput(description, grouped_input._as_tf_output())  # pylint: disable=protected-access
        for control in controls:
            pywrap_tf_session.TF_AddControlInput(description, control._c_op)  # pylint: disable=protected-access
        for attr_name, value in attrs.items():
            pywrap_tf_session.TF_SetAttrValueProto(description, attr_name,
                                                   value.SerializeToString())
        try:
            c_op = pywrap_tf_session.TF_FinishOperation(description)
        except tf_errors.InvalidArgumentError as e:
            raise ValueError(e.message) from e  # as _create_op_internal raises it
        pywrap_tf_session.TF_SetOpStackTrace(
            c_op, tf_stack.extract_stack(stacklevel=2) if stack is None else stack)
        new = graph._create_op_from_tf_operation(c_op, compute_device=False)  # pylint: disable=protected-access
        new._original_op = graph._default_original_op  # pylint: disable=protected-access
        new._control_flow_post_processing(input_tensors=inputs)  # pylint: disable=protected-access
    if graph._colocation_stack:  # pylint: disable=protected-access
        # _create_op_helper moved it next to the innermost colocation op; the copy stays where
        # its original is, as ``_set_device`` after the ordinary route leaves it.
        new._set_device(device)  # pylint: disable=protected-access
    return new


def _plain_creation(graph: tf.Graph, op_type: str, inputs: Sequence[tf.Tensor]) -> bool:
    """Whether ``graph._create_op_internal`` would make the op as ``tf.Graph``'s does: not
    where a subclass adds steps (a function graph capturing an input of another graph or
    reading a variable by value, a gradient body's graphs of cond and while), nor in a TF1
    control-flow context (which may replace an input)."""
    creator = type(graph)._create_op_internal  # pylint: disable=protected-access
    if graph._get_control_flow_context() is not None:  # pylint: disable=protected-access
        return False
    if creator is tf_ops.Graph._create_op_internal:  # pylint: disable=protected-access
        return True
    return (creator is func_graph_module.FuncGraph._create_op_internal  # pylint: disable=protected-access
            and all(t.graph is graph for t in inputs)
            and not (graph.capture_by_value and op_type in _READS_CAPTURED_BY_VALUE))


#: Op types a function graph with ``capture_by_value`` makes its own way (FuncGraph).
_READS_CAPTURED_BY_VALUE = frozenset({"ReadVariableOp", "ResourceGather"})


#: Attribute of a copy naming the op it replays (its ``_original_op`` says so too, but other
#: ops have one: TensorFlow's gradient ops name the op they differentiate).
_REPLAYS = "_memsave_replays"


def credit_gradients_to_originals(grads: Sequence, floors: Mapping[tf.Graph, int]) -> None:
    """Point the gradient ops TensorFlow built for copies (upstream of ``grads``, newer than
    the creation index ``floors`` gives for their graph) at the forward op each copy replays:
    tf.gradients names the op it differentiates as a gradient op's ``_original_op``, which
    error messages follow back to the user's code and TensorFlow's own tests compare with the
    forward op."""
    seeds = [t.op for g in grads if g is not None
             for t in ((g.values, g.indices) if isinstance(g, tf.IndexedSlices) else (g,))]
    def newer(op):
        return tf_graph.creation_index(op) > floors.get(op.graph, float("inf"))

    for op in tf_graph.walk(seeds, tf_graph.input_ops, include=newer):
        replayed = getattr(op._original_op, _REPLAYS, None)  # pylint: disable=protected-access
        while replayed is not None:  # a copy of a copy (nested levels): the user's op
            op._original_op = replayed  # pylint: disable=protected-access
            replayed = getattr(replayed, _REPLAYS, None)


def colocation_groups(op: tf.Operation) -> list[bytes]:
    """``op.colocation_groups()``, read from its ``NodeDef``: ``Operation.colocation_groups``
    asks the C API for ``_class`` and builds an exception where the op has none (most ops),
    ten times the cost, once per boundary."""
    attrs = op.node_def.attr
    groups = ([group for group in attrs["_class"].list.s if group.startswith(b"loc:@")]
              if "_class" in attrs else [])
    return groups or [f"loc:@{op.name}".encode()]


def copy_handle_data(original: tf.Tensor, copied: tf.Tensor) -> None:
    """Give a copied variant or resource output (a copy's, or a boundary's:
    ``stitch._boundary``) its original's handle data (the shape and
    dtype of what it holds: a While's TensorList accumulators, a variable's value).
    ``_create_op_internal`` runs the op's C++ shape function, which derives handle data for
    ops like ``TensorListPushBack`` but not for a ``While`` or a function call, whose Python
    builders set it; without it pfor (``jacobian``) cannot vectorize the gradient of a copy
    ("Required handle data not set"). See design note "handle data"."""
    if copied.dtype in (tf.variant, tf.resource):
        handle_data_util.copy_handle_data(original, copied)


def record_on_tapes(op: tf.Operation) -> None:
    """Record a copy on the gradient tapes recording now, as TensorFlow's own op wrappers
    record every op they make (``Graph._create_op_internal`` does not): a second tape around
    ``recompute``'s gradient (a gradient of a gradient) must see that the replayed values
    depend on the function's inputs, or it misses that part of the second derivative."""
    if not op.outputs or not execute.must_record_gradient():
        return
    attrs = tuple(item for name in op.node_def.attr if not name.startswith("_")
                  for item in (name, op.get_attr(name)))
    execute.record_gradient(op.type, list(op.inputs), attrs, list(op.outputs))


def _wait_for_arrival(op: tf.Operation, inputs: list, arrival: tf.Tensor, waiting: dict,
                      graph: tf.Graph) -> list:
    """The inputs of a root copy (one that reads no other copy), one of them made to wait for
    the gradient's arrival (design note "ordering under XLA"): the largest activation, i.e.
    floating input that is not a variable's value (``ordering.is_variable_value``), or, where
    every floating input is one, the smallest of them. Everything downstream of the root then
    waits too, and the copy differs from its original, so XLA cannot merge them. Not a weight
    where an activation is there: XLA schedules what depends on the forward pass alone as early
    as it can, so an activation that does not wait has its own transforms (the layout copy a
    convolution's filter gradient reads) made during the forward pass and held until the
    backward pass (design note "memory under XLA"); a weight's wait would also copy the weight
    where XLA cannot fuse the subtraction into its reader."""
    candidates = [i for i, t in enumerate(inputs) if ordering.can_wait(t)]
    if not candidates:
        if inputs:
            ordering.warn_unordered(f"a recomputed {op.type} op", inputs)
        return inputs
    activations = [i for i in candidates if not ordering.is_variable_value(inputs[i])]
    if activations:
        chosen = max(activations, key=lambda i: _elements(inputs[i]))
    else:
        chosen = min(candidates, key=lambda i: _elements(inputs[i]))
    waiter = _waiting(inputs[chosen], arrival, waiting, graph)
    return inputs[:chosen] + [waiter] + inputs[chosen + 1:]


def _reordered_operands_wait(op: tf.Operation, inputs: list, copies: Mapping, arrival: tf.Tensor,
                             waiting: dict, graph: tf.Graph) -> list:
    """The inputs of an einsum's copy, each operand that XLA transposes before its dot
    (``op_types.einsum_operand_reordered``) read through its stand-in unless it is a copy's
    output or waits already. The transpose of an operand read as it is depends on the forward
    pass alone, so XLA's common-subexpression elimination shares it with the original einsum's
    and holds it from the forward pass to the backward: a mixture of experts' transposed
    expert weights, 27 MiB of keras_hub Qwen3-MoE's 188 under ``jit_compile`` (design note
    "memory under XLA"). Through the stand-in the transpose is the copy's own, made when the
    gradient arrives; XLA fuses the subtraction into it, so the wait costs no buffer."""
    equation = op.get_attr("equation").decode()
    stand_ins = {w.ref() for w in waiting.values()}
    waited = list(inputs)
    for i, (original, t) in enumerate(zip(op.inputs, inputs)):
        if (original.op not in copies and t.ref() not in stand_ins and ordering.can_wait(t)
                and op_types.einsum_operand_reordered(equation, i)):
            waited[i] = _waiting(t, arrival, waiting, graph)
    return waited


def _waiting(t: tf.Tensor, arrival: tf.Tensor, waiting: dict, graph: tf.Graph) -> tf.Tensor:
    """``t``'s stand-in that waits for ``arrival`` (``ordering.after``), one per tensor."""
    if t.ref() not in waiting:
        with graph.as_default(), (
                # Another graph (a loop's backward body) captures t; colocation would name
                # an op of the source graph.
                graph.colocate_with(t.op, ignore_existing=True) if t.graph is graph
                else contextlib.nullcontext()):
            waiting[t.ref()] = ordering.after(t, arrival)
    return waiting[t.ref()]


def _elements(t: tf.Tensor) -> float:
    count = t.shape.num_elements()
    return float("inf") if count is None else count


#: Function-valued attributes of control-flow v2 ops, with the cache attribute the gradient
#: code reads, and how to find the functions' input shapes.
_FUNCTION_ATTRS = {
    "If": (("then_branch", "_true_graph"), ("else_branch", "_false_graph")),
    "StatelessIf": (("then_branch", "_true_graph"), ("else_branch", "_false_graph")),
    "While": (("cond", "_cond_graph"), ("body", "_body_graph")),
    "StatelessWhile": (("cond", "_cond_graph"), ("body", "_body_graph")),
}


def _input_shapes(op: tf.Operation) -> list:
    if op.type in op_types.WHILE_OP_TYPES:
        return [tf.TensorShape(s) for s in op.get_attr("output_shapes")]
    return [t.shape for t in op.inputs[1:]]  # If: the first input is the predicate


def _fresh_func_graph(op: tf.Operation, name: str, cached):
    """A new FuncGraph of function ``name`` of ``op``, built from its definition as ``op``'s
    graph sees it. Where it cannot see it, the original op's ``cached`` graph defines it: a
    cond in a shared function body that TensorFlow's gradient of another trace rewrote in
    place (``<name>_rewritten``), registering the new branches in that gradient's graph, out
    of this one's reach (design note "control flow and calls", later traces)."""
    try:
        return control_flow_util_v2.get_func_graph(op, _input_shapes(op), name)
    except KeyError:
        # What create_new_tf_function defines a function with (TensorFlow 2.21's module).
        atomic = getattr(control_flow_util_v2, "atomic_function", None)
        if cached is None or atomic is None:
            raise
    # Under a name of its own: the graph's library may hold another definition of ``name``
    # (copied with a function that calls it, before TensorFlow gave it more outputs).
    graph, stand_in = op.graph, f"{name}_memsave_cached{next(_function_counter)}"
    definition = atomic.from_func_graph(stand_in, cached, {})
    for child in getattr(definition, "children", ()):
        # What the branch calls (``__forward_...`` functions, registered beside it): added
        # where this graph cannot see it, for the copy's function too.
        if tf_graph.library_function(graph, child.name) is None:
            graph._add_function(child)  # pylint: disable=protected-access
    graph._add_function(definition)  # pylint: disable=protected-access
    try:
        return control_flow_util_v2.get_func_graph(op, _input_shapes(op), stand_in)
    finally:
        graph._remove_function(stand_in)  # pylint: disable=protected-access


def _give_own_functions(op: tf.Operation, original: tf.Operation) -> None:
    """Point ``op``, a copied If/While op, at fresh, uniquely named copies of its functions.

    The gradient of cond_v2/while_v2 renames the forward functions ``<name>_rewritten`` and
    re-registers them with extra outputs; an original and its copy sharing a function would
    register two different ``<name>_rewritten`` and TensorFlow rejects the second one.
    """
    for attr, cache in _FUNCTION_ATTRS.get(op.type, ()):
        name = op.get_attr(attr).name
        func_graph = _fresh_func_graph(op, name, getattr(original, cache, None))
        func_graph.name = f"{name}_memsave{next(_function_counter)}"
        op._set_func_attr(attr, control_flow_util_v2.create_new_tf_function(func_graph))  # pylint: disable=protected-access
        setattr(op, cache, func_graph)
