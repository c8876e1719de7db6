"""``minimize()``: one training step that applies each variable's update as soon as its
gradient is complete, so weight gradients die one by one instead of all living until the
optimizer runs (layer-wise update, as in Apache SINGA's backward; design note "early release"
in docs/design.md, measurements in docs/minimize.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from memsave_grads._tf import early_release
from memsave_grads._tf import graph as tf_graph
from memsave_grads import _validate
from memsave_grads import api
from memsave_grads import errors

_V1 = "tf.compat.v1.train"
_KERAS = "tf_keras"


def _optimizer_family(optimizer) -> str:
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return _V1
    packages = {cls.__module__.split(".")[0] for cls in type(optimizer).__mro__
                if "optimizer" in cls.__module__}
    if "tf_keras" in packages and callable(getattr(optimizer, "apply_gradients", None)):
        return _KERAS
    if "keras" in packages:
        raise errors.InvalidTypeError(
            f"optimizer: got a Keras 3 optimizer ({type(optimizer).__name__}; tf.keras is Keras 3 "
            "in TF >= 2.16), which minimize() does not take: its apply step sums every "
            "gradient in one op, so all gradients would be alive until every one is complete. "
            "For Keras 3's fit use memsave_grads.wrap_model(model, release_gradients_early="
            "True), which skips that sum; here, a Keras 2 optimizer (tf_keras.optimizers.*) or a "
            "tf.compat.v1.train optimizer.")
    raise errors.InvalidTypeError(
        f"optimizer: expected a tf.compat.v1.train.Optimizer (GradientDescentOptimizer, "
        f"AdamOptimizer, MomentumOptimizer, ...) or a Keras 2 optimizer "
        f"(tf_keras.optimizers.*), got {type(optimizer).__name__}: {optimizer!r:.80}. Pass an "
        f"optimizer instance, not its class or a learning rate.")


def _check_loss(loss) -> tf.Tensor:
    if callable(loss) and not isinstance(loss, (tf.Tensor, tf.Variable)):
        raise errors.InvalidTypeError(
            "loss: expected a scalar float tf.Tensor, got a callable. minimize() works on a "
            "graph: build the loss first (in a tf.compat.v1 graph or inside tf.function) and "
            "pass the tensor.")
    loss = _validate.check_graph_tensor(loss, "loss", allow_variable=False)
    if not loss.dtype.is_floating:
        raise errors.NotDifferentiableError(
            f"loss: expected a floating-point scalar, got {loss.name!r} of dtype "
            f"{loss.dtype.name}. Cast it with tf.cast(loss, tf.float32).")
    if loss.shape.rank is not None and loss.shape.rank != 0:
        raise errors.InvalidArgumentError(
            f"loss: expected a scalar (rank 0), got {loss.name!r} of shape {loss.shape}. "
            "Reduce it first, e.g. tf.reduce_mean(loss).")
    return loss


def _default_var_list(graph: tf.Graph) -> list:
    if getattr(graph, "building_function", False):
        raise errors.InvalidArgumentError(
            "var_list: required inside tf.function (the graph collections of trainable "
            "variables are empty there); pass the variables, e.g. model.trainable_variables.")
    with graph.as_default():
        found = (tf.compat.v1.trainable_variables()
                 + tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES))
    unique, seen = [], set()
    for v in found:
        if id(v) not in seen:
            seen.add(id(v))
            unique.append(v)
    if not unique:
        raise errors.InvalidArgumentError(
            "var_list: None and the graph has no trainable variables; pass var_list.")
    return unique


def _check_var_list(var_list, graph: tf.Graph) -> list:
    if var_list is None:
        var_list = _default_var_list(graph)
    elif isinstance(var_list, tf.Variable) or not isinstance(var_list, (list, tuple)):
        raise errors.InvalidTypeError(
            f"var_list: expected a list of resource variables, got "
            f"{type(var_list).__name__}: {var_list!r:.80}. Wrap a single variable in a list.")
    var_list = list(var_list)
    if not var_list:
        raise errors.InvalidArgumentError("var_list: got an empty list; pass the variables to "
                                          "train.")
    seen = set()
    for i, v in enumerate(var_list):
        if not tf_graph.is_resource_variable(v):
            what = ("a reference (non-resource) variable" if isinstance(v, tf.Variable)
                    else f"{type(v).__name__}: {v!r:.60}")
            raise errors.InvalidTypeError(
                f"var_list[{i}]: expected a resource variable (tf.Variable in TF 2, or "
                f"use_resource=True in TF 1 code), got {what}. minimize() updates variables; "
                f"to differentiate tensors use memsave_grads.gradients.")
        if id(v) in seen:
            raise errors.InvalidArgumentError(
                f"var_list[{i}]: variable {v.name!r} is listed twice; list each variable once.")
        seen.add(id(v))
    return var_list


@tf.autograph.experimental.do_not_convert
def minimize(loss: tf.Tensor, optimizer: Any, var_list: Sequence[tf.Variable] | None = None,
             checkpoints: api.Checkpoints = "memory", global_step: tf.Variable | None = None,
             name: str | None = None) -> Any:
    """``optimizer.minimize(loss, var_list=var_list)`` with each update applied early.

    Computes the gradients with :func:`memsave_grads.gradients` (``checkpoints=None``: plain
    ``tf.gradients``), calls ``optimizer.apply_gradients`` once, and then adds control
    dependencies so that (1) a variable is written only after every op of this step that reads
    its forward value (no copy-on-write of the weight), (2) update ops that need no gradient
    (``momentum * m``) wait for it, and (3) the backward ops that allocate the next weight
    gradient wait for the update that consumes the previous one. One weight gradient is then
    alive at a time instead of several (docs/minimize.md).

    Optimizer-wide state (v1 Adam's ``beta1_power``/``beta2_power``, ``global_step``, Keras'
    ``iterations``) is updated by the optimizer's own ``apply_gradients``: once, after every
    variable's update.

    Args:
      loss: a scalar floating-point tensor, in a ``tf.compat.v1`` graph or a ``tf.function``.
      optimizer: a ``tf.compat.v1.train.Optimizer`` (v1 graph or ``tf.function``), or a
        Keras 2 optimizer (``tf_keras.optimizers.*`` or ``tf_keras.optimizers.legacy.*``)
        inside ``tf.function``.
      var_list: resource variables to update; default (v1 graph only): the graph's trainable
        variables, as ``optimizer.minimize`` does.
      checkpoints: as in :func:`memsave_grads.gradients`, or ``None`` for ``tf.gradients``
        (no recomputation; the early updates still apply).
      global_step: v1 optimizers only: a variable incremented once after all updates.
      name: name of the returned update op (v1 optimizers).

    Returns:
      What ``optimizer.apply_gradients`` returns: the train op (v1), or the Keras optimizer's
      iteration counter.

    Raises:
      InvalidTypeError / InvalidArgumentError / NotDifferentiableError /
      EagerExecutionError for bad arguments, before anything is added to the graph.
    """
    family = _optimizer_family(optimizer)
    loss = _check_loss(loss)
    graph = loss.graph
    var_list = _check_var_list(var_list, graph)
    if global_step is not None and family != _V1:
        raise errors.InvalidArgumentError(
            "global_step: only tf.compat.v1.train optimizers take it; a Keras optimizer counts "
            "steps in optimizer.iterations.")
    if tf.distribute.has_strategy():
        raise errors.InvalidArgumentError(
            f"minimize() under {type(tf.distribute.get_strategy()).__name__}: not supported (the "
            "optimizer's cross-replica update cannot be ordered per variable). Use "
            "memsave_grads.gradients inside strategy.run and optimizer.apply_gradients "
            "(docs/distribute.md).")

    with graph.as_default():
        handles = [tf.convert_to_tensor(v.handle) for v in var_list]
        for i, (v, h) in enumerate(zip(var_list, handles)):
            if h.graph is not graph:
                raise errors.InvalidArgumentError(
                    f"var_list[{i}]: variable {v.name!r} belongs to another graph than loss "
                    f"{loss.name!r}. Build the loss from these variables in the same graph.")
        # Refuse a loss that reaches no variable before adding anything to the graph.
        region = set(tf_graph.forward_region([loss], handles))
        connected = [any(c in region for c in h.consumers()) for h in handles]
        if not any(connected):
            names = ", ".join(repr(v.name) for v in var_list[:3])
            raise errors.InvalidArgumentError(
                f"var_list: loss {loss.name!r} depends on none of the variables ({names}"
                f"{', ...' if len(var_list) > 3 else ''}). Pass the variables the loss is "
                "computed from.")

        grad_floor = tf_graph.last_op_id(graph)
        if checkpoints is None:
            grads = tf_graph.ORIGINAL_GRADIENTS([loss], var_list)
        else:
            grads = api.gradients(loss, var_list, checkpoints=checkpoints)
        apply_floor = tf_graph.last_op_id(graph)
        grads_and_vars = list(zip(grads, var_list))
        if family == _V1:
            result = optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                               name=name)
        else:
            # No cross-replica aggregation (we refuse strategies above, so it would sum one
            # replica): Keras does it with one IdentityN over *all* gradients, which holds every
            # gradient until the last one is complete and defeats the early updates.
            result = optimizer.apply_gradients(grads_and_vars, name=name,
                                               experimental_aggregate_gradients=False)
        early_release.order_updates_early(loss, var_list, handles, grads, grad_floor,
                                          apply_floor, type(optimizer).__name__,
                                          "memsave_grads.minimize")
    return result
