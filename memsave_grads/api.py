"""``gradients()``: normalise arguments -> select checkpoints -> rewrite -> stitch."""

from __future__ import annotations

import dataclasses
import numbers
import re

import numpy as np
import tensorflow as tf
from absl import logging

from memsave_grads._tf import selection
from memsave_grads._tf import stitch
from memsave_grads._tf import graph as tf_graph
from memsave_grads.core import budgets
from memsave_grads import errors

#: Keyword arguments of tf.gradients we pass through (``name`` included).
TF_GRADIENTS_KWARGS = ("name", "gate_gradients", "aggregation_method", "stop_gradients",
                       "unconnected_gradients", "colocate_gradients_with_ops")

#: ``aggregation_method`` values tf.gradients accepts besides None (``DEFAULT`` is ``ADD_N``).
AGGREGATION_METHODS = {
    "ADD_N": tf.AggregationMethod.ADD_N,
    "EXPERIMENTAL_TREE": tf.AggregationMethod.EXPERIMENTAL_TREE,
    "EXPERIMENTAL_ACCUMULATE_N": tf.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N,
}

# TensorFlow's own rules for a name scope (tensorflow/python/framework/ops.py, from
# core/framework/node_def_util.cc): at the root the first character may not be '_', '-', '/'
# or '\\'; inside another scope it may.
_ROOT_SCOPE_NAME = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_.\\/>-]*$")
_NESTED_SCOPE_NAME = re.compile(r"^[A-Za-z0-9_.\\/>-]*$")


def _as_list(value, argname: str, allow_none: bool = False) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    if value is None and not allow_none:
        raise errors.InvalidArgumentError(
            f"{argname}: expected a tensor or a list of tensors, got None.")
    return [value]


def _check_graph_tensor(value, where: str, allow_variable: bool) -> tf.Tensor:
    if allow_variable and tf_graph.is_resource_variable(value):
        # Inside tf.function a variable created outside has an eager handle; converting it in
        # the function's graph gives the captured placeholder its reads consume.
        value = tf.convert_to_tensor(value.handle)
    elif isinstance(value, tf.Variable):
        raise errors.InvalidTypeError(
            f"{where}: got a variable {value.name!r}; pass the tensor computed from it.")
    if tf_graph.is_eager_tensor(value):
        raise errors.EagerExecutionError(
            f"{where}: got an eager tensor; memsave_grads rewrites graphs, and eager tensors have "
            "none. Call it inside a tf.function or a tf.Graph (tf.compat.v1 graph mode), or use "
            "tf.GradientTape in eager code.")
    if not isinstance(value, tf.Tensor):
        expected = "a tf.Tensor or a resource variable" if allow_variable else "a tf.Tensor"
        raise errors.InvalidTypeError(
            f"{where}: expected {expected}, got {type(value).__name__}: {value!r:.80}.")
    return value


def _given_x(value, where: str, graph: tf.Graph):
    """An ``x`` as given, as a tensor: a variable's handle (resource) or ``_ref`` tensor
    (TF1 reference variable, what tf.gradients differentiates), or the tensor itself."""
    if tf_graph.is_resource_variable(value):
        return value.handle
    if tf_graph.is_reference_variable(value):
        with graph.as_default():
            return tf_graph.reference_tensor(value)
    if tf_graph.is_eager_tensor(value):
        if not tf_graph.is_function_graph(graph):
            raise errors.EagerExecutionError(
                f"{where}: got an eager tensor, but ys were built in a tf.Graph, which cannot "
                "read eager values. Pass a tensor of that graph, or differentiate inside the "
                "tf.function that uses the eager value (it captures it).")
        return value
    if not isinstance(value, tf.Tensor):
        raise errors.InvalidTypeError(
            f"{where}: expected a tf.Tensor or a variable, got {type(value).__name__}: "
            f"{value!r:.80}.")
    return value


def _resolve_x(given, where: str, graph: tf.Graph, y_name: str):
    """``given`` as the ops of ``graph`` read it: itself, or the placeholder that captured it
    from an enclosing graph (design note "captured xs"); None where ``graph`` never reads it
    (its gradient is None, as in tf.gradients)."""
    if tf_graph.is_eager_tensor(given) or tf_graph.encloses(given.graph, graph):
        return tf_graph.as_seen_from(given, graph)
    raise errors.InvalidArgumentError(
        f"{where}: {given.name!r} belongs to a graph that neither is nor encloses the graph of "
        f"ys[0] ({y_name!r}), so ys cannot depend on it. Differentiate with respect to tensors "
        "of the same graph or tf.function, or of a graph enclosing it.")


def _normalise(ys, xs, grad_ys):
    """Validated ``(graph, ys, given_xs, xs, grad_ys)``: ``given_xs`` as tensors (variables
    turned into what tf.gradients differentiates), ``xs`` the same as read in ys' graph (None
    where never read there)."""
    ys = [_check_graph_tensor(y, f"ys[{i}]", allow_variable=True)
          for i, y in enumerate(_as_list(ys, "ys"))]
    if not ys:
        raise errors.InvalidArgumentError("ys: got an empty list; pass at least one tensor.")
    # ys may also come from graphs enclosing the innermost one, as in tf.gradients.
    graph = next((t.graph for t in ys if all(tf_graph.encloses(u.graph, t.graph) for u in ys)),
                 None)
    if graph is None:
        raise errors.InvalidArgumentError(
            f"ys: {', '.join(repr(t.name) for t in ys[:4])} belong to graphs of which none is "
            "enclosed by all the others (a tf.function and its enclosing graphs). Build all ys "
            "in one graph or tf.function, or in graphs enclosing it.")
    inner_name = next(t.name for t in ys if t.graph is graph)
    given_xs = [_given_x(x, f"xs[{i}]", graph) for i, x in enumerate(_as_list(xs, "xs"))]
    resolved = [_resolve_x(x, f"xs[{i}]", graph, inner_name) for i, x in enumerate(given_xs)]
    for name, tensors in (("ys", ys), ("xs", given_xs)):
        if tensors and not any(tf_graph.carries_gradients(t) for t in tensors):
            given = ", ".join(f"{_describe_tensor(t)} ({t.dtype.name})" for t in tensors[:3])
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
    return graph, ys, given_xs, resolved, grad_ys


def _describe_tensor(t) -> str:
    return repr(t.name) if not tf_graph.is_eager_tensor(t) else "an eager tensor"


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
    if not selection.decide_schedule(prepared.selection, checkpoints, prepared.chosen,
                                   prepared.kept).rewrite:  # design note "never worse"
        return tf_graph.ORIGINAL_GRADIENTS(ys, xs, grad_ys, **tf_gradients_kwargs)
    with prepared.graph.as_default():
        grads = stitch.backprop(
            prepared.ys, prepared.xs, prepared.grad_ys, prepared.region, prepared.kept,
            prepared.user_stops, prepared.tf_kwargs,
            unconnected_zero=prepared.unconnected == tf.UnconnectedGradients.ZERO,
            scope_prefix=f"{prepared.scope}_memsave",
            nested=stitch.nested_ops(getattr(prepared.selection.plan, "nested", None),
                                      prepared.region))  # design note "multi-level"
        return prepared.per_given_x(grads)


def _check_not_finalized(graph: tf.Graph) -> None:
    if graph.finalized:
        raise errors.FinalizedGraphError(
            "ys: the graph of ys is finalized (graph.finalize() was called, as "
            "tf.compat.v1.train.MonitoredSession and Supervisor do), so no gradient op can be "
            "added to it; tf.gradients cannot add its own either. Build the gradients (or call "
            "optimizer.minimize) before the graph is finalized, i.e. before creating the session.")


def _check_same_or_enclosing_graph(t: tf.Tensor, where: str, what: str, graph: tf.Graph) -> None:
    # A tf.function captures tensors of the graphs it is traced in, so tf.gradients accepts
    # them there; any other graph is an error in TensorFlow too ("must be from the same graph").
    if not tf_graph.is_eager_tensor(t) and not tf_graph.encloses(t.graph, graph):
        raise errors.InvalidArgumentError(
            f"{where}: {what} {t.name!r} belongs to a graph that neither is nor encloses the "
            "graph of ys. Build it in the graph (or tf.function) that computes ys.")


def _grad_y_signature(grad_y, where: str, graph: tf.Graph) -> tuple[tf.DType, tf.TensorShape]:
    """The dtype and static shape ``grad_y`` has once tf.gradients converts it, found without
    adding an op (a constant would be one)."""
    if isinstance(grad_y, tf.IndexedSlices):
        for part in (grad_y.values, grad_y.indices, grad_y.dense_shape):
            if isinstance(part, tf.Tensor):
                _check_same_or_enclosing_graph(part, where, "the IndexedSlices' tensor", graph)
        return grad_y.dtype, grad_y.shape  # an unknown dense_shape gives an unknown shape
    if tf_graph.is_resource_variable(grad_y):
        _check_same_or_enclosing_graph(grad_y.handle, where, "the variable handle", graph)
        return grad_y.dtype, grad_y.shape
    if tf_graph.is_reference_variable(grad_y):
        _check_same_or_enclosing_graph(tf_graph.reference_tensor(grad_y), where,
                                       "the variable", graph)
        return grad_y.dtype.base_dtype, grad_y.shape
    if isinstance(grad_y, tf.Tensor):
        if tf_graph.is_eager_tensor(grad_y) and not tf_graph.is_function_graph(graph):
            raise errors.EagerExecutionError(
                f"{where}: got an eager tensor, which a tf.Graph cannot read (only a "
                "tf.function captures eager values). Build grad_ys in the graph of ys, or pass "
                "a NumPy array.")
        _check_same_or_enclosing_graph(grad_y, where, "the tensor", graph)
        return grad_y.dtype, grad_y.shape
    if isinstance(grad_y, (np.ndarray, np.generic)):
        try:
            return tf.as_dtype(grad_y.dtype), tf.TensorShape(grad_y.shape)
        except TypeError:
            pass  # an object array: refused below
    else:
        try:  # what tf.constant would make of a number or nested list, without making it
            proto = tf.make_tensor_proto(grad_y)
            return tf.as_dtype(proto.dtype), tf.TensorShape(proto.tensor_shape)
        except (TypeError, ValueError):
            pass
    raise errors.InvalidTypeError(
        f"{where}: expected a tf.Tensor, tf.IndexedSlices, NumPy array, number or nested list "
        f"(or None for ones), got {type(grad_y).__name__}: {grad_y!r:.80}.")


def _check_grad_ys(ys: list, grad_ys: list, graph: tf.Graph) -> None:
    """What tf.gradients (``gradients_util._DefaultGradYs``) refuses, refused before any op
    exists; and more strictly: a float or complex y needs a grad_y of its own dtype and a
    compatible shape (tf.gradients fails later, in some op's gradient, or broadcasts silently)."""
    for i, (y, grad_y) in enumerate(zip(ys, grad_ys)):
        where, y_desc = f"grad_ys[{i}]", f"ys[{i}] {y.name!r}"
        if grad_y is None:
            if y.dtype.is_complex:
                raise errors.InvalidTypeError(
                    f"{where}: {y_desc} is complex ({y.dtype.name}), so its initial gradient "
                    "cannot default to ones (tf.gradients refuses it too); got None. Pass the "
                    "initial gradient explicitly.")
            continue
        dtype, shape = _grad_y_signature(grad_y, where, graph)
        if y.dtype.is_floating or y.dtype.is_complex:
            dtype_ok = dtype.base_dtype == y.dtype.base_dtype
            expected = y.dtype.name
        elif y.dtype.is_integer:
            dtype_ok = dtype.is_integer or dtype.is_floating
            expected = "an integer or floating-point dtype"
        elif y.dtype == tf.resource:  # a variable's handle: its gradient is a value, not a handle
            dtype_ok = dtype != tf.resource
            expected = "a numeric dtype"
        elif y.dtype == tf.variant:
            dtype_ok = dtype == tf.variant
            expected = "variant"
        else:
            raise errors.InvalidTypeError(
                f"{where}: {y_desc} has dtype {y.dtype.name}, which carries no gradient, so it "
                "takes no initial gradient; got one. Pass None for it, or leave it out of ys.")
        if not dtype_ok:
            raise errors.InvalidTypeError(
                f"{where}: expected {expected} (the dtype of {y_desc}), got {dtype.name}. "
                f"Cast it: tf.cast(grad_y, {y.dtype.name!r}).")
        # A handle's static shape is () whatever the variable's: nothing to compare there.
        if y.dtype != tf.resource and not shape.is_compatible_with(y.shape):
            raise errors.InvalidArgumentError(
                f"{where}: expected a shape compatible with {y_desc}, {y.shape}, got {shape}. "
                "Pass one initial gradient of each y's shape, or None for ones.")


def _check_tf_kwargs(kwargs: dict, graph: tf.Graph) -> dict:
    """``name`` and ``aggregation_method``, checked as tf.gradients checks them only once it has
    added ops; returns ``kwargs`` with a bytes ``name`` decoded (our scopes are built from it)."""
    kwargs = dict(kwargs)
    name = kwargs.get("name")
    if isinstance(name, bytes):
        try:
            name = kwargs["name"] = name.decode("utf-8")
        except UnicodeDecodeError:
            pass  # refused below as not a string
    if name is not None:
        if not isinstance(name, str):
            raise errors.InvalidTypeError(
                f"name: expected a string (a name scope) or None, got {type(name).__name__}: "
                f"{name!r:.80}.")
        regex = _NESTED_SCOPE_NAME if graph.get_name_scope() else _ROOT_SCOPE_NAME
        if name and not regex.match(name):
            raise errors.InvalidArgumentError(
                f"name: expected a valid name scope (letters, digits and '_.-/>\\', matching "
                f"{regex.pattern}), got {name!r}. Example: name='gradients'.")
    method = kwargs.get("aggregation_method")
    if method is not None and not (isinstance(method, numbers.Integral)
                                   and method in AGGREGATION_METHODS.values()):
        constants = ", ".join(f"tf.AggregationMethod.{k} ({v})"
                              for k, v in AGGREGATION_METHODS.items())
        raise errors.InvalidArgumentError(
            f"aggregation_method: expected None or one of {constants}, got {method!r:.80}.")
    return kwargs


@dataclasses.dataclass
class _Prepared:
    """Validated arguments and the chosen plan: everything up to (not including) the rewrite."""

    graph: tf.Graph
    ys: list
    #: The xs as given (variables as the tensors tf.gradients differentiates) and, per given
    #: x, the tensor the rewrite differentiates for it in ys' graph (None where that gradient
    #: comes only from beyond the captures, or where ys' graph never reads it).
    given_xs: list
    x_slots: list
    #: Captured placeholders through which ys depend on xs of enclosing graphs: differentiated
    #: here, then carried out with tf.gradients (design note "captured xs").
    crossing: list
    #: ``(y, grad_y)`` for ys of enclosing graphs that ys' graph never captured.
    outer_targets: list
    grad_ys: list
    user_stops: list
    tf_kwargs: dict
    unconnected: tf.UnconnectedGradients
    scope: str
    selection: selection.SelectionContext
    chosen: set
    kept: set

    @property
    def region(self) -> list:
        return self.selection.region

    @property
    def xs(self) -> list:
        """The xs that ys' graph reads: what the rewrite differentiates with respect to."""
        return [x for x in self.x_slots if x is not None] + self.crossing

    def per_given_x(self, grads: list) -> list:
        """``grads`` (one per :attr:`xs`) as tf.gradients returns them, one per given x.

        The partials of crossing captures are carried out to the enclosing graphs' xs by one
        tf.gradients call and added; an x with no gradient gets None, or zeros for
        ``unconnected_gradients='zero'``.
        """
        own = len(grads) - len(self.crossing)
        slot_grads = iter(grads[:own])
        out = [next(slot_grads) if slot is not None else None for slot in self.x_slots]
        carried = [(tf_graph.captured_value(p), tf.convert_to_tensor(g))
                   for p, g in zip(self.crossing, grads[own:]) if g is not None]
        carried += self.outer_targets
        outer = [i for i, x in enumerate(self.given_xs)
                 if not tf_graph.is_eager_tensor(x) and x.graph is not self.graph]
        if carried and outer:
            further = tf_graph.ORIGINAL_GRADIENTS(
                [y for y, _ in carried], [self.given_xs[i] for i in outer],
                grad_ys=[g for _, g in carried],
                stop_gradients=self.user_stops or None, **self.tf_kwargs)
            for i, g in zip(outer, further):
                out[i] = stitch.aggregate([out[i], g], self.given_xs[i])
        if self.unconnected == tf.UnconnectedGradients.ZERO:
            out = [stitch.zeros_like(x) if g is None else g for x, g in zip(self.given_xs, out)]
        return out


def _prepare(ys, xs, grad_ys, checkpoints, tf_gradients_kwargs,
             select: bool = True) -> _Prepared:
    """Validate the arguments and choose what to keep (unless not ``select``); adds nothing to
    the graph."""
    unknown = sorted(set(tf_gradients_kwargs) - set(TF_GRADIENTS_KWARGS))
    if unknown:
        raise errors.InvalidTypeError(
            f"gradients() got unexpected keyword argument(s) {unknown}; memsave_grads passes on "
            f"only tf.gradients' own: {list(TF_GRADIENTS_KWARGS)}.")
    graph, ys, given_xs, x_slots, grad_ys = _normalise(ys, xs, grad_ys)
    # Every argument is checked before selection, whose own errors (NoCheckpointsFoundError)
    # would otherwise blame checkpoints for a bad grad_ys.
    _check_not_finalized(graph)
    _check_grad_ys(ys, grad_ys, graph)
    kwargs = _check_tf_kwargs(tf_gradients_kwargs, graph)
    user_stops = [_check_graph_tensor(t, f"stop_gradients[{i}]", allow_variable=False)
                  for i, t in enumerate(_as_list(kwargs.pop("stop_gradients", None),
                                                 "stop_gradients", allow_none=True))
                  if t is not None]
    for i, t in enumerate(user_stops):
        _check_same_or_enclosing_graph(t, f"stop_gradients[{i}]", "the tensor", graph)
    unconnected = kwargs.pop("unconnected_gradients", tf.UnconnectedGradients.NONE)
    try:
        unconnected = tf.UnconnectedGradients(unconnected)
    except ValueError:
        raise errors.InvalidArgumentError(
            f"unconnected_gradients: expected 'none' or 'zero' (tf.UnconnectedGradients), got "
            f"{unconnected!r}.") from None
    scope = kwargs.get("name") or "gradients"
    # A y of an enclosing graph is differentiated through its capture where ys' graph
    # captured it, and otherwise entirely beyond the captures (design note "captured xs").
    y_slots = [y if y.graph is graph else tf_graph.as_seen_from(y, graph) for y in ys]
    outer_targets = [(y, gy) for y, slot, gy in zip(ys, y_slots, grad_ys) if slot is None]
    grad_ys = [gy for slot, gy in zip(y_slots, grad_ys) if slot is not None]
    ys = [slot for slot in y_slots if slot is not None]
    # An x of an enclosing graph that is a value (not an eager constant, not a variable
    # handle) may reach ys through several captures: its gradient is carried out through all
    # of them, its own capture included (design note "captured xs").
    outer_xs = [given for given, seen in zip(given_xs, x_slots) if given is not seen]
    crossing = tf_graph.crossing_captures(ys, outer_xs, stop_ops={t.op for t in user_stops})
    x_slots = [None if slot is not None and tf_graph.is_captured_value(given, slot)
               else slot for given, slot in zip(given_xs, x_slots)]
    xs = [x for x in x_slots if x is not None] + crossing

    with graph.as_default():
        region = tf_graph.forward_region(ys, xs, stop_ops={t.op for t in user_stops})
        must_keep = selection.forced_keep(region, xs)
        ctx = selection.SelectionContext(graph=graph, region=region, xs=xs, ys=ys,
                                       must_keep=must_keep)
        # No forward op between xs and ys (ys do not depend on xs): nothing to choose; the
        # gradients are None (or zeros), as tf.gradients gives.
        chosen = selection.select(ctx, checkpoints) if select and region else set()
        kept = selection.single_owner(ctx, must_keep | chosen)
    logging.vlog(1, "memsave_grads: %d forward ops, %d checkpoints chosen, %d kept in all",
                 len(region), len(chosen), len(kept))
    return _Prepared(graph=graph, ys=ys, given_xs=given_xs, x_slots=x_slots,
                     crossing=crossing, outer_targets=outer_targets, grad_ys=grad_ys,
                     user_stops=user_stops,
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
    elif isinstance(checkpoints, str) and checkpoints not in selection.STRATEGIES:
        raise errors.UnknownStrategyError(
            f"checkpoints: unknown strategy {checkpoints!r}. Expected one of "
            f"{sorted(selection.STRATEGIES)}, a budget ('budget:4GiB', 'budget:50%', "
            "memsave_grads.Budget), a list of tensors, or a list of name patterns.")


def gradients_or_fallback(ys, xs, grad_ys, checkpoints, fallback: str, caller: str,
                          **tf_gradients_kwargs):
    """:func:`gradients`, or the original ``tf.gradients`` where the strategy has nothing to
    gain or the graph cannot be rewritten (``errors.FALLBACK_ERRORS``): logged for
    ``fallback="warn"``, raised for ``"error"``. A budget no plan meets
    (``InfeasibleBudgetError``) gets, under ``"warn"``, the plan with the smallest predicted
    peak and one warning stating the numbers."""
    try:
        try:
            return gradients(ys, xs, grad_ys, checkpoints=checkpoints, **tf_gradients_kwargs)
        except errors.InfeasibleBudgetError as exc:
            if fallback == "error":
                raise
            return _gradients_at_smallest_peak(ys, xs, grad_ys, checkpoints, exc, caller,
                                               tf_gradients_kwargs)
    except errors.FALLBACK_ERRORS as exc:
        if fallback == "error":
            raise
        logging.warning("%s: falling back to tf.gradients: %s", caller, exc)
        return tf_graph.ORIGINAL_GRADIENTS(ys, xs, grad_ys, **tf_gradients_kwargs)


#: Solves at the reported smallest peak before settling for plain tf.gradients: a heuristic
#: solver's plans depend on the budget, so the plan that reached the smallest peak under a lower
#: budget may be missed at that peak, and the new error reports another smallest peak.
SMALLEST_PEAK_ATTEMPTS = 3


def _mib(nbytes: int | None) -> str:
    return f"{nbytes / 2**20:.3g} MiB" if nbytes is not None else "unknown"


def _gradients_at_smallest_peak(ys, xs, grad_ys, checkpoints, infeasible, caller: str,
                                tf_gradients_kwargs: dict):
    """Under ``fallback="warn"``, a budget below every plan's predicted peak gets the plan with
    the smallest predicted peak (or plain tf.gradients where no plan beats it), and one warning
    with the numbers; a training loop goes on with the least memory we can offer."""
    asked = checkpoints if isinstance(checkpoints, budgets.Budget) else \
        budgets.Budget.parse(checkpoints)
    plain_bytes = infeasible.plain_peak_bytes

    def share(nbytes):
        return f"{nbytes / plain_bytes:.1%}" if plain_bytes and nbytes is not None else "n/a"

    def warn(error, outcome):
        logging.warning(
            "%s: checkpoints=%r: the budget of %s (%s of plain tf.gradients' predicted peak, "
            "%s) is below the smallest feasible predicted peak, %s (%s of plain); %s Raise the "
            "budget to at least that, or pass fallback='error' to raise.", caller, checkpoints,
            _mib(infeasible.budget_bytes), share(infeasible.budget_bytes), _mib(plain_bytes),
            _mib(error.min_feasible_bytes), share(error.min_feasible_bytes), outcome)

    error = infeasible
    for _ in range(SMALLEST_PEAK_ATTEMPTS):
        retry = budgets.smallest_peak_budget(error, asked)
        if retry is None:
            warn(error, "no plan is predicted to peak below plain tf.gradients here, so it "
                 "computes these gradients.")
            return tf_graph.ORIGINAL_GRADIENTS(ys, xs, grad_ys, **tf_gradients_kwargs)
        try:
            grads = gradients(ys, xs, grad_ys, checkpoints=retry, **tf_gradients_kwargs)
        except errors.InfeasibleBudgetError as again:
            error = again
            continue
        warn(error, "planned for that peak instead.")
        return grads
    warn(error, f"the solver found no plan at that peak in {SMALLEST_PEAK_ATTEMPTS} attempts, "
         "so plain tf.gradients computes these gradients.")
    return tf_graph.ORIGINAL_GRADIENTS(ys, xs, grad_ys, **tf_gradients_kwargs)


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
