"""``recompute(fn)``: keep only a function's inputs for backprop and recompute its internals.

``gradients()`` chooses checkpoints in a whole forward graph, but it cannot reach inside a
``tf.while_loop``: the loop's gradient stores every tensor of every iteration that the body's
gradient reads (in TensorList accumulators). For a recurrent cell that is all the gate
activations of all T steps. ``recompute(step_fn)`` wraps the step so that the backward pass
stores only what the step received (inputs, state; also the outputs of stateful ops, see below)
and runs the step's ops again, in the backward iteration, before taking their gradient. Caffe2
does the same for LSTMs (``recompute_blobs_on_backward``).

Unlike ``tf.recompute_grad``, which calls the function a second time, this copies the forward
ops (design note "recompute" in docs/design.md):

- Stateful ops are not copied. Their outputs (dropout masks, random draws, variable reads) are
  kept and fed to the copies, so a recomputation never redraws a random number and never reads
  a variable that an update changed in between.
- The copies carry control dependencies on the incoming gradients, so outside a loop they run
  during backprop and not during the forward pass (design note "scheduling").

Works in v1 graphs and inside ``tf.function``, under ``tf.gradients``, ``memsave_grads.gradients``
and ``tf.GradientTape`` (inside a ``tf.function``). Eagerly there is no graph to copy: the
function runs as it is and saves nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from typing import Callable, Sequence

import tensorflow as tf

from memsave_grads._tf import ordering
from memsave_grads._tf import rewrite
from memsave_grads._tf import graph as tf_graph
from memsave_grads import errors
from memsave_grads.core import op_types

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

_call_counter = itertools.count()


def recompute(fn: Callable) -> Callable:
    """Wrap ``fn`` so its gradient recomputes its internals instead of storing them.

    Args:
      fn: a function of tensors (positional arguments, possibly nested structures of
        tensors) returning a tensor or a nested structure of tensors; typically one step of a
        recurrent net, called in a ``tf.while_loop``, ``tf.scan`` or an unrolled loop. It may
        read variables (their gradients are returned as ``tf.custom_gradient`` expects) and
        use random ops such as dropout (their draws are kept, never redrawn). Keyword arguments
        must be bound beforehand, e.g. with ``functools.partial``.

    Returns:
      A function with ``fn``'s signature and values whose gradient stores only the
      arguments, the outputs and the outputs of stateful ops.

    Raises:
      memsave_grads.InvalidTypeError: ``fn`` is not callable, or is called with keyword
        arguments.
      memsave_grads.UnsupportedGraphError: ``fn`` passes a value that depends on its inputs
        through a stateful op (e.g. ``tf.print`` of an activation inside a ``py_function``).
        Such an op would have to run again, so move it out of ``fn``.
    """
    if not callable(fn):
        raise errors.InvalidTypeError(
            f"recompute: fn: expected a callable (a step or cell function), got "
            f"{type(fn).__name__}: {fn!r:.80}.")

    # Not converted by AutoGraph: the step is called from user code that AutoGraph converts, and
    # it would otherwise convert (and warn about) our graph-walking helpers too.
    @functools.wraps(fn)
    @tf.autograph.experimental.do_not_convert
    def wrapper(*args, **kwargs):
        if kwargs:
            raise errors.InvalidTypeError(
                f"recompute({getattr(fn, '__name__', 'fn')}): got keyword arguments "
                f"{sorted(kwargs)}; tf.custom_gradient, which carries the recomputation, takes "
                "positional tensors only. Bind them first: recompute(functools.partial(fn, "
                "training=True)).")
        if tf.executing_eagerly():
            _LOG.debug("memsave_grads.recompute: eager call of %s runs as is (nothing to "
                       "recompute without a graph)", getattr(fn, "__name__", "fn"))
            return fn(*args)
        return _recomputed(fn, args)

    return wrapper


def _recomputed(fn: Callable, args: tuple):
    scope = f"memsave_recompute_{next(_call_counter)}"

    @tf.custom_gradient
    def forward(*tensor_args):
        graph = tf.compat.v1.get_default_graph()
        first_op = len(graph.get_operations())
        result = fn(*tensor_args)
        forward_ops = graph.get_operations()[first_op:]
        inputs = [t for t in tf.nest.flatten(tensor_args) if isinstance(t, tf.Tensor)]
        outputs = tf.nest.flatten(result)
        plan = _plan(forward_ops, inputs, outputs, getattr(fn, "__name__", "fn"))

        def grad(*output_grads, variables: Sequence[tf.Variable] | None = None):
            return _backward(plan, inputs, outputs, output_grads, list(variables or ()), scope)

        return result, grad

    return forward(*args)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the backward pass copies, and which forward values stand for variables.

    Attributes:
      replayed: the function's replayable ops the outputs need, in creation order (which is
        topological). Everything else they read (stateful outputs, values from outside the
        function) is read from the forward pass.
      kept_reads: outputs of the function's variable reads (``ReadVariableOp``,
        ``ResourceGather``: ``op_types.HANDLE_GRADIENT_READ_OP_TYPES``); a variable's gradient
        is the sum of what its reads send to its handle.
    """

    replayed: list
    kept_reads: list


def _plan(forward_ops, inputs, outputs, fn_name) -> _Plan:
    own = set(forward_ops)
    # A kept (not replayable) op is not crossed: its outputs are read from the forward pass.
    needed = set(tf_graph.walk(
        [t.op for t in outputs], lambda op: (tf_graph.dependency_ops(op)
                                             if tf_graph.is_replayable(op) else ()),
        include=own.__contains__))
    kept = {op for op in needed if not tf_graph.is_replayable(op)}
    _check_kept(kept, own, inputs, fn_name)
    replayed = [op for op in forward_ops if op in needed and op not in kept]
    kept_reads = [op.outputs[0] for op in forward_ops
                  if op in kept and tf_graph.is_handle_gradient_read(op)]
    return _Plan(replayed, kept_reads)


def _check_kept(kept, own, inputs, fn_name) -> None:
    """A kept stateful op must not read a differentiable value computed from the inputs: its
    gradient would need the op's forward inputs, which is what recompute does not store."""
    downstream = set(tf_graph.walk([c for t in inputs for c in t.consumers()],
                                   tf_graph.consumer_ops, include=own.__contains__))
    input_refs = {t.ref() for t in inputs}

    def from_inputs(t) -> bool:
        return t.ref() in input_refs or t.op in downstream

    for op in kept:
        for t in op.inputs:
            if tf_graph.carries_gradients(t) and t.dtype != tf.resource and from_inputs(t):
                raise errors.UnsupportedGraphError(
                    f"recompute({fn_name}): the stateful op {op.name!r} ({op.type}) reads "
                    f"{t.name!r}, which is computed from the function's inputs. Stateful ops "
                    "are never run twice, and its gradient would need that value stored. Move "
                    "the op out of the recomputed function, or make it stateless (e.g. "
                    "tf.random.stateless_uniform with an explicit seed); for a Keras 3 "
                    "recurrent cell, wrap_model(model, recompute_cells=False) keeps the "
                    "layer's loop as Keras builds it.")


@tf.autograph.experimental.do_not_convert
def _backward(plan: _Plan, inputs, outputs, output_grads, variables, scope):
    graph = tf.compat.v1.get_default_graph()
    live = [g for g in output_grads if g is not None]
    # Local stand-ins for the forward values the copies read: in a loop's backward body they
    # are captured (stored per iteration); elsewhere they are the forward tensors themselves.
    with tf.name_scope(scope):
        # Under XLA, which drops control inputs, the copies also wait for the gradients
        # through dataflow (design note "ordering under XLA").
        arrival = None
        if plan.replayed and ordering.xla_in_effect(graph):
            with tf.name_scope("arrival"):
                arrival = ordering.gradient_arrival(live)
        with tf.name_scope("stored"):
            local_inputs = [tf.identity(t) if _differentiable(t) else t for t in inputs]
            local_reads = [tf.identity(t) for t in plan.kept_reads]
        replacements = {t.ref(): local for t, local in zip(inputs, local_inputs)}
        replacements.update({t.ref(): local for t, local in zip(plan.kept_reads, local_reads)})
        copies = rewrite.copy_ops(plan.replayed, "replay", control_inputs=[g.op for g in live],
                                   replacements=replacements, graph=graph, arrival=arrival)
        replayed_outputs = [copies[t.op].outputs[t.value_index] if t.op in copies
                            else replacements.get(t.ref(), t) for t in outputs]
        pairs = [(y, g) for y, g in zip(replayed_outputs, output_grads)
                 if g is not None and _differentiable(y)]
        targets = [t for t in local_inputs if _differentiable(t)] + local_reads
        with tf_graph.replay_backward():
            grads = (tf.gradients([y for y, _ in pairs], targets, [g for _, g in pairs])
                     if pairs and targets else [None] * len(targets))
    by_target = iter(grads)
    input_grads = [next(by_target) if _differentiable(t) else None for t in local_inputs]
    # What each read sends to its variable's handle: the value's gradient, or rows of it.
    handle_grads = [tf_graph.handle_gradient(read.op.type, g, read.op.inputs[0],
                                             read.op.inputs[1] if len(read.op.inputs) > 1
                                             else None)
                    for read, g in zip(plan.kept_reads, by_target)]
    # A handle the function receives (a loop body's captured variable, as the loop passes it
    # on) gets its reads' gradients as its input gradient; the others go to ``variables``.
    from_inputs = [False] * len(plan.kept_reads)
    for i, t in enumerate(inputs):
        if isinstance(t, tf.Tensor) and t.dtype == tf.resource:
            mine = [k for k, read in enumerate(plan.kept_reads) if read.op.inputs[0] is t]
            for k in mine:
                from_inputs[k] = True
            input_grads[i] = _summed([handle_grads[k] for k in mine])
    if not variables:
        return input_grads
    rest = [(read, g) for read, g, mine in zip(plan.kept_reads, handle_grads, from_inputs)
            if not mine]
    return input_grads, _variable_grads(variables, [r for r, _ in rest], [g for _, g in rest])


def _differentiable(t) -> bool:
    return isinstance(t, tf.Tensor) and tf_graph.carries_gradients(t) and t.dtype != tf.resource


def _summed(parts):
    """The sum of a variable's partial gradients: one as it is (``IndexedSlices`` from a
    gather stay sparse), several added densely; None for none."""
    parts = [g for g in parts if g is not None]
    if len(parts) > 1:
        return tf.add_n([tf.convert_to_tensor(g) for g in parts])
    return parts[0] if parts else None


@tf.autograph.experimental.do_not_convert
def _variable_grads(variables, reads, handle_grads):
    """Sum what each variable's reads inside the function send to its handle."""
    handles = [_outermost(read.op.inputs[0]) for read in reads]
    return [_summed([g for handle, g in zip(handles, handle_grads)
                     if _same_tensor(handle, variable.handle)]) for variable in variables]


@tf.autograph.experimental.do_not_convert
def _outermost(handle):
    """Follow a captured placeholder out through nested function graphs (a while body inside a
    tf.function) to the tensor it stands for: a variable's own handle."""
    while (outer := tf_graph.captured_value(handle)) is not None:
        handle = outer
    return handle


def _same_tensor(a, b) -> bool:
    if a is b:
        return True
    eager = tf_graph.is_eager_tensor
    return not eager(a) and not eager(b) and a.graph is b.graph and a.name == b.name
