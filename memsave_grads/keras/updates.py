"""How the wrapped step applies its gradients: all together after the backward pass, as stock
Keras does, or each weight's update as soon as its gradient is complete.

Design note "early release" (docs/design.md), for Keras' fit (3 and tf_keras): each weight's
update runs as soon as its gradient is complete, and the next gradient waits for it, so one
weight gradient is alive at a time instead of all of them (memsave_grads.minimize does the
same in a step of one's own). The optimizer's own apply_gradients builds the updates; its
iterations, learning-rate schedule and weight decay are untouched.
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

from memsave_grads import errors
from memsave_grads._tf import early_release
from memsave_grads._tf import graph as tf_graph
from memsave_grads._tf import ordering
from memsave_grads.keras.flavour import Flavour


def check_early_release(model, flavour: Flavour) -> None:
    """What cannot be released early, refused before the step is traced."""
    reason = early_release_refusal(model, flavour)
    if reason is not None:
        raise errors.InvalidArgumentError(
            f"release_gradients_early: the optimizer {type(model.optimizer).__name__} cannot "
            f"update the weights one by one: {reason}.")


def early_release_refusal(model, flavour: Flavour) -> str | None:
    """Why a Keras model's optimizer cannot update its weights one by one, or None."""
    optimizer = model.optimizer
    strategy = getattr(model, "distribute_strategy", None)
    distributed = tf.distribute.has_strategy() or (
        strategy is not None and strategy is not tf.distribute.get_strategy())
    if flavour.loss_scaled(optimizer):
        return ("it is a LossScaleOptimizer, which checks that every gradient is finite "
                "before it applies any; train in float32, or without release_gradients_early")
    if getattr(optimizer, "global_clipnorm", None):
        return ("global_clipnorm scales every gradient by the norm of all of them, which is "
                "known only when the last one is; use clipnorm or clipvalue (per weight)")
    if getattr(optimizer, "gradient_accumulation_steps", None):
        return ("gradient_accumulation_steps adds the gradients up over several steps; "
                "accumulate with a larger batch instead, which memsave_grads makes room for")
    if distributed:
        return (f"under {type(strategy or tf.distribute.get_strategy()).__name__} it "
                "sums every gradient over the strategy's replicas in one op (even with one "
                "replica); wrap without release_gradients_early")
    return flavour.gradient_sum_refusal(optimizer)


def updates_wait_for_gradients(model, flavour: Flavour, release_gradients_early: bool) -> bool:
    """Whether the wrapped step builds each weight's update to wait for its own gradient
    (design note "early release"): always with ``release_gradients_early``, and by default
    where nothing needs all the gradients at once (outside a strategy, no loss scaling, no
    global clipping or gradient accumulation, not under XLA, which drops the edges).
    Otherwise the optimizer holds every weight gradient until the last is done."""
    if release_gradients_early:
        return True
    if getattr(model, "optimizer", None) is None:
        return False
    return (early_release_refusal(model, flavour) is None
            and not ordering.xla_in_effect(tf.compat.v1.get_default_graph()))


def apply_releasing_early(model, flavour: Flavour, loss, compute_gradients: Callable[[], list],
                          release_order: bool) -> None:
    """``compute_gradients()`` (of ``loss`` w.r.t. the trainable weights), then the
    optimizer's updates, each waiting for its own gradient; with ``release_order``, also one
    gradient alive at a time (``early_release.order_updates_early``)."""
    optimizer = model.optimizer
    variables = list(model.trainable_weights)
    graph = tf.compat.v1.get_default_graph()
    grad_floor = tf_graph.last_op_id(graph)
    grads = compute_gradients()
    apply_floor = tf_graph.last_op_id(graph)
    # Outside a strategy the sum over one replica is the gradients themselves, but Keras builds
    # it as one op over all of them, which would hold every gradient until the last is
    # complete: the flavour skips it. Strategies never get here: release_gradients_early
    # refuses them (check_early_release) and the default step takes this path only where
    # early_release_refusal finds nothing.
    tf_variables = flavour.apply_unsummed(optimizer, grads, variables)
    handles = [tf.convert_to_tensor(v.handle) for v in tf_variables]
    early_release.order_updates_early(loss, tf_variables, handles, grads, grad_floor,
                                      apply_floor, type(optimizer).__name__,
                                      "memsave_grads.keras", release_order=release_order)


def order_own_step_updates(model, flavour: Flavour, made: Sequence) -> None:
    """Order the updates a model's own ``train_step`` made from the gradients it took through
    memsave_grads (``made``: the ``api.GradientsCall`` records of its trace) as the default
    step orders its own (design note "early release"): no release order (Keras applies the
    gradients together), but each variable's writes wait for the ops holding its forward
    value, and its update's gradient-free terms (tf_keras' SGD computes ``m * momentum`` even
    at momentum 0) for its gradient. Left to dataflow where the default step leaves them
    (strategies, loss scaling, global clipping, XLA) and where the step took several
    gradients (a GAN's two tapes): which updates belong to which is not known; and where
    the gradient was taken in another graph than the step's updates (inside a nested
    ``tf.function`` returning it): the edges cannot cross graphs."""
    if len(made) != 1 or not updates_wait_for_gradients(model, flavour, False):
        return
    call = made[0]
    graph = tf.compat.v1.get_default_graph()
    if call.graph is not graph:
        return
    handles, grads = [], []
    for x, grad in zip(call.xs, call.grads):
        # A variable's handle (a routed tape's sources are handles; memsave_grads.gradients
        # may be given the variables), as the step's ops read it: an eager handle through
        # its capture.
        handle = x if getattr(x, "dtype", None) == tf.resource else getattr(x, "handle", None)
        handle = None if handle is None else tf_graph.as_seen_from(handle, graph)
        if grad is not None and handle is not None:
            handles.append(handle)
            grads.append(grad)
    if not handles:
        return
    early_release.order_updates_early(
        call.ys, handles, handles, grads, call.before_op_id, call.after_op_id,
        type(model.optimizer).__name__, "memsave_grads.keras", release_order=False,
        all_applied=False)
