"""``gradients()``: normalise arguments -> select checkpoints -> rewrite -> stitch."""

from __future__ import annotations

import dataclasses

import tensorflow as tf
from absl import logging

from memsave_grads import _select
from memsave_grads import _stitch
from memsave_grads import _tf_graph
from memsave_grads import budgets
from memsave_grads import errors

#: Keyword arguments of tf.gradients we pass through (``name`` included).
TF_GRADIENTS_KWARGS = ("name", "gate_gradients", "aggregation_method", "stop_gradients",
                       "unconnected_gradients", "colocate_gradients_with_ops")


def _as_list(value, argname: str, allow_none: bool = False) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    if value is None and not allow_none:
        raise errors.InvalidArgumentError(
            f"{argname}: expected a tensor or a list of tensors, got None.")
    return [value]


def _check_graph_tensor(value, where: str, allow_variable: bool) -> tf.Tensor:
    if allow_variable and _tf_graph.is_resource_variable(value):
        # Inside tf.function a variable created outside has an eager handle; converting it in
        # the function's graph gives the captured placeholder its reads consume.
        value = tf.convert_to_tensor(value.handle)
    elif isinstance(value, tf.Variable):
        raise errors.InvalidTypeError(
            f"{where}: got a reference (non-resource) variable {value.name!r}. Use resource "
            "variables (the TF 2 default), or pass the variable's value tensor.")
    if _tf_graph.is_eager_tensor(value):
        raise errors.EagerExecutionError(
            f"{where}: got an eager tensor; memsave_grads rewrites graphs, and eager tensors have "
            "none. Call it inside a tf.function or a tf.Graph (tf.compat.v1 graph mode), or use "
            "tf.GradientTape in eager code.")
    if not isinstance(value, tf.Tensor):
        expected = "a tf.Tensor or a resource variable" if allow_variable else "a tf.Tensor"
        raise errors.InvalidTypeError(
            f"{where}: expected {expected}, got {type(value).__name__}: {value!r:.80}.")
    return value


def _normalise(ys, xs, grad_ys):
    ys = [_check_graph_tensor(y, f"ys[{i}]", allow_variable=True)
          for i, y in enumerate(_as_list(ys, "ys"))]
    if not ys:
        raise errors.InvalidArgumentError("ys: got an empty list; pass at least one tensor.")
    graph = ys[0].graph
    with graph.as_default():
        xs = [_check_graph_tensor(x, f"xs[{i}]", allow_variable=True)
              for i, x in enumerate(_as_list(xs, "xs"))]
    if not xs:
        raise errors.InvalidArgumentError(
            "xs: got an empty list; pass the tensors or variables to differentiate with respect to.")
    for name, tensors in (("ys", ys), ("xs", xs)):
        for i, t in enumerate(tensors):
            if t.graph is not graph:
                raise errors.InvalidArgumentError(
                    f"{name}[{i}]: {t.name!r} belongs to another graph than ys[0] "
                    f"({ys[0].name!r}). Build xs and ys in the same graph or tf.function.")
    for name, tensors in (("ys", ys), ("xs", xs)):
        if not any(_tf_graph.carries_gradients(t) for t in tensors):
            given = ", ".join(f"{t.name!r} ({t.dtype.name})" for t in tensors[:3])
            raise errors.NotDifferentiableError(
                f"{name}: expected at least one floating-point or complex tensor, got only "
                f"{given}{', ...' if len(tensors) > 3 else ''}. Gradients do not flow through "
                "integer or boolean tensors (tf.gradients returns None for them); differentiate "
                "a float loss with respect to float tensors or variables, casting with tf.cast "
                "where needed.")
    if grad_ys is None:
        grad_ys = [None] * len(ys)
    else:
        grad_ys = _as_list(grad_ys, "grad_ys")
        if len(grad_ys) != len(ys):
            raise errors.InvalidArgumentError(
                f"grad_ys: expected one entry per y ({len(ys)}), got {len(grad_ys)}. Pass None "
                "for a y whose initial gradient is ones.")
    return graph, ys, xs, grad_ys


@tf.autograph.experimental.do_not_convert
def gradients(ys, xs, grad_ys=None, checkpoints="collection", **tf_gradients_kwargs):
    """``tf.gradients(ys, xs, grad_ys)`` that recomputes forward activations to save memory.

    Keeps only the *checkpoint* tensors of the forward pass alive for the backward pass and
    recomputes the rest, segment by segment, as backprop reaches them.

    Args:
      ys: a tensor or list of tensors to differentiate.
      xs: a tensor, resource variable, or list of them.
      grad_ys: optional initial gradients, one per y (as in ``tf.gradients``).
      checkpoints: what to keep. A strategy name: ``"collection"`` (tensors in the graph
        collection ``"checkpoints"``), ``"speed"`` (outputs of matmul/conv/einsum ops),
        ``"memory"`` (about sqrt(N) tensors that separate the graph, chosen automatically);
        or a list of tensors; or a list of name patterns (globs over op names, or over tensor
        names when they contain ``:``).
      **tf_gradients_kwargs: passed on as in ``tf.gradients``: ``name``, ``gate_gradients``,
        ``aggregation_method``, ``stop_gradients``, ``unconnected_gradients``,
        ``colocate_gradients_with_ops``.

    Returns:
      What ``tf.gradients`` returns: a list with one gradient (tensor, ``IndexedSlices`` or
      ``None``) per x.

    Raises:
      MemsaveGradsError subclasses (also ValueError/TypeError/RuntimeError) on bad input, and
      ``NoCheckpointsFoundError`` when the strategy finds nothing to keep.
    """
    prepared = _prepare(ys, xs, grad_ys, checkpoints, tf_gradients_kwargs)
    with prepared.graph.as_default():
        return _stitch.backprop(
            prepared.ys, prepared.xs, prepared.grad_ys, prepared.region, prepared.kept,
            prepared.user_stops, prepared.tf_kwargs,
            unconnected_zero=prepared.unconnected == tf.UnconnectedGradients.ZERO,
            scope_prefix=f"{prepared.scope}_memsave",
            nested=_stitch.nested_ops(getattr(prepared.selection.plan, "nested", None),
                                      prepared.region))  # design note "multi-level"


@dataclasses.dataclass
class _Prepared:
    """Validated arguments and the chosen plan: everything up to (not including) the rewrite."""

    graph: tf.Graph
    ys: list
    xs: list
    grad_ys: list
    user_stops: list
    tf_kwargs: dict
    unconnected: tf.UnconnectedGradients
    scope: str
    selection: _select.SelectionContext
    chosen: set
    kept: set

    @property
    def region(self) -> list:
        return self.selection.region


def _prepare(ys, xs, grad_ys, checkpoints, tf_gradients_kwargs,
             select: bool = True) -> _Prepared:
    """Validate the arguments and choose what to keep (unless not ``select``); adds nothing to
    the graph."""
    unknown = sorted(set(tf_gradients_kwargs) - set(TF_GRADIENTS_KWARGS))
    if unknown:
        raise errors.InvalidTypeError(
            f"gradients() got unexpected keyword argument(s) {unknown}; memsave_grads passes on "
            f"only tf.gradients' own: {list(TF_GRADIENTS_KWARGS)}.")
    graph, ys, xs, grad_ys = _normalise(ys, xs, grad_ys)
    kwargs = dict(tf_gradients_kwargs)
    user_stops = [_check_graph_tensor(t, f"stop_gradients[{i}]", allow_variable=False)
                  for i, t in enumerate(_as_list(kwargs.pop("stop_gradients", None),
                                                 "stop_gradients", allow_none=True))
                  if t is not None]
    unconnected = kwargs.pop("unconnected_gradients", tf.UnconnectedGradients.NONE)
    try:
        unconnected = tf.UnconnectedGradients(unconnected)
    except ValueError:
        raise errors.InvalidArgumentError(
            f"unconnected_gradients: expected 'none' or 'zero' (tf.UnconnectedGradients), got "
            f"{unconnected!r}.") from None
    scope = kwargs.get("name") or "gradients"

    with graph.as_default():
        region = _tf_graph.forward_region(ys, xs, stop_ops={t.op for t in user_stops})
        must_keep = _select.forced_keep(region, xs)
        ctx = _select.SelectionContext(graph=graph, region=region, xs=xs, ys=ys,
                                       must_keep=must_keep)
        chosen = _select.select(ctx, checkpoints) if select else set()
        kept = _select.single_owner(ctx, must_keep | chosen)
    logging.vlog(1, "memsave_grads: %d forward ops, %d checkpoints chosen, %d kept in all",
                 len(region), len(chosen), len(kept))
    return _Prepared(graph=graph, ys=ys, xs=xs, grad_ys=grad_ys, user_stops=user_stops,
                     tf_kwargs=kwargs, unconnected=unconnected, scope=scope, selection=ctx,
                     chosen=chosen, kept=kept)


#: What a caller that wraps tf.gradients (patch, Keras) does where we have nothing to gain.
FALLBACKS = ("warn", "error")


def check_deferred_options(checkpoints, fallback: str) -> None:
    """Validate, before any graph exists, what a later ``gradients_or_fallback`` call will use:
    ``fallback``, a strategy name, a budget string. (Tensors and patterns are checked when the
    graph is there.)"""
    if fallback not in FALLBACKS:
        raise errors.InvalidArgumentError(
            f"fallback: expected one of {list(FALLBACKS)}, got {fallback!r}.")
    if budgets.is_budget_string(checkpoints):
        budgets.Budget.parse(checkpoints)  # a malformed budget fails now, not at first use
    elif isinstance(checkpoints, str) and checkpoints not in _select.STRATEGIES:
        raise errors.UnknownStrategyError(
            f"checkpoints: unknown strategy {checkpoints!r}. Expected one of "
            f"{sorted(_select.STRATEGIES)}, a budget ('budget:4GiB', 'budget:50%', "
            "memsave_grads.Budget), a list of tensors, or a list of name patterns.")


def gradients_or_fallback(ys, xs, grad_ys, checkpoints, fallback: str, caller: str,
                          **tf_gradients_kwargs):
    """:func:`gradients`, or the original ``tf.gradients`` where the strategy has nothing to
    gain or the graph cannot be rewritten (``errors.FALLBACK_ERRORS``): logged for
    ``fallback="warn"``, raised for ``"error"``."""
    try:
        return gradients(ys, xs, grad_ys, checkpoints=checkpoints, **tf_gradients_kwargs)
    except errors.FALLBACK_ERRORS as exc:
        if fallback == "error":
            raise
        logging.warning("%s: falling back to tf.gradients: %s", caller, exc)
        return _tf_graph.ORIGINAL_GRADIENTS(ys, xs, grad_ys, **tf_gradients_kwargs)


def _shortcut(strategy: str):
    @tf.autograph.experimental.do_not_convert
    def shortcut(ys, xs, grad_ys=None, **tf_gradients_kwargs):
        return gradients(ys, xs, grad_ys, checkpoints=strategy, **tf_gradients_kwargs)

    shortcut.__name__ = f"gradients_{strategy}"
    shortcut.__qualname__ = shortcut.__name__
    shortcut.__doc__ = f"``gradients(..., checkpoints={strategy!r})``."
    return shortcut


gradients_speed = _shortcut("speed")
gradients_memory = _shortcut("memory")
gradients_collection = _shortcut("collection")
