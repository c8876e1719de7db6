"""Loops recomputed inside: a while loop's body replayed in its backward iterations, as
``recompute(step)`` does by hand (docs/design.md, note "control flow and calls").

while_v2 stores, per iteration, every value of the body that the body's gradient reads (in
TensorList accumulators that the forward loop fills): for a loop over layers, every layer's
activations, however the plan cuts the graph outside the loop. Where the body keeps less per
iteration when it is recomputed (:func:`chosen`: one iteration's inputs and the outputs of its
stateful ops, against what its gradient reads), the forward loop's body is replaced, before
any gradient of it is built, by the same ops wrapped in :func:`memsave_grads.recompute`
(:func:`recompute_bodies`). The loop computes the same values; its gradient stores each
iteration's inputs and replays the body in the backward iteration, keeping the outputs of its
random draws and variable reads (never drawn or read again).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from typing import Collection, Iterable, Sequence

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util_v2
from tensorflow.python.ops import control_flow_v2_func_graphs

from memsave_grads import recomputation
from memsave_grads._tf import exposure
from memsave_grads._tf import function_ops
from memsave_grads._tf import graph as tf_graph
from memsave_grads._tf import ordering
from memsave_grads._tf import rewrite
from memsave_grads.core import op_types

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

#: A loop's body is recomputed only where the loop then stores at most this fraction of what
#: its gradient stores otherwise: the replay costs one more forward pass of the body.
RECOMPUTED_LOOP_FRACTION = 0.9
#: At most this many copies of a body per iteration of the rewritten loop, and this many ops
#: in them all (graph size).
MAX_UNROLL = 64
MAX_UNROLLED_OPS = 20_000
_RECOMPUTED_ATTR = "_memsave_recomputed_body"
#: On a loop whose reads were hoisted: {input position of a hoisted value: its handle's}.
_HOISTED_ATTR = "_memsave_hoisted_reads"
_counter = itertools.count()


@dataclasses.dataclass(frozen=True)
class LoopPlan:
    """How a loop's body is recomputed (:func:`plan`).

    Attributes:
      unroll: iterations of the original body per iteration of the rewritten one, replayed
        together: 1 stores every iteration's inputs; k stores every k-th iteration's, and
        replays k iterations at a time (checkpoints every k layers of a loop over layers).
      saved_bytes: what the rewritten loop stores, in the memory model's terms: the inputs of
        ``trip_count / unroll`` replays, every iteration's stateful outputs, and one replay's
        saved values and its reads' gradient buffers (while its iterations are
        differentiated).
    """

    unroll: int
    saved_bytes: int


def eligible(op: tf.Operation) -> bool:
    """A while_v2 loop whose body can be recomputed inside: not holding a custom gradient
    already (``recompute(step)``, Keras 3 recurrent layers under ``wrap_model``), no gradient
    of it built yet, not itself a gradient loop, no stateful op of its body reads a value
    computed in the iteration (it would have to run again), and, under XLA, every
    whole-variable read of its body hoisted before the loop (:func:`hoist_reads`; XLA would
    store a copy of each read's value per replay)."""
    if getattr(op, _RECOMPUTED_ATTR, None) is not None:
        return True
    if not function_ops.untouched_loop(op) or tf_graph.loop_body_has_custom_gradient(op):
        return False
    graphs = function_ops.body_graphs(op)
    if not graphs:
        return False
    if ordering.xla_in_effect(op.graph):
        hoisted = {read for reads in function_ops.hoistable_reads(op).values()
                   for read in reads}
        if any(o.type in op_types.VARIABLE_READ_OP_TYPES and o not in hoisted
               for o in graphs[0].get_operations()):
            return False
    return _state_reads_only_fixed_values(graphs[0])


def _state_reads_only_fixed_values(body) -> bool:
    """No stateful op of ``body`` reads a differentiable value computed from its inputs
    (``recompute`` would refuse it: such an op would have to run in the replay)."""
    from_inputs = set(tf_graph.walk([c for t in body.inputs for c in t.consumers()],
                                    tf_graph.consumer_ops))
    inputs = {t.ref() for t in body.inputs}
    for op in body.get_operations():
        if op.type in op_types.FEED_OP_TYPES or tf_graph.is_replayable(op):
            continue
        if function_ops.is_function_op(op):
            return False  # a stateful nested function: replayed only through exposure
        for t in op.inputs:
            if (tf_graph.carries_gradients(t) and t.dtype != tf.resource
                    and (t.ref() in inputs or t.op in from_inputs)):
                return False
    return True


def _unrollable(body, outputs) -> bool:
    """Whether several iterations may run as one: its stateful ops are variable reads only
    (copies of a seeded random op would all draw the first numbers of its sequence), and the
    values a replay needs from outside it, for several iterations in a row, can be computed
    outside it: the reads' inputs and the varying values that carry no gradient (counters)
    are computed from such values and the loop's invariants alone."""
    if any(not tf_graph.is_replayable(op) and op.type not in op_types.FEED_OP_TYPES
           and not tf_graph.is_handle_gradient_read(op) for op in body.get_operations()):
        return False
    invariant = function_ops.loop_invariant_positions(body, outputs)
    differentiable = [t for i, t in enumerate(body.inputs)
                      if i not in invariant and tf_graph.carries_gradients(t)
                      and t.dtype != tf.resource]
    tainted = set(tf_graph.walk([c for t in differentiable for c in t.consumers()],
                                tf_graph.consumer_ops))
    seeds = [op for op in body.get_operations() if tf_graph.is_handle_gradient_read(op)]
    seeds += [t.op for i, t in enumerate(outputs) if i not in invariant
              and not (tf_graph.carries_gradients(t) and t.dtype != tf.resource)]
    return not any(op in tainted for op in seeds)


def plan(op: tf.Operation, region: Collection[tf.Operation] | None = None
         ) -> LoopPlan | None:
    """How to recompute ``op``'s body, or None where that does not store at most
    :data:`RECOMPUTED_LOOP_FRACTION` of what its gradient stores otherwise
    (``function_ops.gradient_facts``). The unroll is the divisor k of the trip count that
    stores least, ``trip_count / k`` replays' inputs plus one replay of k iterations (about
    sqrt(trip count) on a loop over equal layers); 1 where the trip count is not fixed.

    ``region``: the forward ops being differentiated (``tf_graph.forward_region``), which tell
    the tensor lists the body reads whose gradients are made (:func:`_list_copy_bytes`);
    default: every list the body reads."""
    facts = function_ops.gradient_facts(op)
    loop = facts.loop if facts is not None else None
    if loop is None or not facts.saved_bytes:
        return None

    # Under XLA a replay of k iterations holds a copy of each tensor list the body writes
    # per write (the list the replay started from is kept for its gradient), and of the
    # gradient of each list it reads: k copies. A tf.scan of 400 steps (12.5 MiB of
    # outputs): k = 1 38.4 MiB, 2 44.7, 10 140.2; at 800 steps k = 10 peaked above
    # tf.gradients (428 against 326 MiB).
    list_bytes = (_list_copy_bytes(op, loop.iterations, region)
                  if ordering.xla_in_effect(op.graph) else 0)

    def stored(k):
        # The replays' inputs and every iteration's state are stored; one replay of k
        # iterations, and its reads' dense gradient buffers (each variable read once per
        # replay: _merged_reads), are alive while it runs.
        replays = -(-loop.iterations // k)
        return (replays * loop.input_bytes + loop.iterations * loop.state_bytes
                + k * (loop.saved_bytes + list_bytes) + loop.read_gradient_bytes)

    candidates = [1]
    if loop.counted_condition and loop.trip_count and loop.trip_count > 1:
        (body,) = function_ops.body_graphs(op)
        body_ops = len(body.get_operations())
        if _unrollable(body, function_ops.body_outputs(op, body)):
            candidates += [k for k in range(2, min(loop.trip_count, MAX_UNROLL) + 1)
                           if loop.trip_count % k == 0 and k * body_ops <= MAX_UNROLLED_OPS]
    best = min(candidates, key=lambda k: (stored(k), k))
    if stored(best) > RECOMPUTED_LOOP_FRACTION * facts.saved_bytes:
        return None
    return LoopPlan(unroll=best, saved_bytes=stored(best))


#: Ops writing one element of a tensor list: (op type, position of the element among inputs).
_LIST_WRITES = {"TensorListSetItem": 2, "TensorListPushBack": 1}


def _list_copy_bytes(op: tf.Operation, iterations: int,
                     region: Collection[tf.Operation] | None) -> int:
    """The bytes of the tensor lists of loop ``op`` that a replay copies per iteration under
    XLA, each as long as :func:`_list_length` says: those the body writes an element of (a
    TensorArray of outputs: ``tf.scan``'s, a Keras recurrent layer's), and those it reads an
    element of whose gradient is made (a Keras layer's input sequence where an earlier layer
    computed it; ``region`` has its producer; without ``region``, every list read). The
    second layer of two stacked LSTMs replayed 5 steps at a time peaked at 9.1 MiB, one step
    at a time 7.5, before its input list was counted (T = 120, 128 units, batch 16)."""
    graphs = function_ops.body_graphs(op)
    if not graphs:
        return 0
    positions = {t.ref(): i for i, t in enumerate(graphs[0].inputs)}
    total = 0
    for o in graphs[0].get_operations():
        if o.type in _LIST_WRITES:
            grows = o.type == "TensorListPushBack" or (
                o.type == "TensorListSetItem" and _attr(o, "resize_if_index_out_of_bounds"))
            total += (_list_length(op, positions, o.inputs[0], iterations, grows)
                      * tf_graph.tensor_bytes(o.inputs[_LIST_WRITES[o.type]]))
        elif o.type == "TensorListGetItem":
            source = _loop_input(op, positions, o.inputs[0])
            if source is not None and source.dtype == tf.variant and (
                    region is None or source.op in region):
                total += (_list_length(op, positions, o.inputs[0], iterations)
                          * tf_graph.tensor_bytes(o.outputs[0]))
    return total


def _loop_input(op: tf.Operation, positions: dict, handle: tf.Tensor) -> tf.Tensor | None:
    """The input of loop ``op`` that ``handle`` (a list in its body) was passed in as, back
    through the body's earlier writes and identities, and identities before the loop; None
    where the list is made in the body."""
    while handle.op.type in _LIST_WRITES or handle.op.type == "Identity":
        handle = handle.op.inputs[0]
    position = positions.get(handle.ref())
    if position is None or position >= len(op.inputs):
        return None
    source = op.inputs[position]
    while source.op.type == "Identity":
        source = source.op.inputs[0]
    return source


def _list_length(op: tf.Operation, positions: dict, handle: tf.Tensor, iterations: int,
                 grows: bool = False) -> int:
    """How many elements the list behind ``handle`` (a list a body of loop ``op`` reads or
    writes) holds: the size it was reserved with before the loop where that is a constant (a
    Keras 3 recurrent layer that returns only its last output writes every step into a list of
    one, ``return_all_outputs=False``), else one an iteration (a list of unknown size). A list
    the body ``grows`` (pushes onto, or sets past its end) gains one an iteration besides."""
    source = _loop_input(op, positions, handle)
    if source is None or source.op.type != "TensorListReserve":
        return iterations
    size = function_ops.static_value(source.op.inputs[1])
    if size is None or int(size) < 0:
        return iterations
    return int(size) + iterations if grows else int(size)


def _attr(op: tf.Operation, name: str):
    try:
        return op.get_attr(name)
    except ValueError:
        return None


def chosen(region: Iterable[tf.Operation]) -> dict:
    """The loops of ``region`` whose bodies a memory-saving strategy recomputes, with their
    :class:`LoopPlan`."""
    plans = {}
    region = list(region)
    members = frozenset(region)
    for op in region:
        if op.type in op_types.WHILE_OP_TYPES and eligible(op):
            found = getattr(op, _RECOMPUTED_ATTR, None) or plan(op, members)
            if found is not None:
                plans[op] = found
    return plans


def hoist_reads(region: Iterable[tf.Operation], outside_xla: bool = False) -> int:
    """Under XLA, read each variable a loop of ``region`` reads whole once before the loop,
    and pass its value in as a loop invariant (design note "loop reads under XLA"); the loop
    computes the same values. Returns the variables whose reads were hoisted.

    A variable read in a while_v2 body is an intermediate of every iteration, and the loop's
    gradient pushes every intermediate it reads onto an accumulator: outside XLA the pushed
    value aliases the variable's buffer, but XLA's accumulator is a buffer of its own, one
    copy of the weight per iteration (an LSTM cell's kernels, T times). A loop invariant is
    captured by the gradient as it is, never accumulated. Nothing changes outside XLA, unless
    ``outside_xla``: a loop TensorFlow built inside a function call for a tape, whose
    function gradient stores a copy per iteration without XLA too
    (:func:`hoist_reads_in_tape_wrappers`)."""
    hoisted = 0
    for op in region:
        if op.type in op_types.WHILE_OP_TYPES and (outside_xla
                                                   or ordering.xla_in_effect(op.graph)):
            reads = function_ops.hoistable_reads(op)
            if reads:
                _hoist(op, reads)
                hoisted += len(reads)
    return hoisted


#: TensorFlow's ``run_as_function_for_tape_gradients``, read when this module is imported (no
#: call): what the stand-in falls back to where another patcher left it in place after our
#: routing ended.
_TENSORFLOW_BUILDER = control_flow_util_v2.run_as_function_for_tape_gradients
#: The builder ours stands in for while it does, and how many routings and routed tapes
#: asked for ours (:func:`hoist_reads_in_tape_wrappers`).
_tape_wrapper_builder = None
_tape_wrapper_users = 0
_tape_wrapper_lock = threading.Lock()


def hoist_reads_in_tape_wrappers(active: bool) -> None:
    """While some caller is ``active`` (a tape routing: ``patch()``, ``route_tapes()``; a
    recording ``memsave_grads.GradientTape``; each ``True`` ended by a ``False``), each loop
    TensorFlow builds inside a function call for a persistent tape or two tapes at once
    (``cflow_gradient_wrapper``, :func:`function_ops.tape_wrapped`) reads the variables its
    body reads once, before the loop, inside that function (:func:`hoist_reads`; design note
    "tape routing"). The call's gradient is TensorFlow's gradient of a function, built when
    the call is recorded, which stored each read per iteration, with XLA or without (a Keras
    3 ``LSTM(256)`` over 200 steps: 340 MiB, against 91 with the reads hoisted); the plan
    cannot look into the call, but the loop computes the same values, to any order of tape
    gradients."""
    global _tape_wrapper_builder, _tape_wrapper_users
    with _tape_wrapper_lock:
        _tape_wrapper_users = max(0, _tape_wrapper_users + (1 if active else -1))
        if _tape_wrapper_users and _tape_wrapper_builder is None:
            current = control_flow_util_v2.run_as_function_for_tape_gradients
            # Never record our own stand-in as TensorFlow's (one that another patcher put back).
            _tape_wrapper_builder = (_TENSORFLOW_BUILDER if current is _built_with_reads_hoisted
                                     else current)
            control_flow_util_v2.run_as_function_for_tape_gradients = _built_with_reads_hoisted
        elif not _tape_wrapper_users and _tape_wrapper_builder is not None:
            control_flow_util_v2.run_as_function_for_tape_gradients = _tape_wrapper_builder
            _tape_wrapper_builder = None


def _built_with_reads_hoisted(make_op, inputs):
    """TensorFlow's builder, whose op maker also hoists the reads of a loop it makes inside
    the wrapper function (where TensorFlow wraps; elsewhere the op is made as it was)."""
    builder = _tape_wrapper_builder or _TENSORFLOW_BUILDER

    def make_op_hoisting(op_inputs):
        outputs = make_op(op_inputs)
        graph = tf.compat.v1.get_default_graph()
        if function_ops.is_tape_wrapper_graph(graph):
            hoist_reads(graph.get_operations(), outside_xla=True)
        return outputs

    return builder(make_op_hoisting, inputs)


def _hoist(op: tf.Operation, reads: dict) -> None:
    (body,) = function_ops.body_graphs(op)
    cond = function_ops.cond_graph(op)
    positions = sorted(reads)
    # The read waits for what the loop waits for: its control inputs and the ops of its
    # inputs (tf.control_dependencies around a tf.while_loop lands on its initial values).
    waits = list(op.control_inputs) + [t.op for t in op.inputs if t.dtype != tf.resource]
    with op.graph.as_default(), op.graph.control_dependencies(waits):
        values = [tf.raw_ops.ReadVariableOp(resource=op.inputs[i],
                                            dtype=reads[i][0].get_attr("dtype"),
                                            name=f"{op.name}_hoisted_read")
                  for i in positions]
    for value, i in zip(values, positions):
        value.set_shape(reads[i][0].outputs[0].shape)
        tf_graph.made_after_a_consumer(value.op)

    def rebuilt(graph, graph_class, outputs_of, is_body):
        inputs = {t.ref() for t in graph.inputs}
        read_ops = {read for i in positions for read in reads[i]} if is_body else set()
        ops = [o for o in graph.get_operations() if o not in read_ops
               and (o.type not in op_types.FEED_OP_TYPES or o.outputs[0].ref() not in inputs)]

        def build(placeholders):
            extra = [tf.compat.v1.placeholder(v.dtype, v.shape, name="hoisted_read")
                     for v in values]
            replacements = {t.ref(): p for t, p in zip(graph.inputs, placeholders)}
            replacements.update((read.outputs[0].ref(), value)
                                for i, value in zip(positions, extra)
                                for read in (reads[i] if is_body else ()))
            copies = rewrite.copy_ops(ops, "", [], replacements,
                                      graph=tf.compat.v1.get_default_graph())
            placeholders.extend(extra)  # the rebuilt graph's inputs: the loop's, then these

            def mapping(t):
                return (copies[t.op].outputs[t.value_index] if t.op in copies
                        else replacements.get(t.ref(), t))

            return ([mapping(t) for t in outputs_of] + (extra if is_body else []),
                    [copies[o] for o in graph.control_outputs if o in copies])

        return exposure.rebuilt_function_graph(graph, f"{graph.name}_hoisted{next(_counter)}",
                                               op.graph, build, graph_class=graph_class)

    new_body = rebuilt(body, control_flow_v2_func_graphs.WhileBodyFuncGraph,
                       function_ops.body_outputs(op, body), True)
    new_cond = rebuilt(cond, control_flow_v2_func_graphs.WhileCondFuncGraph, cond.outputs,
                       False)
    # As while_v2 adds its accumulators to a loop whose gradient it builds.
    op._set_func_attr("body", control_flow_util_v2.create_new_tf_function(new_body))  # pylint: disable=protected-access
    op._set_func_attr("cond", control_flow_util_v2.create_new_tf_function(new_cond))  # pylint: disable=protected-access
    op._set_type_list_attr("T", [t.dtype for t in new_body.outputs])  # pylint: disable=protected-access
    op._set_shape_list_attr("output_shapes", [t.shape for t in new_body.outputs])  # pylint: disable=protected-access
    op._add_while_inputs(values)  # pylint: disable=protected-access
    op._add_outputs([v.dtype for v in values], [v.shape for v in values])  # pylint: disable=protected-access
    op._set_attr("_num_original_outputs", attr_value_pb2.AttrValue(i=len(op.outputs)))  # pylint: disable=protected-access
    op._body_graph, op._cond_graph = new_body, new_cond  # pylint: disable=protected-access
    first = len(op.inputs) - len(values)
    setattr(op, _HOISTED_ATTR, {first + n: i for n, i in enumerate(positions)})
    _ensure_while_gradient_wrapped()
    _LOG.debug("memsave_grads: %d variable(s) loop %s reads are read once before it (XLA)",
               len(values), op.name)


def _ensure_while_gradient_wrapped() -> None:
    """Wrap TensorFlow's registered gradient of while ops (once; nothing at import time) for
    the loops whose reads were hoisted after a ``tf.GradientTape`` recorded them.

    A tape differentiates an op as it was recorded: a stand-in with the recorded inputs (the
    loop's, before :func:`_hoist` added the read values), whose gradient function reads the
    real op's bodies. The gradients of the hoisted values, which are the variables'
    gradients, would be dropped there, and the tape would see zeros. The wrapper
    differentiates the loop as it is now and adds each hoisted value's gradient to its
    handle's, as the read in the body sent it before. Other ops: TensorFlow's gradient."""
    for op_type in op_types.WHILE_OP_TYPES:
        entry = tf_ops._gradient_registry._registry.get(op_type)  # pylint: disable=protected-access
        if entry is None or getattr(entry["type"], "_memsave_original", None) is not None:
            continue
        original = entry["type"]

        def gradient(op, *grads, original=original):
            loop = op.outputs[0].op
            hoisted = getattr(loop, _HOISTED_ATTR, None)
            if not hoisted or len(op.inputs) >= len(loop.inputs):
                return original(op, *grads)
            padded = list(grads) + [None] * (len(loop.outputs) - len(grads))
            for value_position in hoisted:
                # Unused outputs: zeros, as tf.gradients gives them, so that while_v2
                # differentiates the body with respect to the hoisted value too.
                padded[value_position] = tf.zeros_like(loop.outputs[value_position])
            result = list(original(loop, *padded))
            for value_position, handle_position in hoisted.items():
                value_grad = result[value_position]
                if value_grad is not None:
                    handle_grad = result[handle_position]
                    result[handle_position] = (value_grad if handle_grad is None
                                               else handle_grad + value_grad)
            return result[:len(op.inputs)]

        gradient._memsave_original = original  # pylint: disable=protected-access
        entry["type"] = gradient


def recompute_bodies(plans: dict) -> None:
    """Replace each loop's body as planned (module docstring); each loop once."""
    for op in sorted(plans, key=tf_graph.creation_index):
        if getattr(op, _RECOMPUTED_ATTR, None) is None:
            _recompute_body(op, plans[op])


def _merged_reads(reads: Sequence[tf.Operation], inputs: list) -> list:
    """The values of ``reads`` for each of ``len(inputs)`` iterations run as one
    (``inputs[j][n]``: read ``n``'s inputs in iteration ``j``), each variable read once for
    them all: a ``ReadVariableOp`` once (nothing writes in the loop), a gather once for all
    the iterations' indices. One read is one gradient for the variable per backward
    iteration, which while_v2 adds up in a buffer the variable's size: one buffer, not one
    per iteration. Values per iteration, read by read."""
    by_iteration = [[None] * len(reads) for _ in inputs]
    for n, read in enumerate(reads):
        handle = inputs[0][n][0]
        if read.type in op_types.VARIABLE_READ_OP_TYPES or len(inputs) == 1:
            if read.type in op_types.VARIABLE_READ_OP_TYPES:
                value = tf.raw_ops.ReadVariableOp(resource=handle, dtype=read.get_attr("dtype"))
                values = [value] * len(inputs)
            else:
                values = [tf.raw_ops.ResourceGather(
                    resource=handle, indices=inputs[0][n][1], dtype=read.get_attr("dtype"),
                    batch_dims=0, validate_indices=read.get_attr("validate_indices"))]
        else:
            indices = [inputs[j][n][1] for j in range(len(inputs))]
            flat = tf.concat([tf.reshape(i, [-1]) for i in indices], 0)
            gathered = tf.raw_ops.ResourceGather(
                resource=handle, indices=flat, dtype=read.get_attr("dtype"), batch_dims=0,
                validate_indices=read.get_attr("validate_indices"))
            parts = tf.split(gathered, tf.stack([tf.size(i) for i in indices]))
            rows = tf.shape(gathered)[1:]
            values = [tf.reshape(part, tf.concat([tf.shape(i), rows], 0))
                      for part, i in zip(parts, indices)]
        for j, value in enumerate(values):
            value.set_shape(read.outputs[0].shape)
            by_iteration[j][n] = value
    return [value for iteration in by_iteration for value in iteration]


def _recompute_body(op: tf.Operation, loop_plan: LoopPlan) -> None:
    (body,) = function_ops.body_graphs(op)
    trip_count, _ = function_ops.trip_count(op, body, function_ops.cond_graph(op))
    outputs = function_ops.body_outputs(op, body)
    invariant = function_ops.loop_invariant_positions(body, outputs)
    varying = [i for i in range(len(outputs)) if i not in invariant]
    input_refs = {t.ref(): i for i, t in enumerate(body.inputs)}
    ops = [o for o in body.get_operations()
           if o.type not in op_types.FEED_OP_TYPES or o.outputs[0].ref() not in input_refs]
    unroll = loop_plan.unroll
    # Variable reads run outside the recomputed step and pass their values in: the step's
    # gradient returns their values' gradients, which the reads send to the handles (a
    # handle passed through tf.custom_gradient would be a resource the loop body creates,
    # which while_v2 cannot differentiate). With several iterations per step, the values
    # without a gradient that they depend on (counters) are carried outside as well.
    reads = [o for o in ops if tf_graph.is_handle_gradient_read(o)
             and o.inputs[0].ref() in input_refs]
    carried = [i for i in varying if i != function_ops.WHILE_COUNTER_POSITION
               and not (tf_graph.carries_gradients(outputs[i])
                        and outputs[i].dtype != tf.resource)]
    seeds = reads + ([outputs[i].op for i in carried] if unroll > 1 else [])
    outside_ops = set(tf_graph.walk(seeds, tf_graph.input_ops,
                                    include=lambda o: o.outputs and o.outputs[0].ref()
                                    not in input_refs))
    handles = [i for i, t in enumerate(body.inputs) if t.dtype == tf.resource]
    passed = [i for i in range(len(body.inputs)) if i not in handles]
    copied = []

    def build(placeholders):
        graph = tf.compat.v1.get_default_graph()
        read_inputs, values = [], list(placeholders)
        for _ in range(unroll):
            given = {t.ref(): v for t, v in zip(body.inputs, values) if v is not None}
            outside = rewrite.copy_ops([o for o in ops if o in outside_ops and o not in reads],
                                       "", [], given, graph=graph)
            copied.append(outside)
            read_inputs.append([[outside[t.op].outputs[t.value_index] if t.op in outside
                                 else given[t.ref()] for t in r.inputs] for r in reads])
            values = [values[i] if i in invariant or i == function_ops.WHILE_COUNTER_POSITION
                      else outside[outputs[i].op].outputs[outputs[i].value_index]
                      if i in carried and outputs[i].op in outside else None
                      for i in range(len(outputs))]
        read_values = _merged_reads(reads, read_inputs)

        def step(*args):
            current = dict(zip(passed, args))
            current.update((i, placeholders[i]) for i in handles)
            given_reads = iter(args[len(passed):])
            counter = None
            for _ in range(unroll):
                replacements = {t.ref(): current[i] for i, t in enumerate(body.inputs)}
                replacements.update((r.outputs[0].ref(), next(given_reads)) for r in reads)
                inside = rewrite.copy_ops([o for o in ops if o not in reads], "", [],
                                          replacements, graph=graph)
                copied.append(inside)
                current = {i: current[i] if i in invariant else (
                    inside[t.op].outputs[t.value_index] if t.op in inside
                    else replacements.get(t.ref(), t)) for i, t in enumerate(outputs)}
                if counter is None:
                    counter = current[function_ops.WHILE_COUNTER_POSITION]
                # while_v2's counter counts the rewritten body's runs: its gradient loop
                # runs as many times (unused by the body itself).
                current[function_ops.WHILE_COUNTER_POSITION] = placeholders[
                    function_ops.WHILE_COUNTER_POSITION]
            current[function_ops.WHILE_COUNTER_POSITION] = counter
            return [current[i] for i in varying]

        step.__name__ = f"{body.name}_step"
        args = [placeholders[i] for i in passed] + read_values
        results = iter(tf.nest.flatten(recomputation.recompute(step)(*args)))
        new_outputs = [placeholders[i] if i in invariant else next(results)
                       for i in range(len(outputs))]
        control = [c[o] for c in copied for o in body.control_outputs if o in c]
        return new_outputs, control

    new_body = exposure.rebuilt_function_graph(
        body, f"{body.name}_memsave_recomputed{next(_counter)}", op.graph, build,
        graph_class=control_flow_v2_func_graphs.WhileBodyFuncGraph)
    op._set_func_attr("body", control_flow_util_v2.create_new_tf_function(new_body))  # pylint: disable=protected-access
    op._body_graph = new_body  # pylint: disable=protected-access
    if unroll > 1:
        # The loop now runs trip_count / unroll times: while_v2 sizes its gradient's
        # accumulators by the loop's iteration bound, which XLA allocates whole (a bound of
        # trip_count held unroll times what the loop stores). The counted condition on the
        # loop's own variable (LoopPlan) still ends it; the bound was at least trip_count.
        with op.graph.as_default(), op.graph.control_dependencies(None):
            bound = tf.constant(trip_count // unroll, op.inputs[1].dtype,
                                name=f"{op.name}_iterations_unrolled")
        op._update_input(1, bound)  # pylint: disable=protected-access
    setattr(op, _RECOMPUTED_ATTR, loop_plan)
    _LOG.debug("memsave_grads: the body of loop %s is recomputed in its backward "
               "iterations, %d iteration(s) at a time", op.name, unroll)
