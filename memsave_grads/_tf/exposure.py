"""Replaying a stateful cond or function call exactly: the forward op outputs its state, the
replay computes everything else again (docs/design.md, note "control flow and calls").

A cond whose branch draws dropout's random mask or reads a layer's weights, or a nested
``tf.function`` that reads a variable, is stateful: copied as it is, it would draw again or
read a variable that may have changed. It can still be replayed exactly, the way TensorFlow's
own gradients of these ops work: the forward op is rewritten to output more values, here the
values of its stateful ops (``function_ops.exposure_plan``), and the replay reads them:

* **expose** (:func:`expose`): the forward op's functions are replaced by clones that also
  output those values (a cond's in optionals, as cond_v2 outputs its intermediates: only the
  branch that ran holds them). What the op computes is unchanged.
* **replay** (:func:`replay_copy`, the copy a level recomputes): the body's ops are copied into
  the current graph, a call's inline and a cond's inside a new ``tf.cond`` on the same
  predicate; a variable read becomes its exposed value, through an ``IdentityN`` whose gradient
  goes to the variable's handle as the read's own gradient would (a gather's as
  ``IndexedSlices``); a random draw's values are read, never drawn again; stateful ops whose
  outputs feed nothing replayed (assignments) are left out.

A call rewritten so gets the replay as its gradient (:func:`_exposed_call_gradient`): where it
is still differentiated where it ran (a gradient of the gradient, another gradient call), the
gradient recomputes its body from the same values. A rewritten cond keeps cond_v2's gradient,
which reads the clones as it reads any branch.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Sequence

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.eager import record
from tensorflow.python.framework import func_graph as func_graph_module
from tensorflow.python.ops import cond_v2
from tensorflow.python.ops import control_flow_util_v2
from tensorflow.python.ops import gen_optional_ops
from tensorflow.python.ops import handle_data_util

from memsave_grads._tf import function_ops
from memsave_grads._tf import graph as tf_graph
from memsave_grads._tf import ordering
from memsave_grads._tf import rewrite
from memsave_grads.core import op_types

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

#: The gradient of a replayed variable read (an ``IdentityN`` of the exposed value, the
#: handle and a gather's indices): the read's own gradient, sent to the handle.
REPLAYED_READ_GRADIENT = "MemsaveReplayedRead"
_READ_TYPE_ATTR = "_memsave_read_type"
_registered = False
_clone_counter = itertools.count()


@dataclasses.dataclass(frozen=True)
class Exposure:
    """What :func:`expose` did to a forward op: the bodies' plans, how many outputs the op had
    before (its visible outputs), and where each body's exposed values start among them."""

    bodies: tuple
    visible_outputs: int
    first_exposed: tuple  # per body: index of its first exposed output on the op
    #: A cond's values in optionals (outside XLA); under XLA, which compiles no optional, as
    #: they are, each branch giving zeros for the other branches' values.
    in_optionals: bool = True


def _ensure_gradient_registered() -> None:
    """Register the replayed read's gradient on first use (nothing at import time)."""
    global _registered  # pylint: disable=global-statement
    if not _registered:
        tf.RegisterGradient(REPLAYED_READ_GRADIENT)(_replayed_read_gradient)
        _registered = True


def _replayed_read_gradient(op, grad, *unused_grads):
    """The gradient of the replayed read: to the handle, as ``ReadVariableOp``'s (the
    gradient itself) or ``ResourceGather``'s (rows of the variable) would be."""
    read_type = op.get_attr(_READ_TYPE_ATTR).decode()
    indices = op.inputs[2] if len(op.inputs) > 2 else None
    handle_grad = tf_graph.handle_gradient(read_type, grad, op.inputs[1], indices)
    return [None, handle_grad] + [None] * (len(op.inputs) - 2)


def _replayed_read(value: tf.Tensor, handle: tf.Tensor, indices, read: tf.Operation):
    """The exposed ``value`` of ``read`` for the replay, with the read's gradient to
    ``handle``."""
    _ensure_gradient_registered()
    graph = tf.compat.v1.get_default_graph()
    inputs = [value, handle] + ([indices] if indices is not None else [])
    with graph.gradient_override_map({"IdentityN": REPLAYED_READ_GRADIENT}):
        out = tf.identity_n(inputs, name=f"{read.name.split('/')[-1]}_replayed")
    out[0].op._set_attr(_READ_TYPE_ATTR, attr_value_pb2.AttrValue(s=read.type.encode()))  # pylint: disable=protected-access
    out[0].set_shape(read.outputs[0].shape)
    return out[0]


# --------------------------------------------------------------------------------------------
# Expose: the forward op outputs its state
# --------------------------------------------------------------------------------------------


def _placeholder_like(t: tf.Tensor) -> tf.Tensor:
    placeholder = tf.compat.v1.placeholder(t.dtype, t.shape, name=t.op.name)
    handle_data_util.copy_handle_data(t, placeholder)
    return placeholder


def rebuilt_function_graph(body, name: str, outer_graph, build,
                           graph_class=func_graph_module.FuncGraph):
    """A new function graph ``name`` with inputs like ``body``'s, whose outputs and control
    outputs ``build(placeholders)`` makes (the ``_tf.loops`` bodies and :func:`_clone`);
    nothing is recorded on gradient tapes while it is built."""
    rebuilt = graph_class(name)
    rebuilt.outer_graph = outer_graph
    with record.stop_recording(), rebuilt.as_default():
        placeholders = [_placeholder_like(t) for t in body.inputs]
        outputs, control_outputs = build(placeholders)
    rebuilt.inputs = placeholders
    rebuilt.outputs = list(outputs)
    rebuilt.control_outputs = list(control_outputs)
    rebuilt.structured_outputs = list(rebuilt.outputs)
    return rebuilt


def _clone(body, outputs, outer_graph, extra_outputs) -> func_graph_module.FuncGraph:
    """A copy of function graph ``body`` (same inputs, ``outputs``: the op's among the
    graph's) that also outputs ``extra_outputs(mapping)``, where ``mapping`` takes a tensor
    of ``body`` to its copy."""
    ops = [op for op in body.get_operations() if op.type not in op_types.FEED_OP_TYPES
           or op.outputs[0].ref() not in {t.ref() for t in body.inputs}]

    def build(placeholders):
        replacements = {t.ref(): p for t, p in zip(body.inputs, placeholders)}
        copies = rewrite.copy_ops(ops, "", [], replacements,
                                  graph=tf.compat.v1.get_default_graph())

        def mapping(t):
            return (copies[t.op].outputs[t.value_index] if t.op in copies
                    else replacements.get(t.ref(), t))

        new_outputs = [mapping(t) for t in outputs] + list(extra_outputs(mapping))
        return new_outputs, [copies[op] for op in body.control_outputs if op in copies]

    return rebuilt_function_graph(
        body, f"{body.name}_memsave_exposed{next(_clone_counter)}", outer_graph, build)


def _state_in_clone(body: function_ops.BodyExposure, mapping) -> list:
    """``body``'s exposed values in a clone of its graph (``mapping``: a tensor of ``body`` to
    its copy there), in order: its own, then each nested op's, whose copy is exposed first."""
    values = [mapping(t) for t in body.exposed_values]
    for nested in body.nested:
        copy = mapping(nested.op.outputs[0]).op
        exposure = expose(copy, nested.bodies, nested.in_optionals)
        values += copy.outputs[exposure.visible_outputs:]
    return values


def expose(op: tf.Operation, bodies: Sequence, in_optionals: bool | None = None) -> Exposure:
    """Rewrite forward op ``op`` (a stateful call or cond) to output its bodies' exposed
    values (``function_ops.BodyExposure.exposed_count`` each) after its own outputs; once.
    ``in_optionals`` (a cond's): default, outside XLA."""
    done = getattr(op, function_ops.EXPOSURE_ATTR, None)
    if done is not None:
        return done
    visible = len(op.outputs)
    # A call's values need no optionals; a cond's do, but XLA compiles none (Exposure).
    if in_optionals is None:
        in_optionals = (op.type in op_types.FUNCTION_CALL_OP_TYPES
                        or not ordering.xla_in_effect(op.graph))
    if op.type in op_types.FUNCTION_CALL_OP_TYPES:
        (body,) = bodies
        clone = _clone(body.graph, body.outputs, op.graph,
                       lambda mapping: _state_in_clone(body, mapping))
        name = control_flow_util_v2.create_new_tf_function(clone)
        extra = clone.outputs[visible:]
        op._set_func_attr("f", name)  # pylint: disable=protected-access
        op._set_type_list_attr("Tout", [t.dtype for t in clone.outputs])  # pylint: disable=protected-access
        op._add_outputs([t.dtype for t in extra], [t.shape for t in extra])  # pylint: disable=protected-access
        op._gradient_function = _exposed_call_gradient  # pylint: disable=protected-access
        first = (visible,)
    else:
        # Each branch outputs its own values in optionals, and empty optionals for the other
        # branches' (only the branch that ran holds its values; cond_v2 does the same).
        counts = [b.exposed_count for b in bodies]
        first = tuple(visible + sum(counts[:i]) for i in range(len(bodies)))
        clones = []
        for i, body in enumerate(bodies):
            def optionals(mapping, i=i, body=body):
                out = []
                for j, other in enumerate(bodies):
                    if j == i and in_optionals:
                        out += [gen_optional_ops.optional_from_value([v])
                                for v in _state_in_clone(body, mapping)]
                    elif j == i:
                        out += _state_in_clone(body, mapping)
                    elif in_optionals:
                        out += [gen_optional_ops.optional_none()
                                for _ in range(other.exposed_count)]
                    else:  # as cond_v2 matches its branches' intermediates under XLA
                        out += [tf.zeros(shape, dtype) for dtype, shape in other.value_specs()]
                return out
            clones.append(_clone(body.graph, body.outputs, op.graph, optionals))
        names = [control_flow_util_v2.create_new_tf_function(c) for c in clones]
        if op.type in op_types.COND_OP_TYPES:
            op._set_func_attr("then_branch", names[0])  # pylint: disable=protected-access
            op._set_func_attr("else_branch", names[1])  # pylint: disable=protected-access
            op._true_graph, op._false_graph = clones  # pylint: disable=protected-access
        else:
            op._set_func_list_attr("branches", names)  # pylint: disable=protected-access
            for i, c in enumerate(clones):
                setattr(op, f"_branch_graph_{i}", c)
        outputs = clones[0].outputs
        extra = outputs[visible:]
        op._set_type_list_attr("Tout", [t.dtype for t in outputs])  # pylint: disable=protected-access
        op._set_shape_list_attr("output_shapes", [t.shape for t in outputs])  # pylint: disable=protected-access
        op._add_outputs([t.dtype for t in extra], [t.shape for t in extra])  # pylint: disable=protected-access
    exposure = Exposure(tuple(bodies), visible, first, in_optionals)
    setattr(op, function_ops.EXPOSURE_ATTR, exposure)
    _LOG.debug("memsave_grads: %s (%s) outputs %d values of its state for its replay",
               op.name, op.type, len(op.outputs) - visible)
    return exposure


# --------------------------------------------------------------------------------------------
# Replay: the body again, from the exposed state
# --------------------------------------------------------------------------------------------


def _inline(body: function_ops.BodyExposure, inputs: Sequence, exposed: Sequence, scope: str,
            control_inputs: Sequence) -> tuple[list, list]:
    """Copy ``body``'s ops into the current graph: its placeholders read ``inputs``, its
    reads and exposed values read ``exposed`` (``exposed_count`` of them, in order), its
    nested stateful ops are replayed from theirs. Returns (the body's outputs there, the ops
    made)."""
    graph = tf.compat.v1.get_default_graph()
    source = body.graph
    replacements = {t.ref(): x for t, x in zip(source.inputs, inputs)}
    position = {t.ref(): i for i, t in enumerate(source.inputs)}
    made = []
    values = iter(exposed)
    read_values = [next(values) for _ in body.reads]
    gather_indices = [next(values) for read in body.reads if read.type != "ReadVariableOp"]
    state_values = [next(values) for _ in body.exposed]
    nested = {n.op: (n, [next(values) for _ in range(n.exposed_count)]) for n in body.nested}
    with tf.name_scope(scope):
        indices = iter(gather_indices)
        for read, value in zip(body.reads, read_values):
            handle = inputs[position[read.inputs[0].ref()]]
            index = None if read.type == "ReadVariableOp" else next(indices)
            replayed = _replayed_read(value, handle, index, read)
            replacements[read.outputs[0].ref()] = replayed
            made.append(replayed.op)
        for t, value in zip(body.exposed, state_values):
            # A value of the state, computed from draws and constants alone: no gradient
            # flows into it (exact: it does not depend on what is differentiated).
            stopped = tf.stop_gradient(value)
            replacements[t.ref()] = stopped
            made.append(stopped.op)
    not_copied = set(body.reads) | set(body.dropped)

    def upstream(op):
        if op.type in op_types.FEED_OP_TYPES or op in not_copied:
            return []
        return ([t.op for t in op.inputs if t.ref() not in replacements]
                + [c for c in op.control_inputs if c not in not_copied
                   and tf_graph.is_replayable(c)])

    def replay_nested(op, op_inputs, op_control_inputs, op_graph):
        if op not in nested:
            return None
        inner, inner_values = nested[op]
        counts = [b.exposed_count for b in inner.bodies]
        per_body = [inner_values[sum(counts[:i]):sum(counts[:i + 1])]
                    for i in range(len(counts))]
        return _replayed(op, inner.bodies, per_body, inner.in_optionals, op_inputs,
                         op_control_inputs, op_graph)

    visible = list(body.outputs)
    needed = set(tf_graph.walk([t.op for t in visible if t.ref() not in replacements],
                               upstream))
    ops = sorted((op for op in needed if op.type not in op_types.FEED_OP_TYPES
                  and op not in not_copied), key=tf_graph.creation_index)
    for op in ops:
        if not tf_graph.is_replayable(op) and op not in nested:
            raise AssertionError(f"the replay of {source.name} would run {op.name} again")
    copies = rewrite.copy_ops(ops, scope, list(control_inputs), replacements, graph=graph,
                              replay=replay_nested)
    made += [c for c in copies.values()]
    outputs = [copies[t.op].outputs[t.value_index] if t.op in copies
               else replacements[t.ref()] for t in visible]
    return outputs, made


def _exposed_values(op: tf.Operation, exposure: Exposure, branch: int) -> list:
    start = exposure.first_exposed[branch]
    return op.outputs[start:start + exposure.bodies[branch].exposed_count]


@dataclasses.dataclass(frozen=True)
class Replay:
    """A replayed op: ``stand_in`` has the original's visible outputs at the same positions;
    ``made`` are every op the replay created (part of the copied region)."""

    stand_in: tf.Operation
    made: list


def replay_copy(op: tf.Operation, inputs: Sequence, control_inputs: Sequence,
                graph: tf.Graph) -> Replay | None:
    """The copy of ``op`` that a level recomputes, where ``op`` is a stateful cond or call
    that ``function_ops.exposure_plan`` can replay; None for any other op (copied as it is).
    ``inputs``: what the copy reads for each input of ``op``."""
    bodies = function_ops.exposure_plan(op)
    if bodies is None or graph is not op.graph:
        return None
    exposure = expose(op, bodies)
    return _replayed(op, exposure.bodies,
                     [_exposed_values(op, exposure, i) for i in range(len(bodies))],
                     exposure.in_optionals, inputs, control_inputs, graph)


def expose_for_replay(op: tf.Operation) -> None:
    """Expose ``op`` now if it is a stateful cond or call a level may replay: before any
    gradient is built. TensorFlow's own gradient of a call (the top segment's, a kept one's)
    rewrites the calls inside the function it runs, in that function's shared body graph, and
    a body rewritten so no longer says what the call computed: planned replays then refused at
    copy time (design note "control flow and calls", "Nested stateful conds and calls")."""
    bodies = function_ops.exposure_plan(op)
    if bodies is not None:
        expose(op, bodies)


def _replayed(op: tf.Operation, bodies: Sequence, values: Sequence[Sequence],
              in_optionals: bool, inputs: Sequence, control_inputs: Sequence,
              graph: tf.Graph) -> Replay:
    """``op`` (a stateful call or cond) computed again in ``graph`` from ``inputs`` and its
    bodies' exposed ``values`` (one list per body; a cond's in optionals if ``in_optionals``):
    a call's body inline, a cond's branches in a new cond on the same predicate."""
    inputs = list(inputs)[:len(op.inputs)]
    with graph.as_default(), tf.name_scope(f"{op.name.split('/')[-1]}_replay"):
        if op.type in op_types.FUNCTION_CALL_OP_TYPES:
            outputs, made = _inline(bodies[0], inputs, values[0], "inline", control_inputs)
        else:
            outputs, made = _replay_cond(op, bodies, values, in_optionals, inputs,
                                         control_inputs)
        stand_in = tf.identity_n(outputs, name="replayed")
    for original, copied in zip(op.outputs, stand_in):
        copied.set_shape(original.shape)
    return Replay(stand_in[0].op if stand_in else None, made + [stand_in[0].op])


def _replay_cond(op, bodies, values, in_optionals, inputs, control_inputs) -> tuple[list, list]:
    """A new cond on the same predicate (branch index) whose branches replay the original's."""
    graph = tf.compat.v1.get_default_graph()
    first_op = len(graph.get_operations())

    def branch_fn(i):
        body = bodies[i]

        def replayed():
            exposed = ([gen_optional_ops.optional_get_value(o, [dtype], [shape])[0]
                        for o, (dtype, shape) in zip(values[i], body.value_specs())]
                       if in_optionals else list(values[i]))
            outputs, _ = _inline(body, inputs[function_ops.input_offset(op):], exposed,
                                 "replay", [])
            return outputs
        return replayed

    # cond_v2 whatever the process's setting: under disable_v2_behavior tf.cond builds TF1
    # control flow, whose gradient a nested level and a second derivative refuse.
    with tf.control_dependencies(list(control_inputs)):
        if op.type in op_types.COND_OP_TYPES:
            outputs = cond_v2.cond_v2(inputs[0], branch_fn(0), branch_fn(1),
                                      name="replayed_cond")
        else:
            outputs = cond_v2.indexed_case(inputs[0], [branch_fn(i) for i in range(len(bodies))],
                                           name="replayed_case")
    outputs = tf.nest.flatten(outputs)
    return outputs, list(graph.get_operations()[first_op:])


def _producer(g) -> tf.Operation:
    return g.values.op if isinstance(g, tf.IndexedSlices) else g.op


def _exposed_call_gradient(op: tf.Operation, *grads):
    """The gradient of a call that :func:`expose` rewrote, wherever it is taken: its body
    replayed from the same inputs and exposed values, then differentiated (TensorFlow's own
    gradient of the call would rewrite it again, and no longer matches its outputs)."""
    exposure: Exposure = getattr(op, function_ops.EXPOSURE_ATTR)
    visible = exposure.visible_outputs
    live = [g for g in grads[:visible] if g is not None]
    outputs, _ = _inline(exposure.bodies[0], list(op.inputs), _exposed_values(op, exposure, 0),
                         "replay", [_producer(g) for g in live])
    pairs = [(y, g) for y, g in zip(outputs, grads[:visible])
             if g is not None and tf_graph.carries_gradients(y)]
    if not pairs:
        return [None] * len(op.inputs)
    sources = list(op.inputs)
    return tf_graph.gradients_stopped_at([y for y, _ in pairs], sources,
                                         [g for _, g in pairs], sources)
