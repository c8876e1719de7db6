"""Make recomputation wait for the incoming gradient, in a way XLA keeps too.

Outside XLA, control inputs on the incoming gradients are enough: TensorFlow's executor runs a
copy only once they have run (design note "scheduling"). XLA drops control dependencies and
merges identical computations (common-subexpression elimination): a copy that reads the same
values as its original becomes the original again, so the activations it was meant to
recompute stay alive from the forward pass, and nothing is saved. Under XLA each copy that
reads no other copy therefore reads one input as a *different value in dataflow*: the input
minus a zero computed from the incoming gradient (design note "ordering under XLA"). The
subtraction is exact (``x - 0.0`` is ``x`` for every float, ``-0.0``, infinities and NaN
included), and the zero never carries the gradient's value: a NaN or Inf gradient still
gives exactly 0.

Only under XLA: outside it the subtraction would materialize a copy of a tensor for nothing
(control inputs already work), so plain graphs are unchanged.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Iterable, Sequence

import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.ops import cond_v2
from tensorflow.python.ops import control_flow_util

from memsave_grads.core import op_types

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

_warned: set[str] = set()


def xla_in_effect(graph: tf.Graph | None = None) -> bool:
    """Whether ops built now in ``graph`` (default: the current one) will be compiled by XLA.

    True inside ``tf.function(jit_compile=True)`` (Keras' ``jit_compile=True`` steps
    included), in functions and loops nested in one, and under XLA auto-clustering
    (``tf.config.optimizer.set_jit(True)`` or ``TF_XLA_FLAGS=--tf_xla_auto_jit=...``), where
    clusters may drop control dependencies between their ops too. Auto-clustering is taken
    at its word: on CPU it clusters nothing without ``--tf_xla_cpu_global_jit``, and the
    subtractions are then paid for nothing (a copy of one input per recomputed root).

    Not seen: a TF1 ``ConfigProto``'s ``global_jit_level`` and
    ``tf.xla.experimental.jit_scope()``, which only the session or the op attributes carry.
    There the control inputs alone order the copies, and clusters may drop them.
    """
    graph = graph or tf.compat.v1.get_default_graph()
    if control_flow_util.GraphOrParentsInXlaContext(graph):
        return True
    if tf.config.optimizer.get_jit():
        return True
    return _auto_jit_in_flags(os.environ.get("TF_XLA_FLAGS", ""))


def compiled_by_xla(graph: tf.Graph | None = None) -> bool:
    """Whether ops built now in ``graph`` are certainly compiled by XLA: inside
    ``tf.function(jit_compile=True)`` or a function or loop nested in one. Not under
    auto-clustering alone, which may leave an op out of every cluster (where
    :func:`materialized` would only copy tensors)."""
    graph = graph or tf.compat.v1.get_default_graph()
    return bool(control_flow_util.GraphOrParentsInXlaContext(graph))


def _auto_jit_in_flags(flags: str) -> bool:
    for flag in flags.split():
        name, _, value = flag.partition("=")
        if name.lstrip("-") == "tf_xla_auto_jit":
            return value.strip() not in ("", "0", "-1")
    return False


def gradient_arrival(incoming: Iterable) -> tf.Tensor | None:
    """A float32 scalar zero that XLA can compute only once every tensor of ``incoming`` (the
    gradients a recomputation waits for; dense tensors or IndexedSlices) exists.

    It reads one element of each (an empty tensor reads none and still orders), casts it to
    bool so that NaN and Inf become ``True`` like any other value, and turns ``b == b``
    (always true, but not known to the compiler) into 0. This is the construction of
    ``tf.recompute_grad``, which survives XLA for the same reason.
    """
    flags = []
    for g in incoming:
        if g is None:
            continue
        values = g.values if isinstance(g, tf.IndexedSlices) else g
        if values.dtype.is_complex:
            values = tf.math.real(values)
        if values.dtype in (tf.resource, tf.variant, tf.string):
            continue
        first = tf.reshape(values, [-1])[:1]
        flags.append(tf.reduce_any(tf.cast(first, tf.bool)))
    if not flags:
        return None
    arrived = flags[0] if len(flags) == 1 else tf.reduce_any(tf.stack(flags))
    return tf.where(tf.equal(arrived, arrived), 0.0, float("nan"))


def can_wait(t: tf.Tensor) -> bool:
    """Whether ``after`` may tie ``t`` to the gradient: floating and complex tensors.

    Not integers: they are the shapes, axes, permutations and sizes that XLA needs as
    compile-time constants (``Mean``'s axes, ``Reshape``'s shape), which a value computed from
    the gradient is not. Not bools, resources, variants or strings either."""
    return t.dtype.is_floating or t.dtype.is_complex


def is_variable_value(t: tf.Tensor) -> bool:
    """Whether ``t`` is a variable's value or a constant, as read (``ReadVariableOp``,
    ``Const``), through views and casts (a mixed-precision weight): what a recomputed op reads
    that the forward pass does not produce."""
    while t.op.type in _PASSES_VALUE_ON and t.op.inputs:
        t = t.op.inputs[t.value_index if t.op.type == "IdentityN" else 0]
    return t.op.type in op_types.VARIABLE_READ_OP_TYPES or t.op.type == "Const"


#: What :func:`is_variable_value` looks through: views of a value, and casts.
_PASSES_VALUE_ON = op_types.VALUE_VIEW_OP_TYPES | {"Cast"}


def after(t: tf.Tensor, zero: tf.Tensor) -> tf.Tensor:
    """A new tensor equal to ``t``, computed only once ``zero`` (from
    :func:`gradient_arrival`) exists; an identity where ``t`` cannot wait (see
    :func:`can_wait`), which orders nothing under XLA."""
    if not can_wait(t):
        return tf.identity(t)
    return tf.subtract(t, tf.cast(zero, t.dtype), name="after_gradient")


def sums_activations(t: tf.Tensor, depth: int = 8) -> bool:
    """Whether ``t`` is, through ops of one activation input (an activation, a normalization,
    a scale), a cheap op of two or more activations (``x + f(x)``, a gated product): what XLA
    rebuilds in each reader from the tensors it sums, which then stay alive (design note
    "memory under XLA"). Not a matmul's or convolution's output nor a function of one: there
    the conditional of :func:`materialized` only adds copies (a tanh chain: 18 -> 49 MiB)."""
    for _ in range(depth):
        op = t.op
        if op.type in op_types.EXPENSIVE_OP_TYPES:
            return False
        activations = [i for i in op.inputs if can_wait(i) and not is_variable_value(i)]
        if len(activations) >= 2:
            return True
        if not activations:
            return False
        t = activations[0]
    return False


def materialized(tensors: Sequence[tf.Tensor], zero: tf.Tensor) -> list[tf.Tensor]:
    """The values of ``tensors``, each made a buffer that XLA reads as it is and only once
    ``zero`` (from :func:`gradient_arrival`) exists: a kept ``x + f(x)`` is then materialized
    instead of rebuilt in each reader from the tensors it sums, and nothing after it can be
    computed before the gradient exists or be merged with the forward pass (design note
    "memory under XLA"). Exact: each output is its input; its gradient is the identity, to
    every order. Only where :func:`compiled_by_xla`: outside XLA it would only copy.

    How depends on the compiler (:func:`barriers_kept`): for a GPU, an
    ``XlaOptimizationBarrier`` of the tensor and ``zero``, which the GPU compiler keeps until
    after scheduling; for the CPU, whose compiler removes barriers before fusion, a conditional
    on ``zero == 0`` whose two branches pass the value on, which XLA cannot resolve at compile
    time and into whose operand it fuses nothing. On a GPU each conditional is a round trip to
    the host (its predicate is read back before a branch runs), which a barrier does not need:
    1.79x against 1.17x tf.gradients' step time on an H200 (docs/gpu.md).

    One per tensor, not one for all: an op's gradient gives each output that receives none a
    gradient of zeros, so a shared one turned the ``None`` gradient of a kept tensor read only
    through non-differentiable ops into zeros, for everything upstream of it (tf.gradients
    gives ``None`` there).
    """
    if barriers_kept(zero):
        # pylint: disable-next=import-outside-toplevel  # XLA's op wrappers: only when used
        from tensorflow.compiler.tf2xla.ops import gen_xla_ops
        register_barrier_gradient()
        # The zero is ordering only: no gradient flows into the arrival's reads.
        waited = tf.stop_gradient(zero)
        return [gen_xla_ops.xla_optimization_barrier([t, waited], name="materialized")[0]
                for t in tensors]
    arrived = tf.equal(zero, 0.0)
    # cond_v2 whatever the process's setting: under disable_v2_behavior tf.cond would build
    # TF1 control flow (Switch/Merge), which a later derivative of these gradients cannot
    # take through memsave_grads (nor does XLA compile it into one conditional).
    return [cond_v2.cond_v2(arrived, lambda t=t: tf.identity(t), lambda t=t: tf.identity(t),
                            name="materialized") for t in tensors]


def barriers_kept(t: tf.Tensor) -> bool:
    """Whether XLA compiles ``t``'s op for a device whose compiler keeps an
    ``XlaOptimizationBarrier`` through fusion and scheduling: not a CPU (``CPU``,
    ``XLA_CPU``), whose compiler expands barriers away before fusion (then
    :func:`materialized` builds a conditional).

    The device is the op's own where it names a device type, else a GPU wherever this process
    sees one (``tf.config.get_visible_devices``, which starts no runtime). Where that guess is
    wrong the gradients are still exact, and only the saving or the speed suffers: a step
    placed on the CPU of a machine with a GPU by a device scope around its call alone gets
    barriers, which its compiler removes; a coordinator without a GPU that builds a step for
    GPU workers, with no device named, gets conditionals."""
    device_type = tf.DeviceSpec.from_string(t.op.device or "").device_type
    if device_type:
        return not device_type.upper().endswith("CPU")
    return bool(tf.config.get_visible_devices("GPU"))


def register_barrier_gradient() -> None:
    """Give ``XlaOptimizationBarrier`` its gradient, the identity (TensorFlow registers none),
    under its op type, for tf.gradients and tapes alike (a tape looks gradients up by op type
    alone, so ``gradient_override_map`` would not reach it). Once, on first use, not at import;
    a gradient someone registered before is left as it is. A process that differentiates a
    loaded SavedModel holding these barriers needs it too (docs/usage.md, "Under XLA")."""
    with _REGISTERING:
        try:
            ops.gradient_registry.lookup("XlaOptimizationBarrier")
        except LookupError:
            try:
                ops.RegisterGradient("XlaOptimizationBarrier")(_barrier_gradient)
            except KeyError:  # registered meanwhile, outside this lock
                pass


#: Two threads tracing at once must not both register (the registry refuses a second one).
_REGISTERING = threading.Lock()


def _barrier_gradient(op, *grads):  # pylint: disable=unused-argument
    return list(grads)


def warned(key: str) -> bool:
    """Whether :func:`warn_once` has said ``key``'s warning in this process (so a caller can
    skip the work of composing it again)."""
    return key in _warned


def warn_once(key: str, message: str, *args) -> None:
    """Log ``message % args`` as a warning the first time ``key`` is seen in this process (a
    step traced again says nothing new)."""
    if key in _warned:
        return
    _warned.add(key)
    _LOG.warning(message, *args)


def warn_unordered(what: str, tensors: Sequence[tf.Tensor]) -> None:
    """Say once per kind of construct that XLA may schedule some copies early."""
    warn_once(
        f"unordered {what}",
        "memsave_grads: under XLA, %s reads only %s (%s), which cannot carry a data "
        "dependency on the incoming gradient; XLA may compute it during the forward pass and "
        "keep what it reads. Gradients stay exact; only that part of the saving may be lost.",
        what, ", ".join(sorted({t.dtype.name for t in tensors})),
        ", ".join(t.name for t in tensors[:3]))
