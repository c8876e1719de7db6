"""``tf.GradientTape`` inside a graph, computed with memsave_grads (design note "tape routing").

``tape.gradient`` never calls ``tf.gradients``: it differentiates the ops the tape recorded, so
:func:`memsave_grads.patch` alone does not reach the TF2 idiom. Routing does: inside a graph (a
``tf.function``, Keras' traced training step, a ``tf.compat.v1`` graph) the gradient of a
routed tape is :func:`memsave_grads.gradients` over exactly the ops the tape recorded, with the
tape's own semantics (``watch``, ``stop_recording``, ``reset``, ``watch_accessed_variables``,
persistent tapes, ``output_gradients``, ``unconnected_gradients``, nested tapes). Three ways in:

- :class:`GradientTape`: a ``tf.GradientTape`` whose own gradients are routed;
- :func:`route_tapes`: a context manager (or decorator) routing every tape's gradient while it
  is active;
- :func:`memsave_grads.patch` routes them too (``tapes=True``, the default).

What cannot be routed exactly runs TensorFlow's own tape, with one warning per kind: eager
execution, ``jacobian`` and ``batch_jacobian``, a tape entered before routing began, and the
rare calls the tape's record does not settle (see ``_tf.tape_record.tape_view``); so does a
gradient where the strategy saves nothing (instead of plain ``tf.gradients``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from typing import Any, Callable, TypeVar

import numpy as np
import tensorflow as tf

from memsave_grads import _validate
from memsave_grads import api
from memsave_grads import errors
from memsave_grads._tf import loops
from memsave_grads._tf import tape_record

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Routing:
    """How routed tapes compute their gradients: ``gradients()``'s ``checkpoints``, and the
    ``fallback`` of a patched call (``"warn"``: TensorFlow's own tape where the strategy
    cannot rewrite the graph). ``caller`` names the entry point in messages;
    ``gradients_held`` plans for an optimizer that applies every gradient together (Keras)."""

    checkpoints: Any
    fallback: str
    caller: str
    gradients_held: bool = False


#: AutoGraph converts the functions a tf.function's code calls while it is traced, unless told
#: not to; the hooks run inside user code and walk graphs in plain Python.
_not_converted = tf.autograph.experimental.do_not_convert

_lock = threading.Lock()
#: The routings in effect, innermost last (``patch()``, ``route_tapes()`` blocks). Process-wide,
#: like the patch: ``tf.distribute`` runs each replica's step in a thread of its own.
_active: list[Routing] = []


def start_routing(routing: Routing) -> Routing:
    """Route every ``tf.GradientTape``'s gradient through ``routing`` until
    :func:`stop_routing`; the first routing installs the hooks on the class."""
    with _lock:
        if not _active:
            tape_record.install_hooks(_CLASS_HOOKS)
            loops.hoist_reads_in_tape_wrappers(True)
        _active.append(routing)
    return routing


def stop_routing(routing: Routing) -> None:
    """End ``routing`` (the innermost one left is in effect again); the last one puts
    TensorFlow's methods back."""
    with _lock:
        for i in range(len(_active) - 1, -1, -1):
            if _active[i] is routing:
                del _active[i]
                break
        if not _active:
            tape_record.uninstall_hooks()
            loops.hoist_reads_in_tape_wrappers(False)


def _innermost() -> Routing | None:
    return _active[-1] if _active else None


def is_routing() -> bool:
    """Whether every tape's gradient is routed now (``route_tapes``, or ``patch()``)."""
    return bool(_active)


def _checked_routing(checkpoints, fallback, caller: str,
                     gradients_held: bool = False) -> Routing:
    _validate.check_deferred_options(checkpoints, fallback)
    return Routing(checkpoints, fallback, caller, gradients_held)


class route_tapes(contextlib.ContextDecorator):  # pylint: disable=invalid-name
    """Route every ``tf.GradientTape``'s gradient through memsave_grads while active.

    A context manager, or a decorator of the function that builds the tapes (a
    ``tf.function``'s Python function: the routing acts while the graph is traced)::

        @tf.function
        @memsave_grads.route_tapes(checkpoints="memory")
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

    Inside a graph, ``tape.gradient`` then computes what the unrouted tape computes (values,
    None for what the tape did not record, ``IndexedSlices``, errors) with
    :func:`memsave_grads.gradients` (design note "tape routing"). A tape must be entered while
    the routing is active; one entered before runs TensorFlow's own tape, as do eager tapes,
    ``jacobian`` and ``batch_jacobian`` (one warning per kind). A function traced before the
    routing began keeps TensorFlow's tape when it runs again (a Keras model that ran ``fit``
    before: ``model.make_train_function(force=True)``). The routing is process-wide
    while active (``tf.distribute`` traces each replica in a thread of its own); blocks nest,
    the innermost one in effect.

    Args:
      checkpoints: as in :func:`memsave_grads.gradients` (default ``"memory"``).
      fallback: ``"warn"`` (default): where the strategy finds nothing to keep or cannot
        rewrite the graph, TensorFlow's own tape computes the gradient, with one warning;
        ``"error"``: raise. (Where the strategy's plan would save nothing, TensorFlow's tape
        computes it under either, with one warning.)

    Raises:
      UnknownStrategyError, InvalidArgumentError, InvalidTypeError: a ``checkpoints`` or
        ``fallback`` of the wrong form, refused here rather than at the first gradient.
    """

    def __init__(self, checkpoints: api.Checkpoints = "memory", fallback: str = "warn"):
        self._routing = _checked_routing(checkpoints, fallback, "memsave_grads.route_tapes")

    def __enter__(self):
        # Entered again while active (a decorated function calling itself), the routing is
        # pushed again, and each exit removes one.
        start_routing(self._routing)
        return self

    def __exit__(self, *exc_info):
        stop_routing(self._routing)
        return False


_T = TypeVar("_T")


def run_with_routed_tapes(step: Callable[[], _T], checkpoints, fallback: str, caller: str,
                          gradients_held: bool = True) -> _T:
    """``step()`` with every tape's gradient routed: how ``wrap_model`` runs a model's own
    ``train_step``. ``gradients_held``: planned for an optimizer that applies the gradients
    together, as Keras' do unless their updates are made to wait for each gradient (design
    note "early release")."""
    routing = start_routing(_checked_routing(checkpoints, fallback, caller,
                                             gradients_held=gradients_held))
    try:
        return step()
    finally:
        stop_routing(routing)


class GradientTape(tf.GradientTape):
    """A ``tf.GradientTape`` whose gradients, inside a graph, come from memsave_grads.

    The same arguments and methods as ``tf.GradientTape`` (it is one: ``isinstance`` holds),
    plus ``checkpoints`` and ``fallback`` as in :func:`route_tapes`; no patch is needed::

        @tf.function
        def train_step(x, y):
            with memsave_grads.GradientTape(checkpoints="memory") as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)

    ``gradient`` inside a ``tf.function`` or a ``tf.compat.v1`` graph gives what
    ``tf.GradientTape`` gives, computed by :func:`memsave_grads.gradients` over the ops the
    tape recorded (design note "tape routing"). Eagerly, and for ``jacobian`` and
    ``batch_jacobian``, it is ``tf.GradientTape`` (one warning per kind).

    Raises:
      UnknownStrategyError, InvalidArgumentError, InvalidTypeError: a ``checkpoints`` or
        ``fallback`` of the wrong form; InvalidTypeError: a ``persistent`` or
        ``watch_accessed_variables`` that is not ``True`` or ``False``
        (``GradientTape("memory")`` would otherwise make a persistent tape: the strategy is
        the keyword ``checkpoints``).
    """

    def __init__(self, persistent: bool = False, watch_accessed_variables: bool = True, *,
                 checkpoints: api.Checkpoints = "memory", fallback: str = "warn"):
        for name, flag in (("persistent", persistent),
                           ("watch_accessed_variables", watch_accessed_variables)):
            # tf.GradientTape checks neither flag: a string here is a strategy passed
            # positionally, which would make a persistent tape; an int or a NumPy bool as
            # persistent makes a tape that Python takes for persistent and TensorFlow's C++
            # tape does not (TF 2.21: a second gradient() raises InternalError).
            if not isinstance(flag, bool):
                hint = (f" A strategy or budget is the keyword argument: "
                        f"memsave_grads.GradientTape(checkpoints={flag!r})."
                        if isinstance(flag, str) else f" Pass {name}={bool(flag)!r}."
                        if isinstance(flag, (int, np.bool_)) else "")
                raise errors.InvalidTypeError(
                    f"memsave_grads.GradientTape: {name} must be True or False; got the "
                    f"{type(flag).__name__} {flag!r}.{hint}")
        routing = _checked_routing(checkpoints, fallback, "memsave_grads.GradientTape")
        super().__init__(persistent=persistent,
                         watch_accessed_variables=watch_accessed_variables)
        self._memsave_grads_routing = routing

    @_not_converted
    def _push_tape(self):
        tape_record.push(self, tape_record.OWN_CLASS)
        loops.hoist_reads_in_tape_wrappers(True)  # while it records (design note)

    @_not_converted
    def _pop_tape(self):
        super()._pop_tape()
        loops.hoist_reads_in_tape_wrappers(False)

    @_not_converted
    def watch(self, tensor):
        tape_record.watch(self, tensor)

    @_not_converted
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        return _gradient(self, self._memsave_grads_routing, target, sources, output_gradients,
                         unconnected_gradients)

    @_not_converted
    def jacobian(self, *args, **kwargs):
        return _by_tensorflow("jacobian", self, self._memsave_grads_routing, args, kwargs)

    @_not_converted
    def batch_jacobian(self, *args, **kwargs):
        return _by_tensorflow("batch_jacobian", self, self._memsave_grads_routing, args,
                              kwargs)


# --------------------------------------------------------------------------------------------
# One gradient call
# --------------------------------------------------------------------------------------------

#: Kinds of calls already told that TensorFlow's tape computes them.
_NOTICED: set[str] = set()


def _notice(kind: str, why: str) -> None:
    """One warning per kind of call that TensorFlow's own tape computes while routed (the
    first call's ``why`` is the one said)."""
    if kind in _NOTICED:
        return
    _NOTICED.add(kind)
    _LOG.warning(
        "memsave_grads: a routed tf.GradientTape %s is computed by TensorFlow's own tape, "
        "without saving memory: %s. (Said once for this kind of call.)", kind, why)


def _by_tensorflow(method: str, tape, routing: Routing | None, args, kwargs):
    """TensorFlow's own ``method`` of ``tape``; a ``jacobian`` or ``batch_jacobian`` in a graph
    under a routing says so once (they run ``gradient`` per row inside ``pfor``, which goes to
    TensorFlow's tape too)."""
    if (method != "gradient" and routing is not None and not tf.executing_eagerly()
            and not tape_record.is_building_gradients()):
        _notice(method, f"{method} is not routed (it differentiates each row of its target "
                "inside a vectorized loop)")
    with tape_record.building_gradients():
        return tape_record.ORIGINAL_METHODS[method](tape, *args, **kwargs)


def _gradient(tape, routing: Routing | None, target, sources, output_gradients,
              unconnected_gradients):
    """``tape.gradient(...)``: memsave_grads over what the tape recorded, or TensorFlow's own
    tape where that cannot be done exactly (design note "tape routing")."""
    args = (target, sources, output_gradients, unconnected_gradients)

    def by_tensorflow(kind: str | None = None, why: str = ""):
        grads = _by_tensorflow("gradient", tape, routing, args, {})
        if kind is not None:  # said once it computed: a call TensorFlow refuses says nothing
            _notice(kind, why)
        return grads

    if routing is None or tape_record.is_building_gradients():
        return by_tensorflow()
    if tf.executing_eagerly():
        return by_tensorflow("eager gradient", "it runs eagerly, where there is no graph to "
                             "rewrite (call it inside a tf.function)")
    log = tape_record.log_of(tape)
    if log is None or not log.up_to_date():
        return by_tensorflow("gradient of a tape entered before routing", "the tape was "
                             "entered before routing began, so what it watched is not known "
                             "(enter it inside route_tapes() or after patch())")
    if tape_record.is_used_up(tape) or target is None:
        return by_tensorflow()  # TensorFlow's own RuntimeError / TypeError
    try:
        unconnected = tf.UnconnectedGradients(unconnected_gradients)
    except ValueError:
        return by_tensorflow()  # TensorFlow's own ValueError
    tape_record.stop_recording_for_gradient(tape)
    targets = tape_record.flat_targets(target)
    raw_sources, sources_flat = tape_record.flat_sources(sources)
    grad_ys = tape_record.flat_output_gradients(output_gradients)
    why = _not_routable(targets, sources_flat, grad_ys)
    if why is not None:
        return by_tensorflow("gradient of these dtypes", why)
    view = tape_record.tape_view(tape, log, targets, sources_flat)
    if view.reason is not None:
        return by_tensorflow(view.kind, view.reason)
    kwargs = dict(stop_gradients=view.stops, unconnected_gradients=unconnected)
    try:
        _validate.check_arguments(targets, sources_flat, grad_ys, dict(kwargs))
    except errors.MemsaveGradsError as e:
        # TensorFlow's tape decides what such arguments give, or raises its own error.
        return by_tensorflow("gradient with arguments memsave_grads.gradients refuses", str(e))

    computed_by_tensorflow = []

    def by_tensorflow_flat() -> list:
        # Where gradients() would compute plain tf.gradients (its never-worse rule, a
        # fallback), TensorFlow's tape computes instead: the same memory, and exact where
        # tf.gradients is not (called inside a cond branch, a while body or a nested function,
        # it gives None for targets of an enclosing graph, which the tape differentiates).
        # Its sources as given (variables, not their handles): it makes the zeros of
        # unconnected_gradients="zero" from them.
        computed_by_tensorflow.append(True)
        grads_as_given = tape_record.ORIGINAL_METHODS["gradient"](
            tape, targets, raw_sources, grad_ys, unconnected)
        return tape_record.flat_gradients(raw_sources, grads_as_given)

    plain = api.PlainGradients(by_tensorflow_flat, "TensorFlow's own tape")
    held = api.gradients_applied_together() if routing.gradients_held else contextlib.nullcontext()
    with tape_record.building_gradients(), held, api.plain_gradients_by(plain):
        grads = api.gradients_or_fallback(targets, sources_flat, grad_ys, routing.checkpoints,
                                          routing.fallback, routing.caller, **kwargs)
    if not computed_by_tensorflow:  # TensorFlow's gradient released its tape itself
        tape_record.release_after_gradient(tape)
    return tape_record.pack_gradients(sources, raw_sources, grads)


def _not_routable(targets, sources, grad_ys) -> str | None:
    """Why these dtypes go to TensorFlow's tape, which treats them differently from
    tf.gradients (a complex target defaults to ones there; integer targets and sources)."""
    for t in targets:
        if not isinstance(t, tf.Tensor) or not t.dtype.is_floating:
            return f"a target is not a floating-point tensor ({t!r:.60})"
    for s in sources:
        if not isinstance(s, tf.Tensor) or not (s.dtype.is_floating or s.dtype == tf.resource):
            return f"a source is neither a floating-point tensor nor a variable ({s!r:.60})"
    if grad_ys is not None and (len(grad_ys) != len(targets) or any(g is None for g in grad_ys)):
        return "output_gradients has another length than the flattened target, or a None"
    return None


# --------------------------------------------------------------------------------------------
# The hooks on tf.GradientTape while a routing is active
# --------------------------------------------------------------------------------------------

@_not_converted
def _push_tape_hook(self):
    tape_record.push(self, tape_record.hooks_generation())


@_not_converted
def _watch_hook(self, tensor):
    tape_record.watch(self, tensor)


@_not_converted
def _gradient_hook(self, target, sources, output_gradients=None,
                   unconnected_gradients=tf.UnconnectedGradients.NONE):
    return _gradient(self, _innermost(), target, sources, output_gradients,
                     unconnected_gradients)


def _jacobian_hook(method: str) -> Callable:
    @_not_converted
    def hook(self, *args, **kwargs):
        return _by_tensorflow(method, self, _innermost(), args, kwargs)
    hook.__name__ = method
    return hook


_CLASS_HOOKS = {
    "_push_tape": _push_tape_hook,
    "watch": _watch_hook,
    "gradient": _gradient_hook,
    "jacobian": _jacobian_hook("jacobian"),
    "batch_jacobian": _jacobian_hook("batch_jacobian"),
}
