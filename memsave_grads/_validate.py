"""Argument checks for every entry point, run before any op is added to a graph.

``gradients()`` (and ``patch()``, ``wrap_model()``, ``minimize()``, which call it or check
their options ahead of it) refuse bad input here with our own errors
(:mod:`memsave_grads.errors`): each names the argument, what was expected, what was given and
the remedy. A check that TensorFlow makes only after it has added ops is made here first, so a
failed call never leaves a half-built gradient in the user's graph. Where tf.gradients itself
raises for the same input, our message also quotes TensorFlow's own sentence
(:func:`_tensorflow_says`), so code matching TensorFlow's text matches ours.

One function owns each check and its message:

- :func:`check_arguments`: ``ys``, ``xs``, ``grad_ys`` and tf.gradients' own keyword arguments,
  normalised into :class:`Arguments` (variables turned into the tensors tf.gradients
  differentiates, xs of enclosing graphs resolved to the placeholders that captured them);
- :func:`check_checkpoints`: the *form* of ``checkpoints=`` (strategy names, budgets, lists of
  tensors or name patterns), parsed once into the ``ParsedCheckpoints`` that the planner reads
  its kind from; what needs the graph (a tensor of another graph, a pattern that matches
  nothing) is checked by ``_tf.selection.select_explicit``;
- :func:`check_deferred_options`: what ``patch()`` and ``wrap_model()`` can check before any
  graph exists.
"""

from __future__ import annotations

import dataclasses
import numbers
import re

import numpy as np
import tensorflow as tf

from memsave_grads import errors
from memsave_grads._tf import graph as tf_graph
from memsave_grads._tf import selection
from memsave_grads.core import budgets
from memsave_grads.core import policies
from memsave_grads.core.checkpoints import ParsedCheckpoints

#: Keyword arguments of tf.gradients we pass through (``name`` included).
TF_GRADIENTS_KWARGS = ("name", "gate_gradients", "aggregation_method", "stop_gradients",
                       "unconnected_gradients", "colocate_gradients_with_ops")

#: ``aggregation_method`` values tf.gradients accepts besides None (``DEFAULT`` is ``ADD_N``).
AGGREGATION_METHODS = {
    "ADD_N": tf.AggregationMethod.ADD_N,
    "EXPERIMENTAL_TREE": tf.AggregationMethod.EXPERIMENTAL_TREE,
    "EXPERIMENTAL_ACCUMULATE_N": tf.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N,
}

#: What a caller that wraps tf.gradients (patch, Keras) does where we have nothing to gain.
FALLBACKS = ("warn", "error")

# TensorFlow's own rules for a name scope (tensorflow/python/framework/ops.py, from
# core/framework/node_def_util.cc): at the root the first character may not be '_', '-', '/'
# or '\\'; inside another scope it may.
_ROOT_SCOPE_NAME = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_.\\/>-]*$")
_NESTED_SCOPE_NAME = re.compile(r"^[A-Za-z0-9_.\\/>-]*$")


@dataclasses.dataclass(frozen=True)
class Arguments:
    """``gradients()``' arguments, checked and normalised (see :func:`check_arguments`).

    Attributes:
      graph: the innermost graph of ``ys``, where the gradient ops go.
      ys: the ys as tensors (a variable as its handle).
      given_xs: the xs as given, as tensors: a variable as the tensor tf.gradients
        differentiates (its handle, or a reference variable's ``_ref`` tensor).
      x_slots: per given x, the tensor through which ``graph`` reads it (itself, or the
        placeholder that captured it), or None where ``graph`` never reads it.
      grad_ys: one initial gradient (or None) per y.
      user_stops: the ``stop_gradients`` tensors.
      tf_kwargs: the other keyword arguments for tf.gradients (a bytes ``name`` decoded).
      unconnected: ``unconnected_gradients`` as the enum.
      scope: the name scope of the gradient ops.
    """

    graph: tf.Graph
    ys: list
    given_xs: list
    x_slots: list
    grad_ys: list
    user_stops: list
    tf_kwargs: dict
    unconnected: tf.UnconnectedGradients
    scope: str


def check_arguments(ys, xs, grad_ys, tf_gradients_kwargs: dict) -> Arguments:
    """Every argument of ``gradients()`` but ``checkpoints``, checked in the order a reader
    would look for the mistake; adds nothing to the graph."""
    unknown = [k for k in tf_gradients_kwargs if k not in TF_GRADIENTS_KWARGS]
    if unknown:
        raise errors.InvalidTypeError(
            f"unexpected keyword argument(s) {sorted(unknown)}; memsave_grads passes on only "
            f"tf.gradients' own: {list(TF_GRADIENTS_KWARGS)}."
            + _tensorflow_says(f"gradients() got an unexpected keyword argument '{unknown[0]}'"))
    graph, ys, given_xs, x_slots, grad_ys = _normalise(ys, xs, grad_ys)
    check_not_finalized(graph)
    _check_grad_ys(ys, grad_ys, graph)
    kwargs = _check_tf_kwargs(tf_gradients_kwargs, graph)
    # tf.gradients stops at each stop's op. A variable's op (VarHandleOp, VariableV2) has no
    # inputs, so stopping there changes nothing: its values are those without it. (Inside a
    # tf.function TensorFlow cannot take a captured variable's op and raises AttributeError.)
    user_stops = [check_graph_tensor(t, f"stop_gradients[{i}]", allow_variable=False)
                  for i, t in enumerate(as_list(kwargs.pop("stop_gradients", None),
                                                "stop_gradients", allow_none=True))
                  if t is not None and not isinstance(t, tf.Variable)]
    for i, t in enumerate(user_stops):
        _check_same_or_enclosing_graph(t, f"stop_gradients[{i}]", "the tensor", graph, ys[0])
    unconnected = kwargs.pop("unconnected_gradients", tf.UnconnectedGradients.NONE)
    try:
        unconnected = tf.UnconnectedGradients(unconnected)
    except ValueError:
        raise errors.InvalidArgumentError(
            f"unconnected_gradients: expected 'none' or 'zero' (tf.UnconnectedGradients), got "
            f"{unconnected!r}."
            + _tensorflow_says(f"Unknown value for unconnected_gradients: '{unconnected}'")
        ) from None
    return Arguments(graph=graph, ys=ys, given_xs=given_xs, x_slots=x_slots, grad_ys=grad_ys,
                     user_stops=user_stops, tf_kwargs=kwargs, unconnected=unconnected,
                     scope=kwargs.get("name") or "gradients")


def _tensorflow_says(sentence: str) -> str:
    """TensorFlow's own error sentence for the same input, to end our message with: code
    written against tf.gradients' text (TensorFlow's own tests, a caller's ``except`` that
    reads the message) keeps matching, while ours still names the argument and the remedy
    (design note "TensorFlow's error sentences")."""
    return f" TensorFlow's message: {sentence}"


def _tensorflow_same_graph_sentence(t, first_y) -> str:
    """What tf.gradients raises for a tensor of another graph than ``ys[0]``
    (``_assert_same_graph``), as :func:`_tensorflow_says` text; empty where TensorFlow makes no
    such check: while a function is being traced, where it captures tensors of enclosing
    graphs instead."""
    if (tf.compat.v1.get_default_graph().building_function or tf_graph.is_eager_tensor(t)
            or tf_graph.is_eager_tensor(first_y) or t.graph is first_y.graph):
        return ""
    return _tensorflow_says(f"{t} must be from the same graph as {first_y} (graphs are "
                            f"{t.graph} and {first_y.graph}).")


# --------------------------------------------------------------------------------------------
# ys, xs, grad_ys
# --------------------------------------------------------------------------------------------

def as_list(value, argname: str, allow_none: bool = False) -> list:
    """``value`` as a list: a list or tuple as it is, anything else as its one item."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if value is None and not allow_none:
        raise errors.MissingTensorError(
            f"{argname}: expected a tensor or a list of tensors, got None."
            + _tensorflow_says(_NONE_SENTENCE))
    return [value]


#: What tf.gradients raises (an AttributeError) for None among ys or xs.
_NONE_SENTENCE = "'NoneType' object has no attribute 'op'"


def _as_tensorflow_converts(ys: list, xs: list) -> tuple[list, list]:
    """``ys`` and ``xs`` with the items that are neither tensors nor variables converted as
    tf.gradients converts them (:func:`tf_graph.converted_as_tf_gradients_does`), in the
    graph of the first tensor among them, as tf.gradients' name scope picks it: a Python or
    NumPy number or array becomes a constant, whose gradient is None (``total = 0.0`` summed
    over no regularization losses stays a float); a nested list of ys, their stack. None,
    composite tensors and what TensorFlow cannot convert get our error, of the type
    TensorFlow raises too where it raises."""
    items = [(y, f"ys[{i}]", False) for i, y in enumerate(ys)] + [
        (x, f"xs[{i}]", True) for i, x in enumerate(xs)]
    for value, where, _ in items:
        if value is None:
            raise errors.MissingTensorError(
                f"{where}: expected a tensor, got None; leave it out of the list, or pass "
                "tf.constant(0.0) where a placeholder value is needed."
                + _tensorflow_says(_NONE_SENTENCE))
        if not _is_tensor_or_variable(value) and tf_graph.is_composite_tensor(value):
            raise errors.UnsupportedGraphError(
                f"{where}: got a {type(value).__name__}; memsave_grads differentiates dense "
                "tensors. Pass its dense components (a RaggedTensor's flat_values), or call "
                "tf.gradients (under patch() it is called for you).")
    converted = [_is_tensor_or_variable(value) for value, _, _ in items]
    if all(converted):
        return ys, xs
    graph = next((value.graph for value, _, _ in items if isinstance(value, tf.Tensor)
                  and not tf_graph.is_eager_tensor(value)),
                 tf.compat.v1.get_default_graph())
    check_not_finalized(graph)
    out = []
    with graph.as_default():
        for (value, where, is_x), done in zip(items, converted):
            if done:
                out.append(value)
                continue
            try:
                out.append(tf_graph.converted_as_tf_gradients_does(value, is_x=is_x))
            except (TypeError, ValueError, NotImplementedError) as tensorflow_error:
                raise errors.like_tensorflows(errors.InvalidTypeError(
                    f"{where}: expected a tensor, a variable or a value tf.convert_to_tensor "
                    f"takes, got {type(value).__name__}: {value!r:.80}."
                    + _tensorflow_says(str(tensorflow_error))), tensorflow_error) from None
    return out[:len(ys)], out[len(ys):]


def _is_tensor_or_variable(value) -> bool:
    return isinstance(value, (tf.Tensor, tf.Variable)) or tf_graph.is_resource_variable(value)


def check_graph_tensor(value, where: str, allow_variable: bool) -> tf.Tensor:
    """``value`` as a graph tensor (a resource variable as its handle where allowed), or our
    error naming ``where``."""
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
            "tf.GradientTape in eager code."
            + (_tensorflow_says("tf.gradients is not supported when eager execution is enabled. "
                                "Use tf.GradientTape instead.")
               if tf.executing_eagerly() else ""))
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


def _resolve_x(given, where: str, graph: tf.Graph, inner_y, first_y):
    """``given`` as the ops of ``graph`` read it: itself, or the placeholder that captured it
    from an enclosing graph (design note "captured xs"); None where ``graph`` never reads it
    (its gradient is None, as in tf.gradients)."""
    if tf_graph.is_eager_tensor(given) or tf_graph.encloses(given.graph, graph):
        return tf_graph.as_seen_from(given, graph)
    raise errors.InvalidArgumentError(
        f"{where}: {given.name!r} belongs to a graph that neither is nor encloses the graph of "
        f"ys[0] ({inner_y.name!r}), so ys cannot depend on it. Differentiate with respect to "
        "tensors of the same graph or tf.function, or of a graph enclosing it."
        + _tensorflow_same_graph_sentence(given, first_y))


def _normalise(ys, xs, grad_ys):
    """Validated ``(graph, ys, given_xs, xs, grad_ys)``: ``given_xs`` as tensors (variables
    turned into what tf.gradients differentiates), ``xs`` the same as read in ys' graph (None
    where never read there)."""
    ys, xs = _as_tensorflow_converts(as_list(ys, "ys"), as_list(xs, "xs"))
    ys = [check_graph_tensor(y, f"ys[{i}]", allow_variable=True) for i, y in enumerate(ys)]
    if not ys:
        raise errors.NotDifferentiableError(
            "ys: got an empty list, so there is nothing to differentiate (tf.gradients returns "
            "None for each x, and does so where memsave_grads falls back to it); pass at least "
            "one tensor.")
    # ys may also come from graphs enclosing the innermost one, as in tf.gradients.
    graph = next((t.graph for t in ys if all(tf_graph.encloses(u.graph, t.graph) for u in ys)),
                 None)
    if graph is None:
        stranger = next(t for t in ys if t.graph is not ys[0].graph)
        raise errors.InvalidArgumentError(
            f"ys: {', '.join(repr(t.name) for t in ys[:4])} belong to graphs of which none is "
            "enclosed by all the others (a tf.function and its enclosing graphs). Build all ys "
            "in one graph or tf.function, or in graphs enclosing it."
            + _tensorflow_same_graph_sentence(stranger, ys[0]))
    inner_y = next(t for t in ys if t.graph is graph)
    given_xs = [_given_x(x, f"xs[{i}]", graph) for i, x in enumerate(xs)]
    resolved = [_resolve_x(x, f"xs[{i}]", graph, inner_y, ys[0])
                for i, x in enumerate(given_xs)]
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
        grad_ys = as_list(grad_ys, "grad_ys")
        if len(grad_ys) != len(ys):
            raise errors.InvalidArgumentError(
                f"grad_ys: expected one entry per y ({len(ys)}), got {len(grad_ys)}. Pass None "
                "for a y whose initial gradient is ones."
                + _tensorflow_says(f"Length mismatch. Passed {len(grad_ys)} grad_ys for "
                                   f"{len(ys)} ys"))
    return graph, ys, given_xs, resolved, grad_ys


def _describe_tensor(t) -> str:
    return repr(t.name) if not tf_graph.is_eager_tensor(t) else "an eager tensor"


def check_not_finalized(graph: tf.Graph) -> None:
    """Refuse a finalized graph, where no gradient op (ours or tf.gradients') can go."""
    if graph.finalized:
        raise errors.FinalizedGraphError(
            "ys: the graph of ys is finalized (graph.finalize() was called, as "
            "tf.compat.v1.train.MonitoredSession and Supervisor do), so no gradient op can be "
            "added to it; tf.gradients cannot add its own either. Build the gradients (or call "
            "optimizer.minimize) before the graph is finalized, i.e. before creating the session."
            + _tensorflow_says("Graph is finalized and cannot be modified."))


def _check_same_or_enclosing_graph(t: tf.Tensor, where: str, what: str, graph: tf.Graph,
                                   first_y: tf.Tensor) -> None:
    # A tf.function captures tensors of the graphs it is traced in, so tf.gradients accepts
    # them there; any other graph is an error in TensorFlow too ("must be from the same graph").
    if not tf_graph.is_eager_tensor(t) and not tf_graph.encloses(t.graph, graph):
        raise errors.InvalidArgumentError(
            f"{where}: {what} {t.name!r} belongs to a graph that neither is nor encloses the "
            "graph of ys. Build it in the graph (or tf.function) that computes ys."
            + _tensorflow_same_graph_sentence(t, first_y))


def _grad_y_signature(grad_y, where: str, graph: tf.Graph,
                      first_y: tf.Tensor) -> tuple[tf.DType, tf.TensorShape]:
    """The dtype and static shape ``grad_y`` has once tf.gradients converts it, found without
    adding an op (a constant would be one)."""
    if isinstance(grad_y, tf.IndexedSlices):
        for part in (grad_y.values, grad_y.indices, grad_y.dense_shape):
            if isinstance(part, tf.Tensor):
                _check_same_or_enclosing_graph(part, where, "the IndexedSlices' tensor", graph,
                                               first_y)
        return grad_y.dtype, grad_y.shape  # an unknown dense_shape gives an unknown shape
    if tf_graph.is_resource_variable(grad_y):
        _check_same_or_enclosing_graph(grad_y.handle, where, "the variable handle", graph,
                                       first_y)
        return grad_y.dtype, grad_y.shape
    if tf_graph.is_reference_variable(grad_y):
        _check_same_or_enclosing_graph(tf_graph.reference_tensor(grad_y), where,
                                       "the variable", graph, first_y)
        return grad_y.dtype.base_dtype, grad_y.shape
    if isinstance(grad_y, tf.Tensor):
        if tf_graph.is_eager_tensor(grad_y) and not tf_graph.is_function_graph(graph):
            raise errors.EagerExecutionError(
                f"{where}: got an eager tensor, which a tf.Graph cannot read (only a "
                "tf.function captures eager values). Build grad_ys in the graph of ys, or pass "
                "a NumPy array.")
        _check_same_or_enclosing_graph(grad_y, where, "the tensor", graph, first_y)
        return grad_y.dtype, grad_y.shape
    if isinstance(grad_y, (np.ndarray, np.generic)):
        try:
            return tf.as_dtype(grad_y.dtype), tf.TensorShape(grad_y.shape)
        except TypeError:
            pass  # an object array: what TensorFlow would make of it, below
    try:  # what tf.constant would make of it, without making it
        proto = tf.make_tensor_proto(grad_y)
        return tf.as_dtype(proto.dtype), tf.TensorShape(proto.tensor_shape)
    except (TypeError, ValueError) as exc:
        conversion_error = str(exc)
    raise errors.InvalidTypeError(
        f"{where}: expected a tf.Tensor, tf.IndexedSlices, NumPy array, number or nested list "
        f"(or None for ones), got {type(grad_y).__name__}: {grad_y!r:.80}."
        + _tensorflow_says(conversion_error))


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
                    "initial gradient explicitly."
                    + _tensorflow_says(f"Gradients of complex tensors ({y}) must set grad_ys "
                                       f"(y.dtype = {y.dtype.name})"))
            continue
        dtype, shape = _grad_y_signature(grad_y, where, graph, ys[0])
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
                "takes no initial gradient; got one. Pass None for it, or leave it out of ys."
                + _tensorflow_grad_y_sentence(y, grad_y, dtype))
        if not dtype_ok:
            raise errors.InvalidTypeError(
                f"{where}: expected {expected} (the dtype of {y_desc}), got {dtype.name}. "
                f"Cast it: tf.cast(grad_y, {y.dtype.name!r})."
                + _tensorflow_grad_y_sentence(y, grad_y, dtype))
        # A handle's static shape is () whatever the variable's: nothing to compare there.
        if y.dtype != tf.resource and not shape.is_compatible_with(y.shape):
            raise errors.InvalidArgumentError(
                f"{where}: expected a shape compatible with {y_desc}, {y.shape}, got {shape}. "
                "Pass one initial gradient of each y's shape, or None for ones.")


def _tensorflow_grad_y_sentence(y: tf.Tensor, grad_y, dtype: tf.DType) -> str:
    """tf.gradients' own TypeError for a grad_y of the wrong kind of dtype
    (``_DefaultGradYs``), as :func:`_tensorflow_says` text; empty where it raises none there
    (another float dtype for a float y: it fails later, in some op's gradient)."""
    y_type = y.dtype.name
    if y.dtype.is_floating or y.dtype.is_integer:
        if dtype.is_floating or dtype.is_integer:
            return ""
        sentence = (f"Gradient type {dtype.name} generated for real or integer-valued tensor "
                    f"{y} with type {y_type} must be real or integer")
    elif y.dtype.is_complex:
        if dtype.is_complex:
            return ""
        sentence = (f"Gradient type {dtype.name} generated for complex-valued tensor {y} with "
                    f"type {y_type} must be real")  # sic: TensorFlow's wording
    elif y.dtype == tf.variant:
        if dtype == tf.variant:
            return ""
        sentence = (f"Gradient type {dtype.name} generated for variant tensor {y} with type "
                    f"{y_type} must be variant")
    elif y.dtype == tf.resource:
        if dtype != tf.resource:
            return ""
        sentence = f"Input gradient {grad_y} for resource tensor {y} should not be a resource"
    else:
        sentence = f"Tensor {y} with type {y_type} must be numeric to obtain a default gradient"
    return _tensorflow_says(sentence)


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
        nested = bool(graph.get_name_scope())
        regex = _NESTED_SCOPE_NAME if nested else _ROOT_SCOPE_NAME
        if not isinstance(name, str):
            try:
                regex.match(name)  # what TensorFlow's scope check runs into
                matched = ""
            except TypeError as exc:
                matched = _tensorflow_says(str(exc))
            raise errors.InvalidTypeError(
                f"name: expected a string (a name scope) or None, got {type(name).__name__}: "
                f"{name!r:.80}." + matched)
        if name and not regex.match(name):
            kind = "scope name" if nested else "root scope name"
            raise errors.InvalidArgumentError(
                f"name: expected a valid name scope (letters, digits and '_.-/>\\', matching "
                f"{regex.pattern}), got {name!r}. Example: name='gradients'."
                + _tensorflow_says(f"'{name}' is not a valid {kind}. A {kind} has to match "
                                   f"the following pattern: {regex.pattern}"))
    method = kwargs.get("aggregation_method")
    if method is not None and not (isinstance(method, numbers.Integral)
                                   and method in AGGREGATION_METHODS.values()):
        constants = ", ".join(f"tf.AggregationMethod.{k} ({v})"
                              for k, v in AGGREGATION_METHODS.items())
        accepted = list(AGGREGATION_METHODS.values())
        try:  # TensorFlow's own test, which lets a float equal to a method (1.0) through
            tensorflow_refuses = method not in accepted
        except (TypeError, ValueError):
            tensorflow_refuses = False
        raise errors.InvalidArgumentError(
            f"aggregation_method: expected None or one of {constants}, got {method!r:.80}."
            + (_tensorflow_says(f"Invalid `aggregation_method` specified {method}. Accepted "
                                f"values are {accepted}.") if tensorflow_refuses else ""))
    return kwargs


# --------------------------------------------------------------------------------------------
# checkpoints= and fallback=
# --------------------------------------------------------------------------------------------

def _accepted_checkpoints(tensors_allowed: bool) -> str:
    lists = ("a list of tensors or a list of name patterns" if tensors_allowed
             else "a list of name patterns")
    return (f"a strategy name ({', '.join(sorted(selection.STRATEGIES))}), a budget "
            f"('budget:4GiB', 'budget:50%', memsave_grads.Budget) or {lists}")


def check_checkpoints(checkpoints, tensors_unavailable: str | None = None,
                      can_calibrate: bool = False) -> ParsedCheckpoints:
    """Refuse a ``checkpoints=`` argument of the wrong form (one message per mistake, whoever
    the caller): an unknown strategy name, a malformed budget, an empty list, a list item that
    is neither a graph tensor nor a well-formed name pattern, or another type. Returns it
    parsed, to be passed on (an argument parsed already is returned as it is).

    Args:
      checkpoints: as given to ``gradients()``, ``patch()`` or ``wrap_model()``.
      tensors_unavailable: why tensors cannot be given here (Keras traces the training step
        after ``wrap_model`` returns), or None where they can: then lists must hold patterns.
      can_calibrate: whether the caller runs the training step before it trains, so that a
        budget asking for calibration can be measured there (``wrap_model``).
    """
    if isinstance(checkpoints, ParsedCheckpoints):
        return checkpoints
    given, tensors_allowed = checkpoints, tensors_unavailable is None
    budget = budgets.as_budget(checkpoints)
    if budget is not None:  # its values were checked when it was made
        if budget.calibrate and budget.calibration is None and not can_calibrate:
            raise errors.InvalidArgumentError(
                f"checkpoints: expected a budget this call can plan, got one asking for "
                f"calibration ({budget.describe()}), which is measured by running the "
                "whole training step under several plans before it trains; here only one "
                "gradient computation is seen, while it is traced. Calibrate "
                "the step first and pass the result: budget = memsave_grads.calibrate_budget("
                "model_or_step, budget) (design note \"calibrated budgets\"), or train a Keras "
                "model with memsave_grads.wrap_model(model, budget), whose fit calibrates it.")
        return ParsedCheckpoints(given, budget=budget)
    if isinstance(checkpoints, str):
        if checkpoints not in selection.STRATEGIES:
            raise errors.UnknownStrategyError(
                f"checkpoints: unknown strategy {checkpoints!r}. Expected "
                f"{_accepted_checkpoints(tensors_allowed)}; a single name pattern must be "
                "wrapped in a list.")
        return ParsedCheckpoints(given, strategy=checkpoints)
    if tensors_allowed and isinstance(checkpoints, tf.Tensor):
        checkpoints = [checkpoints]
    if not isinstance(checkpoints, (list, tuple)):
        raise errors.InvalidTypeError(
            f"checkpoints: expected {_accepted_checkpoints(tensors_allowed)}, got "
            f"{type(checkpoints).__name__}: {checkpoints!r:.80}.")
    if not checkpoints:
        items = "tensor or name pattern" if tensors_allowed else "name pattern"
        raise errors.InvalidArgumentError(
            f"checkpoints: got an empty list. Pass at least one {items}, a strategy name "
            f"({', '.join(sorted(selection.STRATEGIES))}) or a budget ('budget:50%').")
    for position, item in enumerate(checkpoints):
        _check_checkpoint_item(item, f"checkpoints[{position}]", tensors_unavailable)
    return ParsedCheckpoints(given, items=tuple(checkpoints))


def _check_checkpoint_item(item, where: str, tensors_unavailable: str | None) -> None:
    if isinstance(item, str):
        problem = policies.pattern_error(item)
        if problem:
            raise errors.InvalidArgumentError(
                f"{where}: malformed name pattern {item!r}: {problem}. Patterns are "
                "shell-style globs over op names ('block*/add') or tensor names "
                "('block*/add:0').")
        return
    if tensors_unavailable is not None:
        raise errors.InvalidTypeError(
            f"{where}: expected a name pattern (str), got {type(item).__name__}: "
            f"{item!r:.80}. {tensors_unavailable}")
    if tf_graph.is_resource_variable(item) or not isinstance(item, tf.Tensor):
        raise errors.InvalidTypeError(
            f"{where}: expected a tf.Tensor of the forward pass or a name pattern (str), "
            f"got {type(item).__name__}: {item!r:.80}. Pass the activation tensor.")
    if tf_graph.is_eager_tensor(item):
        raise errors.InvalidTypeError(
            f"{where}: got an eager tensor (a value, not part of a graph). Pass the graph "
            "tensor built in the same graph or tf.function as ys.")


def check_fallback(fallback) -> None:
    """Refuse a ``fallback=`` other than :data:`FALLBACKS`."""
    if fallback not in FALLBACKS:
        raise errors.InvalidArgumentError(
            f"fallback: expected one of {list(FALLBACKS)}, got {fallback!r}.")


def check_bool(value, name: str) -> None:
    """Refuse a flag other than True or False (1 and None included: a typo, not a choice)."""
    if not isinstance(value, bool):
        raise errors.InvalidTypeError(
            f"{name}: expected True or False, got {type(value).__name__}: {value!r:.60}.")


def check_count(value, name: str) -> None:
    """Refuse a count of runs or tries other than an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise errors.InvalidArgumentError(f"{name}: expected an int >= 1, got {value!r:.60}.")


def check_batch_size(batch_size, name: str = "batch_size", allow_none: bool = False) -> None:
    """Refuse a batch size other than a positive int (or None where ``allow_none``)."""
    if batch_size is None and allow_none:
        return
    expected = ("a positive int (the examples of the batch to plan for)"
                + (" or None" if allow_none else ""))
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
        raise errors.InvalidTypeError(
            f"{name}: expected {expected}, got {type(batch_size).__name__} {batch_size!r:.60}.")
    if batch_size < 1:
        raise errors.InvalidArgumentError(f"{name}: expected {expected}, got {batch_size!r}.")


def check_deferred_options(checkpoints, fallback, tensors_unavailable: str | None = None,
                           can_calibrate: bool = False) -> ParsedCheckpoints:
    """What ``patch()`` and ``wrap_model()`` can check before any graph exists, so that a
    mistake surfaces where it was made rather than at the first gradient: ``fallback`` and the
    form of ``checkpoints`` (see :func:`check_checkpoints`), which it returns parsed."""
    check_fallback(fallback)
    return check_checkpoints(checkpoints, tensors_unavailable, can_calibrate)
