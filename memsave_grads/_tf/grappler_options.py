"""Grappler options for the functions whose gradients we rewrote (design note "Grappler's
gradient accumulators" in docs/design.md).

Grappler's memory optimizer has a *scheduling* pass: where its static estimate of a graph's
peak passes 80% of the device's memory, it rewrites every sum of three or more gradients
(``AddN``) into an accumulator: a ``TemporaryVariable``, zeroed by a ``ZerosLike`` of one term,
then one ``AssignAdd`` per term. Constant folding then turns each ``ZerosLike`` of a static
shape into a ``Const`` the size of the activation, which the function keeps allocated between
steps. Two facts make that the usual case, not the exception:

- TensorFlow tells Grappler a CPU has 256 MiB (``device_lib.list_local_devices()`` reports a
  ``memory_limit`` of 268435456 whatever the machine has), so every CPU training step whose
  estimate passes 205 MiB is rewritten; on a GPU, every step near the card's memory is — the
  steps this library exists for;
- the terms are the gradients of an activation read by several ops (batch normalization reads
  its input three times in Keras 3), so the zero constants are activation-sized.

Measured on Keras 3 ResNet50 (64x64, batch 168, CPU, TF 2.21): the constants hold about 110 MiB
between steps, and a step's total peak (what was resident plus the step's own) is 890-981 MiB
under ``"memory"`` with the pass against 763-821 MiB without it (``budget:27%``: 669-687
against 579-592). Plain ``tf.gradients`` at batch 48 peaks at 639-642 MiB with it and 623-625
without.

:func:`without_grappler_scheduling` runs functions with the memory optimizer at
``SWAPPING_HEURISTICS``: everything ``DEFAULT_MEM_OPT`` does (GPU swapping heuristics, swaps
asked for with ``_swap_to_host``) except the scheduling pass. Grappler reads the option from
the *call* (``FunctionCallOptions.config_proto``, per thread), not from the trace, so it must
surround the calls of a ``tf.function``, in the thread that makes them (a
``ClusterCoordinator``'s worker threads do not see it). A function first called under it is
optimized once more for the new options; one already called outside it keeps its constants
while it lives, so make the first call inside. TensorFlow has no public switch for it
(``tf.config.optimizer`` leaves ``memory_optimization`` out), so this module sets the private
thread-local options.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

_MEMORY_OPTIONS = rewriter_config_pb2.RewriterConfig


def memory_optimization(config: config_pb2.ConfigProto) -> int:
    """The ``RewriterConfig.MemOptType`` that ``config`` asks Grappler's memory optimizer
    for."""
    return config.graph_options.rewrite_options.memory_optimization


def current_call_config() -> config_pb2.ConfigProto:
    """The ``ConfigProto`` that functions called from this thread are optimized with."""
    config = config_pb2.ConfigProto()
    serialized = context.context().function_call_options.config_proto_serialized
    config.ParseFromString(serialized)
    return config


@contextlib.contextmanager
def without_grappler_scheduling() -> Iterator[None]:
    """Run the ``tf.function`` calls made inside (from this thread) without Grappler's gradient
    accumulators (module docstring); other Grappler options are kept. A memory optimization
    chosen other than the default is left as it is.

    Example::

        step = tf.function(train_step)      # computes its gradients with memsave_grads
        with memsave_grads.without_grappler_scheduling():
            for batch in dataset:
                step(batch)

    :func:`memsave_grads.wrap_model` already runs ``fit`` and ``train_on_batch`` under it. In a
    TF1 ``Session``, set ``config.graph_options.rewrite_options.memory_optimization =
    RewriterConfig.SWAPPING_HEURISTICS`` in the session's ``ConfigProto`` instead.
    """
    eager = context.context()
    options = eager.function_call_options
    config = current_call_config()
    if memory_optimization(config) != _MEMORY_OPTIONS.DEFAULT_MEM_OPT:
        yield
        return
    config.graph_options.rewrite_options.memory_optimization = (
        _MEMORY_OPTIONS.SWAPPING_HEURISTICS)
    ours = context.FunctionCallOptions(executor_type=options.executor_type, config_proto=config)
    eager.function_call_options = ours
    try:
        yield
    finally:
        # TensorFlow's own setters (tf.config.optimizer.set_experimental_options, set_jit, ...)
        # drop the thread's options; where one ran inside the block, its result stays.
        current = eager._thread_local_data.function_call_options  # pylint: disable=protected-access
        if current is ours:
            eager.function_call_options = options
