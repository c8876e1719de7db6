"""TensorFlow forward graphs the tests share: stacks of tanh layers, with or without weights.

Each builder adds ops to the current graph (or traces into the current ``tf.function``) and
returns the last layer's output; the caller picks the inputs, the weights and the loss, which
is what the tests differ in. Kept apart from ``strategies.py`` so that the core's tests, which
import that, load no TensorFlow.
"""

import tensorflow as tf


def tanh_layers(h, layers: int, *, scale: float | None = None, residual: bool = False):
    """``layers`` elementwise layers without weights: ``tanh(h)``, ``tanh(scale * h)``, or with
    ``residual`` ``h + tanh(h)``. Every activation has the input's shape, so the memory
    measurements can count them in units of the input."""
    for _ in range(layers):
        layer = tf.tanh(h if scale is None else scale * h)
        h = h + layer if residual else layer
    return h


def residual_tanh_mlp(h, weights):
    """``h + tanh(h @ w)`` for each of ``weights`` (square matrices) in turn."""
    for w in weights:
        h = h + tf.tanh(tf.matmul(h, w))
    return h


def residual_mlp_step(x, weights, seen: list | None = None):
    """A ``step(checkpoints)`` for ``calibrate_budget``: the gradients of ``sum(h * h)`` over a
    residual tanh MLP (:func:`residual_tanh_mlp`) with respect to ``weights``; plain
    ``tf.gradients`` for ``None``. Each ``checkpoints`` it is called with is appended to
    ``seen``."""
    import memsave_grads as mg  # pylint: disable=import-outside-toplevel

    def step(checkpoints):
        if seen is not None:
            seen.append(checkpoints)
        h = residual_tanh_mlp(x, weights)
        loss = tf.reduce_sum(h * h)
        if checkpoints is None:
            return tf.gradients(loss, weights)
        return mg.gradients(loss, weights, checkpoints=checkpoints)

    return step


def updates_that_copied(sess, train, steps: int) -> list[str]:
    """The variable updates (``ResourceApply...`` ops) that allocated memory in ``steps`` traced
    runs of ``train``: an update allocates only where it found its variable's buffer shared
    with a value still read, and TensorFlow copied the whole weight first (copy-on-write)."""
    copied = []
    for _ in range(steps):
        metadata = tf.compat.v1.RunMetadata()
        sess.run(train, options=tf.compat.v1.RunOptions(
            trace_level=tf.compat.v1.RunOptions.FULL_TRACE), run_metadata=metadata)
        copied += [n.node_name for d in metadata.step_stats.dev_stats for n in d.node_stats
                   if "ResourceApply" in n.node_name and any(m.total_bytes for m in n.memory)]
    return copied
