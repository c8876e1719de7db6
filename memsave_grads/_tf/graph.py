"""The one module that reads TensorFlow graph internals for analysis.

It walks the forward graph (:func:`walk`, the package's one graph walk), classifies operations
(replayable or not), sizes tensors and turns the region between ``xs`` and ``ys`` into the
TensorFlow-free :class:`ForwardGraph`. Anything private we depend on is named here (and in
``rewrite.py``, ``stitch.py`` and ``early_release.py``, which add ops and edges), nowhere else.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import heapq
import math
import weakref
from typing import Callable, Hashable, Iterable, Iterator, Sequence, TypeVar

import tensorflow as tf
from tensorflow.python.framework import auto_control_deps
from tensorflow.python.framework import composite_tensor
from tensorflow.python.framework import func_graph as func_graph_module
from tensorflow.python.framework import op_def_registry
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops import gradients_impl
from tensorflow.python.ops import gradients_util
from tensorflow.python.ops import handle_data_util
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.util import _pywrap_util_port

from memsave_grads.core import graph as graph_lib
from memsave_grads.core import op_types
from memsave_grads.core import policies

_Node = TypeVar("_Node")

#: The real ``tf.compat.v1.gradients``, captured when this module is imported (a reference, not a
#: patch): every gradient we build goes through it, so a patched ``tf.gradients`` never recurses.
ORIGINAL_GRADIENTS = gradients_impl.gradients
#: The real TF2 ``tf.gradients`` (``gradients_v2``: the same, without colocate_gradients_with_ops).
ORIGINAL_GRADIENTS_V2 = gradients_impl.gradients_v2


def walk(seeds: Iterable[_Node], neighbours: Callable[[_Node], Iterable[_Node]], *,
         include: Callable[[_Node], bool] | None = None,
         key: Callable[[_Node], Hashable] | None = None) -> Iterator[_Node]:
    """Yield every node reachable from ``seeds`` through ``neighbours``, each once.

    The package's one graph walk (as ``tf.contrib.graph_editor`` built its selections on one
    forward and one backward walk): pass :func:`input_ops` or :func:`dependency_ops` to walk
    upstream, :func:`consumer_ops` downstream, or any function of a node (tensors, function
    names). A node that ``include`` rejects is neither yielded nor expanded, so it bounds the
    walk (ops newer than a floor, ops of a region); a node whose ``neighbours`` are empty is
    yielded but not crossed. ``key`` makes nodes hashable: tensors are not in TF 2, pass
    ``key=tensor_key``.

    Depth first, last seed first; callers that need an order sort by :func:`creation_index`.
    Lazy: a caller that stops iterating (``any(...)``) stops the walk.
    """
    seen: set = set()
    stack = list(seeds)
    while stack:
        node = stack.pop()
        if include is not None and not include(node):
            continue
        node_key = node if key is None else key(node)
        if node_key in seen:
            continue
        seen.add(node_key)
        yield node
        stack.extend(neighbours(node))


def input_ops(op: tf.Operation) -> list[tf.Operation]:
    """The ops whose outputs ``op`` reads (data edges): one step upstream."""
    return [t.op for t in op.inputs]


def dependency_ops(op: tf.Operation) -> list[tf.Operation]:
    """The ops ``op`` waits for: data inputs and control inputs."""
    return input_ops(op) + list(op.control_inputs)


def consumer_ops(op: tf.Operation) -> list[tf.Operation]:
    """The ops reading an output of ``op`` (data edges): one step downstream."""
    return [c for t in op.outputs for c in t.consumers()]


def tensor_key(t: tf.Tensor):
    """A hashable stand-in for ``t`` (TF 2 tensors are not hashable): :func:`walk`'s ``key``."""
    return t.ref()


def creation_index(op: tf.Operation) -> int:
    """Creation index of ``op`` in its graph. Inputs are created before their consumers, so
    sorting by it gives a topological order of data edges."""
    return op._id  # pylint: disable=protected-access


def last_op_id(graph: tf.Graph) -> int:
    """The creation index of the newest op in ``graph`` (ops created later have larger ones)."""
    return max((creation_index(op) for op in graph.get_operations()), default=0)


def colocated_with(op: tf.Operation):
    """A context placing new ops with ``op`` whatever the enclosing colocation, as
    tf.gradients' sums are placed (``_MultiDeviceAddN``)."""
    return tf_ops._colocate_with_for_gradient(op, None, ignore_existing=True)  # pylint: disable=protected-access


def is_function_call(op: tf.Operation) -> bool:
    """An op that runs a graph function: a tf.function call, or a function-typed op."""
    return (op.type in op_types.FUNCTION_CALL_OP_TYPES
            or op.graph._is_function(op.type))  # pylint: disable=protected-access


def _no_gradient(op, *unused_output_grads):
    return [None] * len(op.inputs)


#: Function calls whose ``SymbolicGradient`` tf.gradients must not build in this context
#: (:func:`gradients_stopped_at`); empty outside it, so every other caller sees TF as it is.
_SOURCE_CALLS: contextvars.ContextVar[frozenset] = contextvars.ContextVar(
    "memsave_grads_source_calls", default=frozenset())


def _symbolic_gradient_unless_source(op, out_grads):
    """``gradients_util._SymGrad``, except for the calls in ``_SOURCE_CALLS``: no gradient."""
    if op in _SOURCE_CALLS.get():
        return [None] * len(op.inputs)
    return _symbolic_gradient_unless_source.__wrapped__(op, out_grads)


def _install_source_call_guard() -> None:
    """Route tf.gradients' ``SymbolicGradient`` through :func:`_symbolic_gradient_unless_source`;
    once, on first use (never at import), whatever wraps it after us (wrapping ours again
    would make the two call each other). Outside :func:`gradients_stopped_at` it only
    delegates."""
    if not hasattr(_symbolic_gradient_unless_source, "__wrapped__"):
        _symbolic_gradient_unless_source.__wrapped__ = gradients_util._SymGrad  # pylint: disable=protected-access
        gradients_util._SymGrad = _symbolic_gradient_unless_source  # pylint: disable=protected-access


def _stop_calls(sources: Sequence) -> frozenset:
    """The function calls among ``sources``' ops that tf.gradients does not differentiate but
    builds a ``SymbolicGradient`` for anyway (its ``_StopOps``): none of their inputs depends
    on a source. The walk upstream stays among ops newer than the oldest source's op: an op
    that depends on a source was made after it."""
    ops = {t.op for t in sources  # variables and eager values have no op
           if isinstance(t, tf.Tensor) and not is_eager_tensor(t)}
    calls = [op for op in ops if is_function_call(op)]
    if not calls:
        return frozenset()
    floor = min(creation_index(op) for op in ops)
    return frozenset(
        call for call in calls
        if not any(op in ops for op in walk(input_ops(call), input_ops,
                                            include=lambda op: creation_index(op) >= floor)))


def gradients_stopped_at(ys, sources, grad_ys, stops, **tf_gradients_kwargs) -> list:
    """``ORIGINAL_GRADIENTS(ys, sources, grad_ys, stop_gradients=stops)``, where backprop
    really ends at every stop and every source.

    tf.gradients does not stop at a function call op it does not differentiate: with no
    gradient function looked up, it differentiates the call with a ``SymbolicGradient`` op
    anyway. Two kinds of ops are not looked up (design note "boundaries"):

    - a call named in ``stop_gradients``: the path through the call is taken after all
      (measured on TF 2.21: the through-the-call values for a ``PartitionedCall``, a run-time
      ``NotFoundError`` or ``InvalidArgumentError`` for a ``StatefulPartitionedCall``). For
      the duration of this call such a stop's op gets a gradient function that returns None
      instead, and is left out of ``stop_gradients``: the gradient of a stop (a source too)
      is still what reaches it, and nothing goes beyond it.
    - a call whose output is a source and none of whose inputs depends on a source
      (tf.gradients' "stop ops"): its ``SymbolicGradient`` is dead, but XLA compiles dead ops,
      and it has no XLA kernel for a call that calls another function (TF 2.21:
      ``tf.gradients(loss, [h])`` with ``h`` such a call's output fails to compile under
      ``jit_compile`` in plain TensorFlow too). Such calls get no gradient here
      (:func:`_stop_calls`, :func:`_symbolic_gradient_unless_source`); a source call whose
      input depends on another source is differentiated (its gradient is the path to it).
    """
    calls = {t.op for t in stops if is_function_call(t.op)}
    stops = [t for t in stops if t.op not in calls]
    source_calls = _stop_calls(sources if isinstance(sources, (list, tuple)) else [sources])
    if source_calls:
        _install_source_call_guard()
    saved = [(op, op._gradient_function) for op in calls]  # pylint: disable=protected-access
    token = _SOURCE_CALLS.set(source_calls)
    try:
        for op in calls:
            op._gradient_function = _no_gradient  # pylint: disable=protected-access
        return ORIGINAL_GRADIENTS(ys, sources, grad_ys=grad_ys, stop_gradients=stops,
                                  **tf_gradients_kwargs)
    finally:
        _SOURCE_CALLS.reset(token)
        for op, function in saved:
            op._gradient_function = function  # pylint: disable=protected-access


def is_handle_gradient_read(op: tf.Operation) -> bool:
    """A variable read whose gradient goes to its handle (``op_types.
    HANDLE_GRADIENT_READ_OP_TYPES``; a gather only without ``batch_dims``)."""
    if op.type not in op_types.HANDLE_GRADIENT_READ_OP_TYPES:
        return False
    try:
        return op.type in op_types.VARIABLE_READ_OP_TYPES or op.get_attr("batch_dims") == 0
    except ValueError:
        return True


def variable_bytes(handle: tf.Tensor) -> int:
    """Bytes of the variable behind a resource ``handle``, from its handle data (0 where
    unknown)."""
    try:
        data = handle_data_util.get_handle_data(handle)
    except (AttributeError, TypeError, ValueError):
        return 0
    if data is None or not data.is_set or not data.shape_and_type:
        return 0
    entry = data.shape_and_type[0]
    shape = tf.TensorShape(entry.shape)
    return _elements(shape) * tf.dtypes.as_dtype(entry.dtype).size


def handle_gradient(read_type: str, grad, handle: tf.Tensor, indices: tf.Tensor | None = None):
    """The gradient a variable read of type ``read_type`` sends to its ``handle`` for the
    gradient ``grad`` of the value it read, as its registered gradient does: the gradient itself
    (``ReadVariableOp``), or ``IndexedSlices`` of the rows at ``indices`` (``ResourceGather``)."""
    if grad is None or read_type in op_types.VARIABLE_READ_OP_TYPES:
        return grad
    grad = tf.convert_to_tensor(grad)
    params_shape = resource_variable_ops.variable_shape(handle)
    size = tf.expand_dims(tf.size(indices), 0)
    values = tf.reshape(grad, tf.concat([size, params_shape[1:]], 0))
    return tf.IndexedSlices(values, tf.reshape(indices, size), params_shape)


def is_resource_variable(value) -> bool:
    return resource_variable_ops.is_resource_variable(value)


def is_composite_tensor(value) -> bool:
    """A RaggedTensor, SparseTensor, IndexedSlices or other composite value (variables are
    composite too: ask after them)."""
    return isinstance(value, composite_tensor.CompositeTensor)


def converted_as_tf_gradients_does(value, is_x: bool):
    """A y or x that is not a tensor, converted as tf.gradients converts it: ys plainly (a
    nested list of tensors becomes their stack), xs as references (which refuses a list
    holding a variable with NotImplementedError)."""
    return tf_ops.convert_to_tensor(value, name="x" if is_x else "y", as_ref=is_x)


def is_eager_tensor(value) -> bool:
    """An eager tensor: a value, with no graph for us to rewrite."""
    return isinstance(value, tf_ops.EagerTensor)


def is_reference_variable(value) -> bool:
    """A TF1 reference variable (``use_resource=False``, the default under
    ``disable_v2_behavior``)."""
    return isinstance(value, tf.Variable) and not is_resource_variable(value)


def reference_tensor(variable) -> tf.Tensor:
    """The ``float32_ref`` tensor of a reference variable: what tf.gradients differentiates
    with respect to (its ``read`` identity and every other reader consume it)."""
    return tf_ops.convert_to_tensor(variable, as_ref=True)


def _captured_as(graph, external):
    """The placeholder through which function graph ``graph`` captured ``external``, if any."""
    for outer, inner in getattr(graph, "captures", ()):
        if outer is external:
            return inner
    return None


def as_seen_from(value, graph):
    """``value`` as the ops of ``graph`` read it, or None where they cannot read it at all.

    A tensor of ``graph`` is itself. A tensor of an enclosing graph (or an eager tensor, or a
    variable's handle) is read inside a ``tf.function``, a nested one or a while_v2/cond_v2
    body through the placeholders that captured it, one per nesting level: tf.gradients
    follows the same chain (``gradients_util._MaybeCaptured``). None means ``graph`` never
    captured it, so nothing there depends on it.
    """
    if not is_eager_tensor(value) and value.graph is graph:
        return value
    direct = _captured_as(graph, value)
    if direct is not None:
        return direct
    outer = getattr(graph, "outer_graph", None)
    if outer is None:
        return None
    seen_outside = as_seen_from(value, outer)
    return None if seen_outside is None else _captured_as(graph, seen_outside)


def captured_value(t: tf.Tensor):
    """The tensor one graph out that placeholder ``t`` of a function graph captured, or None."""
    if is_eager_tensor(t) or t.op.type != "Placeholder" or not is_function_graph(t.graph):
        return None
    for outer, inner in t.graph.captures:
        if inner is t:
            return outer
    return None


def _depends_on(t, x_refs: set) -> bool:
    """Whether ``t`` is computed from a tensor in ``x_refs``, following data edges and, out of
    function graphs, captures (as tf.gradients' walk does)."""
    upstream = walk([t], lambda u: [captured_value(u), *u.op.inputs],
                    include=lambda u: u is not None and not is_eager_tensor(u), key=tensor_key)
    return any(tensor_key(u) in x_refs for u in upstream)


def is_captured_value(given, seen) -> bool:
    """Whether ``seen`` is a placeholder that captured ``given``, a graph value (neither eager
    nor a resource handle) that the capture path carries (see :func:`crossing_captures`)."""
    return (given is not seen and not is_eager_tensor(given) and given.dtype != tf.resource)


def crossing_captures(ys: Sequence[tf.Tensor], outer_xs: Sequence[tf.Tensor],
                      stop_ops: Iterable[tf.Operation] = ()) -> list[tf.Tensor]:
    """Captured placeholders of ys' graph that ys read and whose captured value is one of
    ``outer_xs`` (tensors of enclosing graphs) or computed from one: where ys' dependence on
    those xs leaves the graph (design note "captured xs"). Eager values and resource handles
    are left out: nothing computes them, so their own capture is all there is."""
    x_refs = {x.ref() for x in outer_xs if not is_eager_tensor(x)}
    if not x_refs:
        return []
    stop_ops = set(stop_ops)

    def carries_x_out(placeholder: tf.Tensor) -> bool:
        value = captured_value(placeholder)
        return (value is not None and not is_eager_tensor(value) and carries_gradients(value)
                and value.dtype != tf.resource and _depends_on(value, x_refs))

    upstream = walk([y.op for y in ys], input_ops, include=lambda op: op not in stop_ops)
    found = [op.outputs[0] for op in upstream
             if op.type == "Placeholder" and carries_x_out(op.outputs[0])]
    return sorted(found, key=lambda t: creation_index(t.op))


def automatic_control_edges(
        ops: Iterable[tf.Operation]) -> list[tuple[tf.Operation, tf.Operation]] | None:
    """The control edges ``(before, after)`` that a ``tf.function``'s automatic control
    dependencies will add among ``ops`` when its trace ends: in creation order, an op that
    writes a resource waits for the last write and the reads since, a read waits for the last
    write, and stateful ops that take no resource run one after another.

    A walk of the graph as it is during the trace does not see these edges, yet they exist
    when the function runs: an edge of ours that looks safe can close a cycle with them
    (tf_keras' ``Nadam``: every variable's update reads and writes one shared ``u_product``,
    so the updates are chained in the order ``apply_gradients`` made them, whatever order we
    ask for). Outside a function graph nothing adds them: ``[]``. Emulates
    ``AutomaticControlDependencies`` (its resource resolvers included), but not its handling
    of TF1 control flow (Switch/Merge, which it also rewires) or of collective-op scopes
    (nothing in TF 2.21 opens one): None, "cannot say", where a TF1 cond or loop is among
    ``ops`` (a function traced with control flow v2 turned off).
    """
    ops = sorted(ops, key=creation_index)
    if not ops or not is_function_graph(ops[0].graph):
        return []
    if any(uses_v1_control_flow(op) for op in ops):
        return None
    last_write: dict = {}
    reads_since_write: dict = collections.defaultdict(list)
    edges = []
    for op in ops:
        if op.type in auto_control_deps.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS:
            continue
        touched = set()
        # Only an op taking a resource (or a dataset variant, which tf.data's resolver follows
        # to its resources) can touch one; asking the others costs a failed attribute lookup
        # each, seconds on a ResNet50 step.
        resources = (auto_control_deps._get_resource_inputs(op)  # pylint: disable=protected-access
                     if any(t.dtype in (tf.resource, tf.variant) for t in op.inputs) else ())
        for handle, kind in resources:
            key = handle.ref()
            if key in touched:
                continue
            touched.add(key)
            if key in last_write:
                edges.append((last_write[key], op))
            if kind == auto_control_deps.ResourceType.READ_ONLY:
                reads_since_write[key].append(op)
            else:
                edges.extend((read, op) for read in reads_since_write.pop(key, ()))
                last_write[key] = op
        # pylint: disable-next=protected-access
        if (not touched and auto_control_deps.op_is_stateful(op)
                and op._control_flow_context is None):
            if None in last_write:
                edges.append((last_write[None], op))
            last_write[None] = op
    return [(before, after) for before, after in edges if before is not after]


def is_function_graph(graph) -> bool:
    """A ``tf.function``'s graph, or a cond_v2/while_v2 branch or body."""
    return isinstance(graph, func_graph_module.FuncGraph)


def encloses(outer, graph) -> bool:
    """Whether ``graph`` is ``outer`` or a function graph nested (at any depth) inside it."""
    while graph is not None:
        if graph is outer:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def carries_gradients(t: tf.Tensor) -> bool:
    """Whether gradients can flow through ``t``: float and complex values, and the resource
    handles and variants (TensorLists) that stand for them."""
    dtype = t.dtype.base_dtype
    return dtype.is_floating or dtype.is_complex or dtype in (tf.resource, tf.variant)


def forward_region(ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor],
                   stop_ops: Iterable[tf.Operation] = ()) -> list[tf.Operation]:
    """Operations on some data path from an ``x`` to a ``y``, in topological (creation) order.

    Ops whose gradient the caller stops (``stop_gradients``) are not crossed going forward: what
    lies beyond them is constant with respect to ``xs``. Nor are ops that read only a shape
    (``op_types.SHAPE_OP_TYPES``), which are left out: with a batch size unknown at trace time,
    ``tf.shape`` would otherwise pull shape arithmetic and dropout's random draws into the
    region, and a kept random draw outweighs the boolean mask that plain ``tf.gradients`` holds
    (design note "unknown batch size").
    """
    stop_ops = set(stop_ops)

    def crossed(op):
        return () if op in stop_ops or op.type in op_types.SHAPE_OP_TYPES else consumer_ops(op)

    downstream = {op for op in walk([c for x in xs for c in x.consumers()], crossed)
                  if op.type not in op_types.SHAPE_OP_TYPES}
    upstream = walk([y.op for y in ys], input_ops, include=downstream.__contains__)
    return topological((op for op in upstream if op not in stop_ops))


#: Ops made after an op that reads them (a while loop's hoisted reads, ``_tf.loops``):
#: wherever one is among them, creation order is no topological order of ops.
_MADE_AFTER_A_CONSUMER: "weakref.WeakSet" = weakref.WeakSet()


def made_after_a_consumer(op: tf.Operation) -> None:
    """Record that ``op`` was given as an input to an op made before it (:func:`topological`)."""
    _MADE_AFTER_A_CONSUMER.add(op)


def topological(ops: Iterable[tf.Operation]) -> list[tf.Operation]:
    """``ops`` in creation order, which is a topological order of their data edges unless one
    of them was given as an input to an op made before it (:func:`made_after_a_consumer`: a
    while loop's hoisted reads, as while_v2's own accumulators are). Then the earliest-created
    op whose inputs among ``ops`` are all placed comes next."""
    ordered = sorted(ops, key=creation_index)
    if not any(op in _MADE_AFTER_A_CONSUMER for op in ordered):
        return ordered
    position = {op: i for i, op in enumerate(ordered)}
    waiting = [sum(1 for t in op.inputs if t.op in position) for op in ordered]
    consumers: dict = {}
    for i, op in enumerate(ordered):
        for t in op.inputs:
            if t.op in position:
                consumers.setdefault(position[t.op], []).append(i)
    ready = [i for i, count in enumerate(waiting) if not count]
    heapq.heapify(ready)
    out = []
    while ready:
        i = heapq.heappop(ready)
        out.append(ordered[i])
        for j in consumers.get(i, ()):
            waiting[j] -= 1
            if not waiting[j]:
                heapq.heappush(ready, j)
    if len(out) != len(ordered):  # a cycle: TF1 control flow, not of while_v2's making
        return ordered
    return out


def uses_v1_control_flow(op: tf.Operation) -> bool:
    """Whether ``op`` is TF1 control flow or inside a TF1 while loop or cond.

    Only while and cond contexts count: a call of a ``tf.function(jit_compile=True)`` (Keras'
    grouped convolutions) carries an ``XLAControlFlowContext``, which is not control flow.
    """
    return (op.type in op_types.V1_CONTROL_FLOW_OP_TYPES
            or control_flow_util.IsInWhileLoop(op) or control_flow_util.IsInCond(op))


#: Attribute holding :func:`is_replayable`'s answer on the op: what it reads (type, control-flow
#: context, input dtypes, op definition, branch functions) is fixed when the op is made, and a
#: gradients call asks for each op several times (selection, exposure, the copies' check).
_REPLAYABLE_ATTR = "_memsave_replayable"


def is_replayable(op: tf.Operation) -> bool:
    """Whether running a copy of ``op`` again is guaranteed to give the same outputs.

    Stateful ops (random draws, variable reads, iterators, stateful If/While) are not: their
    outputs are kept instead (design note "never replay state" in docs/design.md). Checks
    (``op_types.CHECK_OP_TYPES``) are stateful only to stay in the graph, and are replayed.
    """
    known = getattr(op, _REPLAYABLE_ATTR, None)
    if known is None:
        known = _is_replayable(op)
        setattr(op, _REPLAYABLE_ATTR, known)
    return known


def _is_replayable(op: tf.Operation) -> bool:
    if uses_v1_control_flow(op) or op.type in op_types.FEED_OP_TYPES:
        return False
    if any(t.dtype._is_ref_dtype for t in op.inputs):  # pylint: disable=protected-access
        # Reads a TF1 reference variable (its ``read`` identity): a variable read. Its copy
        # would also take a reference input, which a TF1 XLA compilation context refuses
        # ("Non-resource Variables are not supported inside XLA computations").
        return False
    if op.type in op_types.UNMARKED_RANDOM_OP_TYPES:
        return not _draws_at_random(op.node_def)
    if (op.type in _FUNCTION_RUNNING_OP_TYPES or is_function_call(op)) and any(
            _draws_at_random(node)
            for node in _nodes_in_functions(op.graph, _called_functions(op.node_def))):
        # TensorFlow marks a call, cond or loop stateful by the ops it runs, and these draws
        # are not marked: a stateless call may hold one.
        return False
    if _is_check(op):
        return True
    try:
        return not op.op_def.is_stateful
    except (AttributeError, ValueError):
        return False


def _draws_at_random(node_def) -> bool:
    """Whether an op (its ``NodeDef``) is one of ``op_types.UNMARKED_RANDOM_OP_TYPES`` that
    draws anew on every run: not ``deterministic`` with a nonzero seed."""
    if node_def.op not in op_types.UNMARKED_RANDOM_OP_TYPES:
        return False
    attr = node_def.attr
    deterministic = "deterministic" in attr and attr["deterministic"].b
    seeded = any(name in attr and attr[name].i for name in ("seed", "seed2"))
    return not (deterministic and seeded)


def _called_functions(node_def) -> list[str]:
    """The graph functions an op (its ``NodeDef``) runs: a call's, a cond's branches, a
    case's list of branches, a loop's condition and body."""
    names = []
    for value in node_def.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        names.extend(f.name for f in value.list.func)
    return names


def _is_check(op: tf.Operation) -> bool:
    """A check (``op_types.CHECK_OP_TYPES``), or a cond or function call that runs only checks
    and stateless ops: TF2's ``tf.debugging.assert_*`` guard their ``Assert`` with a stateful
    ``If`` (``AssertGuard``), which a trace may also build as a call of its branch."""
    if op.type in op_types.CHECK_OP_TYPES:
        return True
    try:
        if op.type == op_types.STATEFUL_COND_OP_TYPE:  # a StatelessIf is replayable anyway
            names = [op.get_attr("then_branch").name, op.get_attr("else_branch").name]
        elif op.type in op_types.FUNCTION_CALL_OP_TYPES:
            names = [op.get_attr("f").name]
        else:
            return False
    except (AttributeError, ValueError):
        return False
    # Calls' and conds' own types are left out: what they run is listed.
    containers = op_types.FUNCTION_CALL_OP_TYPES | op_types.COND_OP_TYPES
    run = [t for t in _op_types_in_functions(op.graph, names) if t not in containers]

    def stateless(op_type: str) -> bool:
        op_def = op_def_registry.get(op_type)
        return op_def is not None and not op_def.is_stateful

    return bool(run) and all(t in op_types.CHECK_OP_TYPES or stateless(t) for t in run)


def library_function(graph, name: str):
    """The function ``name`` as ``graph`` (or an enclosing graph) holds it, or None."""
    while graph is not None:  # a FuncGraph looks outward for it
        function = graph._get_function(name)  # pylint: disable=protected-access
        if function is not None:
            return function
        graph = getattr(graph, "outer_graph", None)
    return None


def _function_nodes(graph, name: str) -> list:
    """The ``NodeDef``s of the graph function ``name`` as ``graph`` sees it, or ``[]``."""
    function = library_function(graph, name)
    return [] if function is None else list(function.cached_definition.node_def)


def _nodes_in_functions(graph, names: Sequence[str]) -> list:
    """The ``NodeDef``s inside the graph functions ``names`` (as ``graph`` sees them), and
    inside the functions their ops run: calls, and the branches and bodies of conds, cases and
    loops (a second gradient tape wraps a cond in a call of a function holding it)."""
    nodes_of: dict[str, list] = {}

    def called_functions(name: str) -> list[str]:
        nodes_of[name] = _function_nodes(graph, name)
        return [called for node in nodes_of[name] for called in _called_functions(node)]

    found = list(walk(names, called_functions))
    return [node for name in found for node in nodes_of[name]]


def _op_types_in_functions(graph, names: Sequence[str]) -> list[str]:
    """The op types of :func:`_nodes_in_functions`."""
    return [node.op for node in _nodes_in_functions(graph, names)]


#: The attribute ``Graph.gradient_override_map`` sets on the ops made inside it: the op type
#: whose registered gradient function tf.gradients uses instead of the op's own type's.
_GRADIENT_OVERRIDE_ATTR = "_gradient_op_type"
#: How the op types ``tf.custom_gradient`` registers for its IdentityN begin
#: (``custom_gradient.generate_name``).
_CUSTOM_GRADIENT_PREFIX = "CustomGradient-"


def gradient_override(op: tf.Operation) -> str | None:
    """The op type whose gradient tf.gradients uses for ``op`` instead of its own, given by
    ``Graph.gradient_override_map`` (``tf.custom_gradient`` uses it too); None without one."""
    try:
        return op.get_attr(_GRADIENT_OVERRIDE_ATTR).decode()
    except ValueError:
        return None


def is_custom_gradient_override(op_type: str) -> bool:
    """Whether a gradient override is ``tf.custom_gradient``'s own."""
    return op_type.startswith(_CUSTOM_GRADIENT_PREFIX)


def is_custom_gradient_op(op: tf.Operation) -> bool:
    """Whether ``op`` is the ``IdentityN`` through which a ``tf.custom_gradient`` function
    returns its results: its gradient is the function's own, which reads the function's
    arguments (and whatever else it closed over) from the forward pass, not from a copy
    (design note "custom gradients")."""
    return op.type == "IdentityN" and is_custom_gradient_override(gradient_override(op) or "")


def recomputing_custom_gradients(region: Sequence[tf.Operation]) -> dict[tf.Operation, int]:
    """The custom-gradient ``IdentityN`` ops of ``region`` whose gradient runs the function
    again from its arguments (``tf.recompute_grad``'s, ``keras.RematScope``'s too, and
    ``memsave_grads.recompute``'s), each with how many of its inputs are the function's
    results (:func:`_recomputed_result_count`). Their gradients read every argument from the
    forward pass. Any other custom gradient reads what its own code reads (a linear function's,
    not its input; ``tf.nn.silu``'s, its input), which the graph does not say before the
    gradient is built: those are modelled as ordinary ops (design note "custom gradients")."""
    found = {}
    for op in region:
        if op.type != "IdentityN":
            continue
        count = getattr(op, _RECOMPUTED_RESULTS_ATTR, None)
        if count is None:
            count = _recomputed_result_count(op) if is_custom_gradient_op(op) else None
            setattr(op, _RECOMPUTED_RESULTS_ATTR, -1 if count is None else count)
        if count is not None and count >= 0:
            found[op] = count
    return found


#: Attribute holding :func:`recomputing_custom_gradients`' answer on the op (-1: not a
#: recomputation's): its gradient function is registered when the op is made, and a gradients
#: call asks four times (node sets, forced keeps, the graph model, the no-saving warning).
_RECOMPUTED_RESULTS_ATTR = "_memsave_recomputed_results"


def _closure(fn) -> dict:
    """The values a Python function closes over, by name."""
    return {name: cell.cell_contents
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ())}


def _recomputed_result_count(op: tf.Operation) -> int | None:
    """How many of a recomputing custom-gradient ``IdentityN``'s inputs are the function's
    results (they come first, then its arguments and variables, and its gradient gives them
    None); None where ``op``'s gradient is not a recomputation's, or cannot be read.

    Read from TensorFlow's graph-mode ``tf.custom_gradient``: the gradient it registers
    (``internal_grad_fn``) calls ``tape_grad_fn``, which closes over ``flat_result_len`` and
    the function's own ``grad_fn``. Where that layout is not found (another TensorFlow), None:
    the op is modelled as any other."""
    try:
        registered = tf_ops._gradient_registry.lookup(gradient_override(op))  # pylint: disable=protected-access
        tape_grad_fn = _closure(registered)["tape_grad_fn"]
        inner = _closure(tape_grad_fn)
        count, grad_fn = inner["flat_result_len"], inner["grad_fn"]
    except (LookupError, KeyError, AttributeError, TypeError, ValueError):
        return None
    recomputes = (getattr(grad_fn, "__qualname__", "").startswith("recompute_grad.")
                  or getattr(grad_fn, "__module__", "") == _RECOMPUTE_MODULE)
    if not recomputes or not isinstance(count, int) or not 0 < count < len(op.inputs):
        return None
    return count


#: The module of ``memsave_grads.recompute``, whose custom gradient recomputes as
#: ``tf.recompute_grad``'s does.
_RECOMPUTE_MODULE = "memsave_grads.recomputation"


def loop_body_has_custom_gradient(loop: tf.Operation) -> bool:
    """Whether the body of a while op holds a ``tf.custom_gradient`` (``recompute()``, or
    ``tf.recompute_grad``): then its gradient need not store every tensor of every iteration."""
    try:
        nodes = _function_nodes(loop.graph, loop.get_attr("body").name)
    except (AttributeError, ValueError):
        return False
    return any(is_custom_gradient_override(node.attr[_GRADIENT_OVERRIDE_ATTR].s.decode())
               for node in nodes if _GRADIENT_OVERRIDE_ATTR in node.attr)


#: Ops that run function graphs named in their attributes: calls, conds, switch cases, loops.
_FUNCTION_RUNNING_OP_TYPES = (op_types.FUNCTION_CALL_OP_TYPES | op_types.COND_OP_TYPES
                              | op_types.CASE_OP_TYPES | op_types.WHILE_OP_TYPES)


def op_types_run(op: tf.Operation) -> list[str]:
    """The types of the ops that running ``op`` runs: its own and, for a function call, a
    cond's branches or a loop's body, those of its functions (nested ones included; none where
    a function cannot be read)."""
    if op.type not in _FUNCTION_RUNNING_OP_TYPES:
        return [op.type]
    try:
        return [op.type, *_op_types_in_functions(op.graph, _called_functions(op.node_def))]
    except (AttributeError, ValueError):
        return [op.type]


def is_expensive(op: tf.Operation) -> bool:
    """A matmul/convolution/einsum op, or a call of a function that runs one: what the
    ``"speed"`` policy keeps, and what the planners prefer to keep (``ForwardGraph.expensive``)."""
    return policies.keeps_for_speed(op_types_run(op))


def onednn_in_effect() -> bool:
    """Whether this process runs TensorFlow's CPU kernels through oneDNN.

    TensorFlow decides once per process, from ``TF_ENABLE_ONEDNN_OPTS`` or, unset, from the
    CPU (on by default on x86 CPUs with AVX-512 VNNI/BF16 or AMX). It matters for memory: the
    oneDNN convolution gradients allocate no im2col scratch, the Eigen ones tens of MiB
    (``memory_model.conv2d_gradient_workspace_bytes``).
    """
    return bool(_pywrap_util_port.IsMklEnabled())


#: True while a replay's backward pass (``recomputation``) differentiates its copies: the
#: gradient call made there is the library's own, not the user's.
_IN_REPLAY_BACKWARD: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "memsave_grads_in_replay_backward", default=False)


@contextlib.contextmanager
def replay_backward():
    """Within it, gradient calls are a replay's own (see :func:`in_replay_backward`)."""
    token = _IN_REPLAY_BACKWARD.set(True)
    try:
        yield
    finally:
        _IN_REPLAY_BACKWARD.reset(token)


def in_replay_backward() -> bool:
    """Whether a gradient call is a replay's own: a recomputed loop step or ``recompute(fn)``
    differentiating its copies, where a patched tf.gradients plans too but has nothing to tell
    the user (the step around it is what saves)."""
    return _IN_REPLAY_BACKWARD.get()


#: Examples the memory model counts for a traced batch dimension of unknown size (None in
#: the static shape); None: count it as 1 (sizes per example). See :func:`assumed_batch_size`.
_ASSUMED_BATCH_SIZE: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "memsave_grads_assumed_batch_size", default=None)


@contextlib.contextmanager
def assumed_batch_size(examples: int | None):
    """Within it, the memory model counts the first unknown dimension of each static shape as
    ``examples`` (the batch a step traced with a None batch size runs), and any further unknown
    dimension as 1 (design note "unknown batch size"). None leaves every unknown dimension at
    1: sizes per example."""
    token = _ASSUMED_BATCH_SIZE.set(examples)
    try:
        yield
    finally:
        _ASSUMED_BATCH_SIZE.reset(token)


def current_assumed_batch_size() -> int | None:
    """The batch size :func:`assumed_batch_size` put in effect, or None."""
    return _ASSUMED_BATCH_SIZE.get()


def _static_dims(shape) -> list[int]:
    """``shape``'s dimensions with unknown ones filled in: the first as the assumed batch size
    (1 without one), the others as 1. A shape of unknown rank has no dimensions (one element)."""
    if shape.rank is None:
        return []
    batch = _ASSUMED_BATCH_SIZE.get() or 1
    dims, batch_filled = [], False
    for dim in shape.as_list():
        if dim is None:
            dims.append(1 if batch_filled else batch)
            batch_filled = True
        else:
            dims.append(dim)
    return dims


def has_unsized_dimensions(shape) -> bool:
    """Whether the memory model guesses part of ``shape``'s size: its rank is unknown, or it
    has an unknown dimension that no assumed batch size stands for (with one, the first unknown
    dimension is taken as the batch; without one, every unknown dimension is unsized)."""
    if shape.rank is None:
        return True
    unknown = sum(dim is None for dim in shape.as_list())
    return unknown > (1 if _ASSUMED_BATCH_SIZE.get() is not None else 0)


def tensor_bytes(t: tf.Tensor) -> int:
    """Static byte size of ``t``: unknown dimensions as :func:`_static_dims` fills them (the
    first as the assumed batch size, 1 without one), unknown rank as one element.

    Counting an unknown dimension as 1 keeps sizes consistent *relative* to each other, but
    per example, where weights weigh as much as a whole batch's activations: a step traced
    with a None batch size (Keras ``fit``) is planned for the batch it runs under
    :func:`assumed_batch_size`.
    """
    try:
        itemsize = t.dtype.size
    except (AttributeError, TypeError):
        itemsize = 0
    return _elements(t.shape) * itemsize


def is_reference_read(op: tf.Operation) -> bool:
    """A TF1 reference variable's read (its ``read`` identity): its output is the variable's
    buffer, resident as a ``ReadVariableOp``'s is (``op_types.ALIAS_OP_TYPES``), kept or not.
    Counted as a view's own bytes where kept, a plan on reference variables paid a weight per
    block (outside review: 0.2 MiB of "activations" on a 12-block MLP per example, all weights,
    and the plan refused)."""
    return op.type in op_types.VIEW_OP_TYPES and any(
        t.dtype._is_ref_dtype for t in op.inputs)  # pylint: disable=protected-access


def op_bytes(op: tf.Operation) -> int:
    return sum(tensor_bytes(t) for t in op.outputs)


def _elements(shape) -> int:
    """Elements of a static shape, unknown dimensions filled in as in :func:`tensor_bytes`."""
    if shape.rank is None:
        return 1
    dims = shape.as_list()
    if None not in dims:  # fully defined: most shapes, read for every op of a region
        return math.prod(dims)
    count = 1
    for dim in _static_dims(shape):
        count *= dim
    return count


def _dim(shape, axis: int) -> int:
    if shape.rank is None or not -shape.rank <= axis < shape.rank:
        return 1
    return _static_dims(shape)[axis]


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
    if op.type in op_types.ALIAS_OP_TYPES or not op.outputs:
        return 0.0
    out = op.outputs[0].shape
    try:
        if op.type in op_types.MATMUL_OP_TYPES:
            transpose = op.get_attr("transpose_a")
            return 2.0 * _elements(out) * _dim(op.inputs[0].shape, 0 if transpose else 1)
        if op.type in op_types.BATCH_MATMUL_OP_TYPES:
            adjoint = op.get_attr("adj_x")
            return 2.0 * _elements(out) * _dim(op.inputs[0].shape, -2 if adjoint else -1)
        if op.type in op_types.CONVOLUTION_OP_TYPES:
            kernel = op.inputs[1].shape  # [*spatial, in/groups, out]
            return 2.0 * _elements(out) * _elements(kernel) / max(_dim(kernel, -1), 1)
        if op.type in op_types.DEPTHWISE_CONVOLUTION_OP_TYPES:
            kernel = op.inputs[1].shape  # [h, w, in, multiplier]
            return 2.0 * _elements(out) * _dim(kernel, 0) * _dim(kernel, 1)
        if op.type in op_types.TRANSPOSED_CONVOLUTION_OP_TYPES:
            kernel, grad = op.inputs[1].shape, op.inputs[2].shape  # kernel [*s, out, in]
            return 2.0 * _elements(grad) * _elements(kernel) / max(_dim(kernel, -1), 1)
        if op.type in op_types.EINSUM_OP_TYPES:
            return _einsum_flops(op)
    except (ValueError, TypeError):  # an attr or shape we cannot read: fall back to elements
        pass
    return float(max([_elements(t.shape) for t in list(op.inputs) + list(op.outputs)
                      if t.dtype != tf.resource] or [1]))


def _variable_gradient_bytes(region, index, x_refs, gradients_held: bool) -> list[int]:
    """Bytes of variable gradient each op's backward step produces (``ForwardGraph.
    param_bytes``): the variables (xs, and reads of them) it takes; for a gather, the rows it
    reads (an ``IndexedSlices`` gradient). Where the gradients are held for the optimizer,
    the partials of one variable are summed into one buffer, so each variable counts once, at
    the consumer the backward pass reaches first (the last in forward order)."""
    def source_key(t):
        if t.ref() not in x_refs and t.op.inputs:   # a variable read: key it by the handle
            return t.op.inputs[0].ref()
        return t.ref()

    counted = set()
    params = [0] * len(region)
    for i in reversed(range(len(region))):
        op = region[i]
        for position, t in enumerate(op.inputs):
            if not (t.ref() in x_refs or (t.op in index
                                          and t.op.type in op_types.ALIAS_OP_TYPES)):
                continue
            rows = op.type in op_types.GATHER_OP_TYPES and position == 0
            if t.dtype == tf.resource and not rows:   # a handle: its reads carry the bytes
                continue
            if gradients_held:
                key = source_key(t)
                if key in counted:
                    continue
                counted.add(key)
            params[i] += tensor_bytes(op.outputs[0]) if rows else tensor_bytes(t)
    return params


def _under_custom_gradients(region: Sequence[tf.Operation], index: dict, y_ops: set
                            ) -> tuple[frozenset, dict]:
    """``(shadowed, customs)``: ``customs`` maps each recomputing ``tf.custom_gradient``
    IdentityN of ``region`` (:func:`recomputing_custom_gradients`; node number) to its results
    (refs of its first inputs); ``shadowed`` are the nodes no gradient reaches, because each of
    their paths to ys enters such an op as one of its results (its gradient function computes
    the arguments' gradients itself, running the block again from them). tf.gradients never
    differentiates those: they keep nothing for the backward pass and get no partials."""
    customs = {index[op]: {t.ref() for t in op.inputs[:count]}
               for op, count in recomputing_custom_gradients(region).items()}
    if not customs:
        return frozenset(), {}
    reached = [op in y_ops for op in region]
    for i in reversed(range(len(region))):
        if not reached[i]:
            continue
        results = customs.get(i, ())
        for t in region[i].inputs:
            if t.op in index and t.ref() not in results:
                reached[index[t.op]] = True
    return frozenset(i for i, r in enumerate(reached) if not r), customs


def to_forward_graph(region: Sequence[tf.Operation], xs: Sequence[tf.Tensor],
                     ys: Sequence[tf.Tensor], gradients_held: bool = False,
                     function_facts: Callable | None = None) -> graph_lib.ForwardGraph:
    """The TF-free model of ``region`` (node ``i`` is ``region[i]``); ``gradients_held`` as in
    ``ForwardGraph``.

    Variable reads count 0 bytes: their output aliases the variable's buffer, which is resident
    anyway. ``function_facts(op)``: for a cond, loop or function call, what its gradient keeps,
    read from its bodies (``function_ops.gradient_facts``); None for other ops. Without it such
    ops are modelled by their type alone, as one op that keeps its inputs.
    """
    facts = [function_facts(op) if function_facts is not None else None for op in region]
    index = {op: i for i, op in enumerate(region)}
    x_refs = {x.ref() for x in xs}
    y_ops = {y.op for y in ys}
    inputs, reads_source = [], []
    for op in region:
        preds = sorted({index[t.op] for t in op.inputs if t.op in index})
        inputs.append(tuple(preds))
        reads_source.append(any(t.ref() in x_refs for t in op.inputs))
    # Which inputs each gradient reads: an input needed only for a constant's gradient is not
    # read (``0.5 * x``), since that gradient is pruned from the step.
    reads_inputs = [op_types.gradient_reads_inputs(op.type) if found is None
                    else bool(found.read_inputs) for op, found in zip(region, facts)]
    unread = []
    for op, found, preds, reads_any in zip(region, facts, inputs, reads_inputs):
        if not preds or (found is None and not reads_any):
            # Nothing of the region read, or a gradient that reads no input: every input of
            # the region is unread, whatever the per-input rule says (the rule's first test).
            unread.append(frozenset(preds))
            continue
        if found is None:
            differentiable = [carries_gradients(t) and (t.op in index or t.ref() in x_refs)
                              for t in op.inputs]
            # The rule reads static shapes for one kind of op only (a select's condition).
            static_shapes = (op.type in op_types.GRADIENT_READS_CONDITION_ONLY_OP_TYPES and all(
                t.shape.is_fully_defined()
                for t in (*op.inputs, *op.outputs) if t.dtype != tf.resource))
        read = {}
        for i, t in enumerate(op.inputs):
            if t.op in index:
                reads = (i in found.read_inputs if found is not None else
                         op_types.gradient_reads_input(op.type, i, differentiable, static_shapes))
                read[index[t.op]] = read.get(index[t.op], False) or reads
        unread.append(frozenset(p for p, r in read.items() if not r))
    # Under a tf.custom_gradient, only its gradient function runs: it reads the arguments
    # (tf.recompute_grad recomputes from them), and nothing reaches the function's own ops.
    shadowed, customs = _under_custom_gradients(region, index, y_ops)
    # Its IdentityN's outputs alias its inputs (a view of them all, held while its gradient
    # is pending: the results, which the arguments of the blocks after are, and the arguments).
    for i in customs:
        reads_inputs[i] = True
        unread[i] = frozenset()
    reads_inputs = [r and i not in shadowed for i, r in enumerate(reads_inputs)]
    # A view (reshape, identity) costs no bytes, but "reads" its input whenever a consumer's
    # gradient reads the view: that keeps the shared buffer alive in the memory model.
    for i in reversed(range(len(region))):
        if region[i].type in op_types.MEMORY_MODEL_VIEW_OP_TYPES and i not in customs:
            reads_inputs[i] = any(reads_inputs[index[c]] and i not in unread[index[c]]
                                  for t in region[i].outputs for c in t.consumers() if c in index)
    params = _variable_gradient_bytes(region, index, x_refs, gradients_held)
    params = [0 if i in shadowed else p for i, p in enumerate(params)]
    return graph_lib.ForwardGraph(
        inputs=tuple(inputs),
        size_bytes=tuple(0 if op.type in op_types.ALIAS_OP_TYPES or i in customs
                         or is_reference_read(op) else op_bytes(op)
                         for i, op in enumerate(region)),
        reads_source=tuple(reads_source),
        feeds_sink=tuple(op in y_ops for op in region),
        names=tuple(op.name for op in region),
        expensive=tuple(is_expensive(op) for op in region),
        grad_reads_inputs=tuple(reads_inputs),
        grad_reads_output=tuple(i not in shadowed and (
            op_types.gradient_reads_output(op.type) if found is None else found.reads_output)
            for i, (op, found) in enumerate(zip(region, facts))),
        param_bytes=tuple(params),
        views=tuple(op.type in op_types.MEMORY_MODEL_VIEW_OP_TYPES or i in customs
                    for i, op in enumerate(region)),
        costs=tuple(op_flops(op) if found is None else found.cost
                    for op, found in zip(region, facts)),
        unread_inputs=tuple(frozenset(u) if reads else frozenset()
                            for u, reads in zip(unread, reads_inputs)),
        forwards=tuple(op_types.forwards_input_buffer(op.type) for op in region),
        no_gradient=tuple(i in shadowed or not any(carries_gradients(t) for t in op.outputs)
                          for i, op in enumerate(region)),
        internal_saved_bytes=(tuple(0 if found is None or i in shadowed else found.saved_bytes
                                    for i, found in enumerate(facts))
                              if any(f is not None for f in facts) else ()),
        gradients_held=gradients_held,
    )
