"""What conds, loops and function calls of the forward pass keep for the backward pass, read
from their bodies (docs/design.md, note "control flow and calls").

An ``If``/``Case`` (cond_v2), a ``While`` (while_v2) or a ``(Stateful)PartitionedCall`` (a
``tf.function`` called while another graph is traced) runs function graphs. TensorFlow
differentiates it by rewriting the forward op to output what its body's gradient reads:
cond_v2 adds the branch intermediates as outputs (wrapped in optionals), while_v2 pushes every
iteration's intermediates into TensorList accumulators, a call's delayed-rewrite gradient
makes the call output its intermediates. Those values are the memory the op holds between its
forward and its backward step; its visible outputs are a small part of it.

:func:`gradient_facts` models each body with the same op-type rules as the forward region
(``to_forward_graph``, recursively for nested function ops) and sums what the body's gradient
reads: that is ``ForwardGraph.internal_saved_bytes``. It also says which of the op's inputs and
outputs the gradient reads, the op's cost (its body's FLOPs), and, for a loop, what one
iteration keeps when the body is recomputed inside the loop (``loops.recompute_bodies``).

:func:`exposure_plan` says whether a *stateful* cond or call can still be replayed exactly: its
stateful ops are variable reads (whose values the forward op then outputs, and whose gradients a
replay routes to the variables) and random draws that read nothing the gradient flows through
(whose values, or the cheapest values computed from them alone, the forward op outputs); the
replay (``_tf.exposure``) computes everything else again.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import weakref
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import function_def_to_graph
from tensorflow.python.ops import control_flow_util_v2

from memsave_grads._tf import graph as tf_graph
from memsave_grads._tf import ordering
from memsave_grads.core import op_types

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

#: The attribute of a forward op that ``_tf.exposure.expose`` rewrote to output its state
#: (an ``exposure.Exposure``).
EXPOSURE_ATTR = "_memsave_exposure"

#: The input of a while_v2 loop that counts its iterations (the next is the iteration bound).
WHILE_COUNTER_POSITION = 0

#: Iterations a loop counts for when its trip count cannot be read from the graph: the memory
#: model then counts one iteration's saved values (as it did before it looked into loops).
UNKNOWN_TRIP_COUNT = 1


@dataclasses.dataclass(frozen=True)
class GradientFacts:
    """What TensorFlow's gradient of one function-bodied op keeps (module docstring).

    Attributes:
      saved_bytes: bytes of the body intermediates its gradient reads, held from the op's
        forward step to its backward step, beyond its inputs and outputs (a loop: per iteration
        times the trip count; a cond: the largest branch).
      read_inputs: positions of the op's inputs whose values the gradient reads.
      reads_output: the gradient reads the op's own outputs.
      cost: floating-point operations of one run of the op (a loop: every iteration).
      loop: for a loop, one iteration's bytes (:class:`LoopFacts`); None for other ops.
    """

    saved_bytes: int
    read_inputs: frozenset
    reads_output: bool
    cost: float
    loop: "LoopFacts | None" = None


@dataclasses.dataclass(frozen=True)
class LoopFacts:
    """One iteration of a while loop, in bytes (``_tf.loops`` plans its recomputation).

    Attributes:
      trip_count: the iterations, where the graph fixes them (:func:`trip_count`), else None
        (:data:`UNKNOWN_TRIP_COUNT` is counted).
      saved_bytes: what the body's gradient reads, stored per iteration.
      input_bytes: the iteration's differentiable inputs that vary (``recompute`` stores
        them, to replay the iteration).
      state_bytes: the outputs of the body's stateful ops (kept, never replayed).
      read_gradient_bytes: the variables the body reads, each once: while_v2 adds a read
        variable's gradient up densely, one buffer the variable's size per read in each
        backward iteration (a gather's rows included), alive while the iteration runs.
      counted_condition: the condition is a conjunction of counting conditions only, and one
        on a variable of the loop's own sets ``trip_count`` (:func:`trip_count`): the loop runs
        exactly ``trip_count`` iterations, whatever the values it computes, so its body may be
        applied several times per test of the condition.
    """

    trip_count: int | None
    saved_bytes: int
    input_bytes: int
    state_bytes: int
    read_gradient_bytes: int = 0
    counted_condition: bool = False

    @property
    def iterations(self) -> int:
        return UNKNOWN_TRIP_COUNT if self.trip_count is None else self.trip_count


FactsFunction = Callable[[tf.Operation], "GradientFacts | None"]


def is_function_op(op: tf.Operation) -> bool:
    """A cond, loop or function call: an op whose gradient TensorFlow builds from its bodies."""
    return (op.type in op_types.FUNCTION_CALL_OP_TYPES or op.type in op_types.COND_OP_TYPES
            or op.type in op_types.CASE_OP_TYPES or op.type in op_types.WHILE_OP_TYPES)


#: What TensorFlow names the function it wraps a cond or a loop in where a tape may take
#: higher-order gradients of it (``control_flow_util_v2.run_as_function_for_tape_gradients``).
_TAPE_WRAPPER_NAME = "cflow_gradient_wrapper"


def tape_wrapped(op: tf.Operation) -> bool:
    """A function call TensorFlow made around a ``tf.cond`` or ``tf.while_loop`` because a
    persistent tape, nested tapes or a forward accumulator was recording it: the call's
    gradient is TensorFlow's function gradient, which stores what its body's gradient reads
    (a loop: a copy of each variable the body reads, per iteration, unless its reads were
    hoisted while tapes were routed: ``loops.hoist_reads_in_tape_wrappers``), and the plan
    treats it as one op (docs/usage.md, "Tapes that TensorFlow wraps")."""
    if op.type not in op_types.FUNCTION_CALL_OP_TYPES:
        return False
    try:
        return _TAPE_WRAPPER_NAME in op.get_attr("f").name
    except (ValueError, AttributeError):
        return False


def loop_reads_variables(call: tf.Operation) -> bool:
    """Whether a loop that function call ``call`` runs reads a variable in its body (what
    TensorFlow's gradient of the call then stores per iteration; :func:`tape_wrapped`).
    TensorFlow builds a wrapped loop's gradient when the call is recorded, so the loop is no
    longer :func:`untouched_loop` by then: its body is read as it is."""
    for graph in body_graphs(call) or ():
        for op in graph.get_operations():
            if op.type in op_types.WHILE_OP_TYPES and any(
                    inner.type in op_types.VARIABLE_READ_OP_TYPES
                    for body in body_graphs(op) or () for inner in body.get_operations()):
                return True
    return False


def is_tape_wrapper_graph(graph) -> bool:
    """Whether ``graph`` is the function TensorFlow traces around a cond or loop for a tape
    (:func:`tape_wrapped`'s call runs it)."""
    return bool(getattr(graph, "building_function", False)) and _TAPE_WRAPPER_NAME in graph.name


def _function_graph(op: tf.Operation, attr_value, input_shapes, cached: str | None):
    """The FuncGraph of one function attribute of ``op``: the graph cond_v2/while_v2 cached on
    the op, or the one ``tf.function`` traced, else one rebuilt from the function library."""
    if cached is not None and getattr(op, cached, None) is not None:
        return getattr(op, cached)
    name = attr_value.name
    function = tf_graph.library_function(op.graph, name)
    if function is None:
        return None
    traced = getattr(function, "graph", None)
    if traced is not None and cached is None:
        return traced
    with op.graph.as_default():
        return function_def_to_graph.function_def_to_graph(
            function.cached_definition, input_shapes=input_shapes)


def body_graphs(op: tf.Operation) -> list | None:
    """The function graphs ``op`` runs: a call's function, a cond's branches (then, else / the
    cases), a loop's body; None where they cannot be read."""
    try:
        if op.type in op_types.FUNCTION_CALL_OP_TYPES:
            graphs = [_function_graph(op, op.get_attr("f"), [t.shape for t in op.inputs], None)]
        elif op.type in op_types.COND_OP_TYPES:
            shapes = [t.shape for t in op.inputs[1:]]
            cached = getattr(op, "_true_graph", None), getattr(op, "_false_graph", None)
            graphs = [c if c is not None else control_flow_util_v2.get_func_graph(
                op, shapes, op.get_attr(attr).name)
                for c, attr in zip(cached, ("then_branch", "else_branch"))]
        elif op.type in op_types.CASE_OP_TYPES:
            shapes = [t.shape for t in op.inputs[1:]]
            graphs = [getattr(op, f"_branch_graph_{i}", None)
                      or control_flow_util_v2.get_func_graph(op, shapes, f.name)
                      for i, f in enumerate(op.get_attr("branches"))]
        elif op.type in op_types.WHILE_OP_TYPES:
            shapes = [tf.TensorShape(s) for s in op.get_attr("output_shapes")]
            graphs = [getattr(op, "_body_graph", None) or control_flow_util_v2.get_func_graph(
                op, shapes, op.get_attr("body").name)]
        else:
            return None
    except (AttributeError, ValueError, KeyError, TypeError) as e:
        _LOG.debug("memsave_grads: cannot read the functions of %s (%s): %s", op.name,
                   op.type, e)
        return None
    return None if any(g is None for g in graphs) else graphs


def body_outputs(op: tf.Operation, body) -> list:
    """The outputs of ``body`` that are ``op``'s: the first ``len(op.outputs)``. TensorFlow's
    gradient of *another* call of the same function appends that call's intermediates to the
    traced graph's outputs, which this call does not output."""
    return list(body.outputs[:len(op.outputs)])


def cond_graph(op: tf.Operation):
    """A while op's condition graph."""
    cached = getattr(op, "_cond_graph", None)
    if cached is not None:
        return cached
    shapes = [tf.TensorShape(s) for s in op.get_attr("output_shapes")]
    return control_flow_util_v2.get_func_graph(op, shapes, op.get_attr("cond").name)


def input_offset(op: tf.Operation) -> int:
    """Inputs of ``op`` before the ones its body graphs receive: a cond's predicate or branch
    index."""
    return 1 if op.type in op_types.COND_OP_TYPES | op_types.CASE_OP_TYPES else 0


@dataclasses.dataclass(frozen=True)
class _BodyFacts:
    saved_bytes: int
    read_placeholders: frozenset  # positions in body.inputs
    reads_output: bool
    cost: float
    #: (a loop body) its varying differentiable inputs, its stateful outputs, and its variable
    #: reads' dense gradient buffers, in bytes (``LoopFacts``).
    input_bytes: int = 0
    state_bytes: int = 0
    read_gradient_bytes: int = 0


def _passes_through(t: tf.Tensor) -> tf.Tensor:
    while t.op.type in op_types.VIEW_OP_TYPES and t.op.inputs:
        t = t.op.inputs[0]
    return t


def untouched_loop(op: tf.Operation) -> bool:
    """A while_v2 loop as its builder made it: no gradient of it built yet (while_v2 renames
    the functions of a loop whose gradient it built "..._rewritten") and not itself a gradient
    loop (a second derivative's region: "<forward>_grad_<uid>")."""
    if op.type not in op_types.WHILE_OP_TYPES or tf_graph.uses_v1_control_flow(op):
        return False
    return not (gradient_built(op) or re.search(r"_grad_\d+$", op.get_attr("body").name))


def gradient_built(op: tf.Operation) -> bool:
    """A while_v2 loop whose gradient was built already (while_v2 renamed its functions
    "..._rewritten" to output what the gradient stores)."""
    return (op.type in op_types.WHILE_OP_TYPES and not tf_graph.uses_v1_control_flow(op)
            and op.get_attr("body").name.endswith("_rewritten"))


def hoistable_reads(op: tf.Operation) -> dict:
    """The whole-variable reads of loop ``op``'s body that may run once before the loop
    instead (design note "loop reads under XLA"), by the position of the handle they read
    among the body's inputs: reads of a handle the body passes on unchanged, in a body whose
    variable handles are only read (no write, no nested function receiving one: every
    iteration reads the same value), where no op made after the loop writes the variable (a
    read made now must see what the loop saw), in a loop whose condition has no stateful op
    but reads. Empty where the loop is not :func:`untouched_loop`, its body holds a custom
    gradient or cannot be read."""
    if not untouched_loop(op) or tf_graph.loop_body_has_custom_gradient(op):
        # A custom gradient (recompute(), Keras cells under wrap_model) is a Python function
        # over the body's own tensors: a rebuilt body would leave it reading the old one.
        return {}
    graphs = body_graphs(op)
    if not graphs:
        return {}
    (body,) = graphs
    if not _condition_only_reads(cond_graph(op)):
        return {}
    invariant = loop_invariant_positions(body, body_outputs(op, body))
    found: dict = {}
    for i, t in enumerate(body.inputs):
        if t.dtype != tf.resource:
            continue
        users = t.consumers()
        if any(not tf_graph.is_handle_gradient_read(u) for u in users):
            return {}
        reads = [u for u in users if u.type in op_types.VARIABLE_READ_OP_TYPES]
        if i in invariant and reads and _no_write_since(op, op.inputs[i]):
            found[i] = reads
    return found


def _condition_only_reads(condition) -> bool:
    """Whether a loop's condition has no effect but its value: no stateful op but handle
    reads. The hoist rebuilds the condition too, and one that writes a variable
    (``c.assign_add(1)`` at each test) changes what the body reads from one iteration to
    the next; rebuilt, such a write had been lost (a review found the loop computing zeros)."""
    return condition is not None and all(
        not o._is_stateful or tf_graph.is_handle_gradient_read(o)  # pylint: disable=protected-access
        for o in condition.get_operations())


def _no_write_since(op: tf.Operation, handle: tf.Tensor) -> bool:
    """No op made after loop ``op`` takes ``handle`` but to read it."""
    since = tf_graph.creation_index(op)
    return all(tf_graph.creation_index(user) < since or user is op
               or user.type in op_types.HANDLE_GRADIENT_READ_OP_TYPES
               for user in handle.consumers())


def loop_invariant_positions(body, outputs) -> set[int]:
    """Body inputs a while body passes on unchanged (captured values, the iteration bound)."""
    inputs = {t.ref(): i for i, t in enumerate(body.inputs)}
    out = set()
    for i, t in enumerate(outputs):
        source = _passes_through(t)
        if inputs.get(source.ref()) == i:
            out.add(i)
    return out


def _body_facts(body, outputs, facts: FactsFunction, loop: bool,
                copies_reads: bool = False, hoisted: frozenset = frozenset()) -> _BodyFacts:
    """Model one body graph (its op's ``outputs`` among the graph's): what its gradient reads
    (the module docstring). ``copies_reads``: a variable's value the gradient reads is a
    buffer of its own, not the variable's (an XLA conditional outputs it, an XLA loop's
    accumulator copies it), except for the ``hoisted`` reads (made once before the loop)."""
    placeholders = list(body.inputs)
    position = {t.ref(): i for i, t in enumerate(placeholders)}
    invariant = loop_invariant_positions(body, outputs) if loop else set()
    xs = [t for t in placeholders if tf_graph.carries_gradients(t)]
    ys = [t for t in outputs if tf_graph.carries_gradients(t)]
    cost = sum(_op_cost(op, facts) for op in body.get_operations())
    region = tf_graph.forward_region(ys, xs)
    if not region:
        return _BodyFacts(0, frozenset(), False, cost)
    model = tf_graph.to_forward_graph(region, xs, ys, function_facts=facts)
    consumers = model.consumers()
    index = {op: i for i, op in enumerate(region)}
    output_refs = {_passes_through(t).ref() for t in outputs}

    def read_by_gradient(v: int) -> bool:
        return model.gradient_reads_output(v) or any(
            model.gradient_reads_input(c, v) for c in consumers[v])

    saved, reads_output = 0, False
    for v, op in enumerate(region):
        saved += model.internal_saved(v)
        if (copies_reads and op.type in op_types.VARIABLE_READ_OP_TYPES and op not in hoisted
                and read_by_gradient(v)):
            saved += tf_graph.tensor_bytes(op.outputs[0])  # 0 in the model: it aliases
            continue
        if model.is_view(v) or not model.size_bytes[v] or not read_by_gradient(v):
            continue
        if not loop and any(t.ref() in output_refs for t in op.outputs):
            reads_output = True  # the op's visible output: no extra bytes
            continue
        if op.type == "Const":
            continue
        saved += model.size_bytes[v]
    # Values from outside the region that the gradient reads: placeholders (the op's inputs;
    # in a loop, one value per iteration), and values computed from neither (dropout's mask).
    differentiable = {t.ref() for t in xs} | {t.ref() for op in region for t in op.outputs}
    read_positions: set[int] = set()
    counted: set = set()
    for op in region:
        flags = [t.ref() in differentiable for t in op.inputs]
        static = all(t.shape.is_fully_defined() for t in (*op.inputs, *op.outputs)
                     if t.dtype != tf.resource)
        if not model.carries_gradient(index[op]):
            continue
        for i, t in enumerate(op.inputs):
            if t.op in index:
                continue
            source = _passes_through(t)
            if op.type in op_types.MEMORY_MODEL_VIEW_OP_TYPES:
                reads = read_by_gradient(index[op])
            else:
                reads = input_read_by_gradient(op, i, flags, static, facts)
            if not reads:
                continue
            if source.ref() in position:
                read_positions.add(position[source.ref()])
            elif (source.ref() not in counted and source.op.type != "Const"
                  and (source.op.type not in op_types.ALIAS_OP_TYPES
                       or (copies_reads and source.op.type in op_types.VARIABLE_READ_OP_TYPES
                           and source.op not in hoisted))):
                counted.add(source.ref())
                saved += tf_graph.tensor_bytes(source)
    input_bytes = state_bytes = read_gradient_bytes = 0
    if loop:
        per_iteration = sum(tf_graph.tensor_bytes(placeholders[i]) for i in read_positions
                            if i not in invariant and placeholders[i].dtype != tf.resource)
        saved += per_iteration
        # Recomputed in the backward iteration (memsave_grads.recompute): each iteration keeps
        # its differentiable inputs and its stateful ops' outputs.
        input_bytes = sum(tf_graph.tensor_bytes(t) for i, t in enumerate(placeholders)
                          if i not in invariant and _differentiable_value(t))
        state_bytes = sum(tf_graph.op_bytes(op) for op in body.get_operations()
                          if not tf_graph.is_replayable(op)
                          and op.type not in op_types.FEED_OP_TYPES
                          and op.type not in op_types.ALIAS_OP_TYPES)
        read_gradient_bytes = sum(tf_graph.variable_bytes(op.inputs[0])
                                  for op in body.get_operations()
                                  if tf_graph.is_handle_gradient_read(op))
        saved += read_gradient_bytes
        read_positions -= set(range(len(placeholders))) - invariant
    return _BodyFacts(saved, frozenset(read_positions), reads_output, cost, input_bytes,
                      state_bytes, read_gradient_bytes)


def _differentiable_value(t: tf.Tensor) -> bool:
    return tf_graph.carries_gradients(t) and t.dtype not in (tf.resource, tf.variant)


def input_read_by_gradient(op: tf.Operation, index: int, differentiable: Sequence[bool],
                           static_shapes: bool, facts: FactsFunction | None) -> bool:
    """Whether ``op``'s gradient reads its input ``index``: the op-type rule
    (``op_types.gradient_reads_input``), or, for a function op, its body's
    (:func:`gradient_facts`)."""
    found = facts(op) if facts is not None and is_function_op(op) else None
    if found is not None:
        return index in found.read_inputs
    return op_types.gradient_reads_input(op.type, index, list(differentiable), static_shapes)


def _op_cost(op: tf.Operation, facts: FactsFunction) -> float:
    found = facts(op) if is_function_op(op) else None
    return found.cost if found is not None else tf_graph.op_flops(op)


def trip_count(op: tf.Operation, body, cond) -> tuple[int | None, bool]:
    """A while op's iterations where the graph fixes them, and whether its condition is made
    of counting conditions alone: each a comparison ``i < n`` (``<=``) of a loop variable that
    starts at a constant and grows by a constant step with a constant ``n`` (while_v2's own
    ``maximum_iterations`` test is one), joined by ``logical_and``, the fewest iterations set
    by one of the loop's own variables. Then the loop runs exactly that many iterations.
    Otherwise a constant ``maximum_iterations`` bounds it (not exact), or nothing is known:
    ``(None, False)``."""
    outputs = body_outputs(op, body)
    leaves, exact = [], True  # (iterations, loop variable position)
    stack = [_passes_through(cond.outputs[0])]
    while stack:
        t = stack.pop()
        if t.op.type == "LogicalAnd":
            stack.extend(_passes_through(u) for u in t.op.inputs)
            continue
        found = _counting_condition(op, t, cond, outputs)
        if found is None:
            exact = False
        else:
            leaves.append(found)
    if leaves and exact:
        count = min(n for n, _ in leaves)
        # The bound must come from the loop's own variables: while_v2's iteration counter
        # (position 0) counts the body's runs, which a rewritten body may change.
        return count, any(n == count and i != WHILE_COUNTER_POSITION for n, i in leaves)
    bound = static_value(op.inputs[1]) if len(op.inputs) > 1 else None
    counts = [n for n, _ in leaves] + ([int(bound)] if bound is not None and int(bound) >= 0
                                       else [])
    return (min(counts) if counts else None), False


def _counting_condition(op, t, cond, outputs) -> tuple[int, int] | None:
    """(iterations, loop variable) of a condition ``i < n`` / ``i <= n`` (see
    :func:`trip_count`), or None where ``t`` is not one."""
    if t.op.type not in ("Less", "LessEqual"):
        return None
    positions = {u.ref(): i for i, u in enumerate(cond.inputs)}
    var, limit = (_passes_through(u) for u in t.op.inputs)
    i = positions.get(var.ref())
    if i is None or not var.dtype.is_integer:
        # A float counter adds in its own precision (0.1 three times is not 0.3): the count
        # computed here could be off by one.
        return None
    limit_value = _static_value_in(limit, positions, op, outputs)
    start = tf.get_static_value(op.inputs[i])
    step = _constant_step(op, outputs, i)
    if limit_value is None or start is None or step is None or step <= 0:
        return None
    # In integers (a float loses int64 counts past 2**53), and only where the counter's last
    # value, the one that ends the loop, is in its type's range (past it, it wraps around).
    start, step = int(start), int(step)
    span = int(limit_value) - start + (1 if t.op.type == "LessEqual" else 0)
    count = max(0, -(-span // step))
    if start + count * step > var.dtype.max:
        return None
    return count, i


def _static_value_in(t, positions, op, outputs):
    """The constant value of ``t`` in a condition graph: a constant, or a loop input that is
    one (a captured bound) and that the body passes on unchanged (a bound the body lowers is
    not the count)."""
    value = tf.get_static_value(t) if t.op.type == "Const" else None
    if value is not None:
        return value
    i = positions.get(t.ref())
    if i is None or i >= len(outputs):
        return None
    body_input = outputs[i].graph.inputs[i]
    if _passes_through(outputs[i]).ref() != body_input.ref():
        return None
    return static_value(op.inputs[i])


#: Integer arithmetic :func:`static_value` folds (AutoGraph computes ``tf.range``'s length,
#: its loop's ``maximum_iterations``, with these): op type -> NumPy function, whose integer
#: semantics are TensorFlow's (floor division and a modulo of the divisor's sign).
_FOLDED_INTEGER_OPS = {
    "Add": np.add, "AddV2": np.add, "Sub": np.subtract, "Mul": np.multiply,
    "FloorDiv": np.floor_divide, "FloorMod": np.mod, "Maximum": np.maximum,
    "Minimum": np.minimum, "Equal": np.equal, "NotEqual": np.not_equal, "Less": np.less,
    "LessEqual": np.less_equal, "Greater": np.greater, "GreaterEqual": np.greater_equal}
#: How many ops deep :func:`static_value` folds.
_FOLD_DEPTH = 8


def static_value(t: tf.Tensor, depth: int = _FOLD_DEPTH):
    """``tf.get_static_value(t)``, which also folds a ``Max``/``Min`` of constants (Keras 3
    bounds its recurrent loops by ``maximum_iterations=max(time steps)``, a reduction of a
    constant over constant axes) and integer arithmetic on constants
    (:data:`_FOLDED_INTEGER_OPS`, casts between integers and booleans)."""
    value = tf.get_static_value(t)
    if value is not None or depth <= 0:
        return value
    if t.op.type in _FOLDED_INTEGER_OPS or t.op.type == "Cast":
        return _folded_integer(t, depth)
    if t.op.type not in ("Max", "Min"):
        return value
    data, axes = (tf.get_static_value(u) for u in t.op.inputs)
    if data is None or axes is None:
        return None
    data = np.asarray(data)
    axes = tuple(int(a) % data.ndim for a in np.atleast_1d(axes)) if data.ndim else ()
    if not axes:
        return data
    if len(set(axes)) != len(axes) or any(data.shape[a] == 0 for a in axes):
        return None  # TensorFlow's error, at run time; an empty max: no count
    reduce = np.max if t.op.type == "Max" else np.min
    return reduce(data, axis=axes, keepdims=t.op.get_attr("keep_dims"))


def _folded_integer(t: tf.Tensor, depth: int):
    """:func:`static_value` of an integer op of constants, or None (floats are not folded:
    NumPy's rounding need not be the kernel's; nor a division by zero)."""
    if not all(u.dtype.is_integer or u.dtype == tf.bool for u in (*t.op.inputs, t)):
        return None
    values = [static_value(u, depth - 1) for u in t.op.inputs]
    if any(v is None for v in values):
        return None
    values = [np.asarray(v) for v in values]
    if t.op.type == "Cast":
        return values[0].astype(t.dtype.as_numpy_dtype)
    if t.op.type in ("FloorDiv", "FloorMod") and np.any(values[1] == 0):
        return None
    with np.errstate(all="ignore"):  # integers wrap around in both, alike
        out = _FOLDED_INTEGER_OPS[t.op.type](*values)
    return np.asarray(out, dtype=t.dtype.as_numpy_dtype)


def _constant_step(op, outputs, i: int):
    """The constant a while body adds to loop variable ``i`` each iteration, or None: a
    constant, or a loop input that is one (AutoGraph's ``for i in tf.range(n)`` adds the
    range's step, captured)."""
    body = _passes_through(outputs[i]).op
    if body.type not in ("Add", "AddV2"):
        return None
    inputs = outputs[i].graph.inputs
    mine = inputs[i].ref()
    positions = {u.ref(): j for j, u in enumerate(inputs)}
    a, b = (_passes_through(t) for t in body.inputs)
    if a.ref() == mine:
        return _static_value_in(b, positions, op, outputs)
    if b.ref() == mine:
        return _static_value_in(a, positions, op, outputs)
    return None


#: op -> ((assumed batch size, outputs), facts): a body is modelled once per trace, however
#: often the planners ask (nested bodies are asked by every enclosing one). The key notices a
#: rewritten op (a gradient built since adds outputs).
_FACTS_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def gradient_facts(op: tf.Operation) -> GradientFacts | None:
    """What TensorFlow's gradient of function op ``op`` keeps (the module docstring); None for
    other ops, or where its bodies cannot be read."""
    if not is_function_op(op):
        return None
    key = (tf_graph.current_assumed_batch_size(), len(op.outputs))
    cached = _FACTS_CACHE.get(op)
    if cached is not None and cached[0] == key:
        return cached[1]
    found = _gradient_facts(op)
    _FACTS_CACHE[op] = (key, found)
    return found


def _gradient_facts(op: tf.Operation) -> GradientFacts | None:
    graphs = body_graphs(op)
    if graphs is None:
        return None
    loop = op.type in op_types.WHILE_OP_TYPES
    try:
        # Under XLA cond_v2 outputs every branch's intermediates, zeros where another branch
        # ran: buffers of the conditional's own, variable reads copied.
        xla_conditional = not loop and ordering.xla_in_effect(op.graph) and (
            op.type in op_types.COND_OP_TYPES or op.type in op_types.CASE_OP_TYPES)
        # Under XLA a loop's gradient stores a copy of every value its body reads from a
        # variable, per iteration, unless the read runs before the loop (``loops.
        # hoist_reads``, design note "loop reads under XLA").
        xla_loop = loop and ordering.xla_in_effect(op.graph)
        hoisted = frozenset(read for reads in hoistable_reads(op).values() for read in reads
                            ) if xla_loop else frozenset()
        bodies = [_body_facts(g, body_outputs(op, g), gradient_facts, loop,
                              xla_conditional or xla_loop, hoisted)
                  for g in graphs]
    except (ValueError, TypeError, AttributeError) as e:  # a body we cannot model
        _LOG.debug("memsave_grads: cannot model the body of %s: %s", op.name, e)
        return None
    offset = input_offset(op)
    read = frozenset(i + offset for b in bodies for i in b.read_placeholders)
    if not loop:
        # A cond runs one branch: its gradient keeps the larger branch's values (the other's
        # optionals are empty), its cost is the costlier branch's. Where only some branches'
        # gradients read the op's outputs, those count as their branch's saved bytes.
        reads_output = all(b.reads_output for b in bodies)
        output_bytes = sum(tf_graph.tensor_bytes(t) for t in op.outputs)
        if xla_conditional:  # every branch's values (above), the outputs once
            saved = sum(b.saved_bytes for b in bodies) + (
                output_bytes if any(b.reads_output for b in bodies) and not reads_output else 0)
        else:
            saved = max(b.saved_bytes + (output_bytes if b.reads_output and not reads_output
                                         else 0) for b in bodies)
        return GradientFacts(saved_bytes=saved, read_inputs=read, reads_output=reads_output,
                             cost=max(b.cost for b in bodies))
    (body,) = bodies
    try:
        count, exact = trip_count(op, graphs[0], cond_graph(op))
    except (AttributeError, ValueError, KeyError, TypeError):
        count, exact = None, False
    loop = LoopFacts(trip_count=count, saved_bytes=body.saved_bytes - body.read_gradient_bytes,
                     input_bytes=body.input_bytes, state_bytes=body.state_bytes,
                     read_gradient_bytes=body.read_gradient_bytes, counted_condition=exact)
    # The reads' gradient buffers are there for one backward iteration at a time.
    return GradientFacts(saved_bytes=loop.iterations * loop.saved_bytes
                         + loop.read_gradient_bytes, read_inputs=read, reads_output=False,
                         cost=loop.iterations * body.cost, loop=loop)


# --------------------------------------------------------------------------------------------
# Replay by exposure: which stateful conds and calls a plan may recompute, and with what
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NestedExposure:
    """A stateful cond or call inside a body that is itself replayed by exposure: the copy
    of ``op`` in the exposed body outputs its own state (``bodies``), which the enclosing op
    then outputs after the body's other exposed values; the replay replays ``op`` from them.

    ``in_optionals``: a cond's values travel in optionals (outside XLA), as at the top level
    (``_tf.exposure.Exposure``)."""

    op: object
    bodies: tuple
    in_optionals: bool

    @property
    def exposed_count(self) -> int:
        """How many values the exposed copy of ``op`` outputs in addition: every body's."""
        return sum(b.exposed_count for b in self.bodies)

    def value_specs(self) -> list:
        """(dtype, shape) of each value it outputs in addition, in order."""
        if self.in_optionals and self.op.type not in op_types.FUNCTION_CALL_OP_TYPES:
            return [(tf.variant, tf.TensorShape([]))] * self.exposed_count
        return [spec for b in self.bodies for spec in b.value_specs()]


@dataclasses.dataclass(frozen=True)
class BodyExposure:
    """How one body of a stateful cond or call is replayed (``_tf.exposure``).

    Attributes:
      graph: the body's function graph.
      outputs: its outputs that are the op's (``body_outputs``).
      reads: its variable reads (``op_types.HANDLE_GRADIENT_READ_OP_TYPES``) of a handle the
        body receives:
        the forward op outputs each value (and a gather's indices); the replay reads them and
        routes their gradients to the handle.
      exposed: values computed from random draws and constants alone that the differentiated
        ops read: the forward op outputs them, the replay reads them (the cheapest such cut:
        dropout's boolean mask, not its uniform draw).
      dropped: stateful ops the replay leaves out (their outputs feed nothing it computes:
        assignments, prints of values computed before).
      nested: the stateful conds and calls inside it (a Keras layer's call calling a
        sublayer's, a function calling a function), each replayed by exposure in turn.
    """

    graph: object
    outputs: tuple
    reads: tuple
    exposed: tuple
    dropped: frozenset
    nested: tuple = ()

    @property
    def exposed_values(self) -> list:
        """The body's own tensors the forward op outputs in addition, in order: read values,
        gather indices, then the exposed values (the nested ops' values follow them,
        :attr:`exposed_count`)."""
        out = [read.outputs[0] for read in self.reads]
        out += [read.inputs[1] for read in self.reads if read.type != "ReadVariableOp"]
        return out + list(self.exposed)

    @property
    def exposed_count(self) -> int:
        """How many values the forward op outputs in addition for this body, nested ones
        included."""
        return len(self.exposed_values) + sum(n.exposed_count for n in self.nested)

    def value_specs(self) -> list:
        """(dtype, shape) of each of the :attr:`exposed_count` values, in order."""
        return ([(t.dtype, t.shape) for t in self.exposed_values]
                + [spec for n in self.nested for spec in n.value_specs()])

    def exposed_bytes(self, xla: bool, as_buffers: bool = False) -> int:
        """Bytes the forward op holds in addition for this body: reads of a variable alias
        it (none) unless the values are copied into buffers of their own (``as_buffers``);
        nested ops as :func:`exposure_bytes` counts them."""
        own = sum(tf_graph.tensor_bytes(t) for t in self.exposed_values
                  if as_buffers or t.op.type not in op_types.ALIAS_OP_TYPES)
        return own + sum(exposure_bytes(n.op, n.bodies, xla, as_buffers) for n in self.nested)


def exposure_bytes(op: tf.Operation, bodies: Sequence[BodyExposure], xla: bool,
                   as_buffers: bool = False) -> int:
    """Bytes a stateful cond or call replayed by exposure outputs in addition: a call's body's;
    a cond's largest branch's (one branch runs). Under XLA a conditional's outputs are buffers
    of its own, all of them written by the branch that runs (zeros for the other branches'
    values, ``_tf.exposure``): every branch's values, a variable read's too."""
    if op.type not in op_types.FUNCTION_CALL_OP_TYPES and xla:
        return sum(b.exposed_bytes(xla, as_buffers=True) for b in bodies)
    return max(b.exposed_bytes(xla, as_buffers) for b in bodies)


def exposure_plan(op: tf.Operation, xla: bool | None = None,
                  nested: bool = False) -> list[BodyExposure] | None:
    """How to replay a *stateful* cond or call exactly, one entry per body; None where it
    cannot be (module docstring), or where it needs no exposure (a stateless op: copied as it
    is). Under XLA (``xla``; default: whether XLA compiles ``op``'s graph), where cond_v2's
    optionals do not compile, a cond's branches output each other's values as zeros
    (``_tf.exposure.expose``), so those values need static shapes. Not for a call compiled on
    its own (``jit_compile``), not for an op whose gradient was already built."""
    if not (op.type in op_types.FUNCTION_CALL_OP_TYPES or op.type in op_types.COND_OP_TYPES
            or op.type in op_types.CASE_OP_TYPES):
        return None
    done = getattr(op, EXPOSURE_ATTR, None)
    if done is not None:  # rewritten already (``_tf.exposure.expose``): the same plan
        return list(done.bodies)
    if tf_graph.is_replayable(op) or tf_graph.uses_v1_control_flow(op):
        return None
    if _compiled_alone(op) or (_gradient_built(op) and not nested):
        return None
    graphs = body_graphs(op)
    if graphs is None:
        return None
    if xla is None:
        xla = ordering.xla_in_effect(op.graph)
    plans = []
    for body in graphs:
        plan = _body_exposure(body, body_outputs(op, body), xla)
        if plan is None:
            return None
        plans.append(plan)
    if (len(plans) > 1 and xla
            and not all(shape.is_fully_defined() for p in plans for _, shape in p.value_specs())):
        # Under XLA a branch gives zeros for the other branches' values (no optionals there):
        # of static shape only.
        return None
    return plans


def kept_compiled_calls(region: Sequence[tf.Operation]) -> list[tf.Operation]:
    """The stateful calls of ``jit_compile`` functions in ``region`` (a block reading its
    weights): never replayed (:func:`exposure_plan` leaves a call compiled on its own as XLA
    has it), so kept with all they hold for their gradients."""
    return [op for op in region if op.type in op_types.FUNCTION_CALL_OP_TYPES
            and not tf_graph.is_replayable(op) and _compiled_alone(op)
            and getattr(tf_graph.library_function(op.graph, op.get_attr("f").name), "graph",
                        None) is not None]


def _compiled_alone(op: tf.Operation) -> bool:
    """A call of a ``jit_compile`` function (left to XLA as it is), or of one whose traced
    graph is gone (imported: its nested calls have no gradient functions to copy)."""
    if op.type not in op_types.FUNCTION_CALL_OP_TYPES:
        return False
    function = tf_graph.library_function(op.graph, op.get_attr("f").name)
    definition = getattr(function, "cached_definition", None)
    attr = definition.attr.get("_XlaMustCompile") if definition is not None else None
    return bool(attr is not None and attr.b) or getattr(function, "graph", None) is None


def _gradient_built(op: tf.Operation) -> bool:
    """TensorFlow already rewrote ``op`` to output its intermediates (a gradient of it was
    built): its outputs are no longer the body's, so it is left as it is."""
    if op.type in op_types.FUNCTION_CALL_OP_TYPES:
        return op.get_attr("f").name.startswith("__forward_")
    names = ([op.get_attr("then_branch").name, op.get_attr("else_branch").name]
             if op.type in op_types.COND_OP_TYPES else [f.name for f in op.get_attr("branches")])
    return any(name.endswith("_rewritten") for name in names)


def _body_exposure(body, outputs, xla: bool) -> BodyExposure | None:
    placeholders = {t.ref() for t in body.inputs}
    xs = [t for t in body.inputs if _differentiable_value(t)]
    ys = [t for t in outputs if tf_graph.carries_gradients(t)]
    region = set(tf_graph.forward_region(ys, xs)) if xs and ys else set()
    region_values = {t.ref() for t in xs} | {t.ref() for op in region for t in op.outputs}
    output_refs = {t.ref() for t in outputs}
    reads, draws, dropped, nested = [], [], set(), []
    for op in body.get_operations():
        if op.type in op_types.FEED_OP_TYPES or tf_graph.is_replayable(op):
            continue
        used = any(t.consumers() or t.ref() in output_refs for t in op.outputs)
        if tf_graph.is_handle_gradient_read(op) and op.inputs[0].ref() in placeholders:
            reads.append(op)
        elif not used:
            dropped.add(op)
        elif is_function_op(op):
            inner = exposure_plan(op, xla, nested=True)  # a stateful call or cond: in turn
            if inner is None:
                return None  # a stateful loop, or a body that cannot be replayed
            nested.append(NestedExposure(op, tuple(inner), in_optionals=(
                op.type not in op_types.FUNCTION_CALL_OP_TYPES and not xla)))
        elif any(t.ref() in region_values for t in op.inputs):
            return None  # it reads what the gradient flows through: it would have to rerun
        else:
            draws.append(op)
    exposed = _state_cut(body, draws, region, output_refs)
    if exposed is None:
        return None
    return BodyExposure(body, tuple(outputs), tuple(reads), tuple(exposed), frozenset(dropped),
                        tuple(nested))


def _state_cut(body, draws, region, output_refs) -> list | None:
    """The values computed from ``draws`` (and constants) that the differentiated ops or the
    body's outputs read, pushed back to cheaper inputs where all of a producer's inputs are
    such values themselves; None where one of them also depends on a variable read (its
    gradient would be lost)."""
    if not draws:
        return []
    derived = {op for op in tf_graph.walk(draws, tf_graph.consumer_ops)
               if op not in region}
    cut = {}
    for op in derived:
        for t in op.outputs:
            if t.ref() in output_refs or any(c in region for c in t.consumers()):
                cut[t.ref()] = t
    changed = True
    while changed:
        changed = False
        for key, t in list(cut.items()):
            producer = t.op
            if producer in draws or not producer.inputs:
                continue
            inputs = [u for u in producer.inputs if u.op in derived]
            others = [u for u in producer.inputs if u.op not in derived]
            if any(tf_graph.carries_gradients(u) and u.op.type not in ("Const",)
                   and u.dtype not in (tf.int32, tf.int64) for u in others):
                continue  # a producer that also reads another value: keep its output
            if sum(tf_graph.tensor_bytes(u) for u in inputs if u.ref() not in cut) \
                    < tf_graph.tensor_bytes(t) and t.ref() not in output_refs:
                del cut[key]
                for u in inputs:
                    cut[u.ref()] = u
                changed = True
    values = sorted(cut.values(), key=lambda t: (tf_graph.creation_index(t.op), t.value_index))
    for t in values:
        upstream = tf_graph.walk([t.op], tf_graph.input_ops)
        if any(op.type in op_types.HANDLE_GRADIENT_READ_OP_TYPES for op in upstream):
            return None
    return values
