"""Route ``tf.gradients`` (and everything that calls it) through memsave_grads.

TensorFlow exposes two functions under many module attributes: ``gradients_impl.gradients``
(``tf.compat.v1.gradients``, ``tensorflow.python.ops.gradients.gradients`` used by v1 optimizers,
``tensorflow.compat.v2.compat.v1.gradients`` used by tf_keras...) and ``gradients_impl.gradients_v2``
(``tf.gradients`` in TF 2, the ``_api.v2`` modules). :func:`patch` replaces every module attribute
that *is* one of them and remembers each one, so :func:`unpatch` restores exactly those (design
note "patching"). It also routes ``tf.GradientTape`` inside graphs (:mod:`memsave_grads.tape`,
design note "tape routing"), which never calls ``tf.gradients``.
"""

from __future__ import annotations

import logging
import sys
import threading

import tensorflow as tf

from memsave_grads._tf import graph as tf_graph
from memsave_grads._tf import tape_record
from memsave_grads import _validate
from memsave_grads import api
from memsave_grads import errors
from memsave_grads import tape

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

_lock = threading.Lock()
_active = None  # the live _Patch, if any


def original_gradients(*args, **kwargs):
    """The unpatched ``tf.gradients``, whatever the patch state."""
    return tf_graph.ORIGINAL_GRADIENTS(*args, **kwargs)


def is_patched() -> bool:
    return _active is not None


class _Patch:
    """A live patch; also a context manager that unpatches on exit."""

    def __init__(self, checkpoints, fallback: str, tapes: bool):
        self.checkpoints = checkpoints
        self.fallback = fallback
        self.tapes = tapes
        #: The tape routing this patch started (``tapes=True``), ended by ``restore``.
        self.tape_routing: tape.Routing | None = None
        self.replaced: list[tuple[object, str, object]] = []  # (module, attribute, original)
        # (original, wrapper) pairs, compared by identity: module attributes can be unhashable.
        self.wrappers = [(tf_graph.ORIGINAL_GRADIENTS, self._make_v1_wrapper()),
                         (tf_graph.ORIGINAL_GRADIENTS_V2, self._make_v2_wrapper())]

    def call(self, ys, xs, grad_ys, kwargs):
        """What every patched name does: memsave_grads, or the original where it must."""
        with tape_record.building_gradients():  # a tape a gradient function opens is TF's
            if _active is not self:  # a stale reference kept past unpatch()
                return tf_graph.ORIGINAL_GRADIENTS(ys, xs, grad_ys, **kwargs)
            return api.gradients_or_fallback(ys, xs, grad_ys, self.checkpoints, self.fallback,
                                             "memsave_grads", **kwargs)

    def _make_v1_wrapper(self):
        @tf.autograph.experimental.do_not_convert
        def gradients(ys, xs, grad_ys=None, name="gradients", colocate_gradients_with_ops=False,
                      gate_gradients=False, aggregation_method=None, stop_gradients=None,
                      unconnected_gradients=tf.UnconnectedGradients.NONE):
            return self.call(ys, xs, grad_ys, dict(
                name=name, colocate_gradients_with_ops=colocate_gradients_with_ops,
                gate_gradients=gate_gradients, aggregation_method=aggregation_method,
                stop_gradients=stop_gradients, unconnected_gradients=unconnected_gradients))

        gradients.__wrapped__ = tf_graph.ORIGINAL_GRADIENTS
        gradients.__doc__ = f"tf.compat.v1.gradients via memsave_grads ({self.checkpoints!r})."
        return gradients

    def _make_v2_wrapper(self):
        @tf.autograph.experimental.do_not_convert
        def gradients_v2(ys, xs, grad_ys=None, name="gradients", gate_gradients=False,
                         aggregation_method=None, stop_gradients=None,
                         unconnected_gradients=tf.UnconnectedGradients.NONE):
            return self.call(ys, xs, grad_ys, dict(
                name=name, gate_gradients=gate_gradients, aggregation_method=aggregation_method,
                stop_gradients=stop_gradients, unconnected_gradients=unconnected_gradients))

        gradients_v2.__wrapped__ = tf_graph.ORIGINAL_GRADIENTS_V2
        gradients_v2.__doc__ = f"tf.gradients via memsave_grads ({self.checkpoints!r})."
        return gradients_v2

    def apply(self) -> None:
        for module_name, module in list(sys.modules.items()):
            if module is None or module_name.split(".")[0] == "memsave_grads":
                continue
            try:
                namespace = vars(module)
            except TypeError:
                continue
            for attr, value in list(namespace.items()):
                for original, wrapper in self.wrappers:
                    if value is original:
                        setattr(module, attr, wrapper)
                        self.replaced.append((module, attr, original))
        if self.tapes:
            self.tape_routing = tape.start_routing(tape.Routing(
                self.checkpoints, self.fallback, "memsave_grads.patch"))
        _LOG.info("memsave_grads: patched %d references to tf.gradients%s",
                  len(self.replaced), " and tf.GradientTape" if self.tapes else "")

    def restore(self) -> None:
        wrappers = [wrapper for _, wrapper in self.wrappers]
        for module, attr, original in self.replaced:
            if any(getattr(module, attr, None) is w for w in wrappers):
                setattr(module, attr, original)
        self.replaced.clear()
        if self.tape_routing is not None:
            tape.stop_routing(self.tape_routing)
            self.tape_routing = None

    def __enter__(self):
        # patch() patched already; a patch that has ended (unpatch(), or a `with` block left)
        # would enter without patching anything.
        if _active is not self:
            raise errors.PatchStateError(
                f"with: this patch (checkpoints={self.checkpoints!r}) has ended (unpatch() or "
                "its with block), and entering it again does not patch. Call "
                "memsave_grads.patch(...) again: `with memsave_grads.patch(...):`.")
        return self

    def __exit__(self, *exc_info):
        if _active is self:
            unpatch()
        return False


def patch(checkpoints: api.Checkpoints = "memory", fallback: str = "warn",
          tapes: bool = True) -> _Patch:
    """Make ``tf.gradients``, its aliases and ``tf.GradientTape`` compute gradients with
    memsave_grads.

    Routes ``tf.gradients``, ``tf.compat.v1.gradients``, v1 ``Optimizer.minimize`` /
    ``compute_gradients`` and Keras 2 (tf_keras) graph-mode gradients; and, with ``tapes``,
    ``tf.GradientTape.gradient`` inside graphs (``tf.function``, Keras' traced steps, v1
    graphs) for tapes entered while patched, with the tape's exact semantics (see
    :func:`memsave_grads.route_tapes`). Use as ``patch(...)`` ... ``unpatch()``, or
    ``with patch(...):``. It acts on graphs traced while patched: a ``tf.function`` traced
    before keeps its gradients when it runs again (a Keras model that ran ``fit`` before:
    call ``model.make_train_function(force=True)``).

    Args:
      checkpoints: as in :func:`memsave_grads.gradients`.
      fallback: ``"warn"`` (default): where the strategy finds nothing to keep or the graph
        cannot be rewritten (``NoCheckpointsFoundError``, ``UnsupportedGraphError``), log a
        warning and compute that gradient with the original ``tf.gradients``; ``"error"``: raise.
      tapes: route ``tf.GradientTape`` too (default True); False leaves tapes to TensorFlow.

    Raises:
      PatchStateError: already patched (call ``unpatch()`` first).
      UnknownStrategyError / InvalidArgumentError / InvalidTypeError: a ``checkpoints`` or
        ``fallback`` of the wrong form, refused now rather than at the first gradient.
    """
    global _active
    _validate.check_deferred_options(checkpoints, fallback)
    if not isinstance(tapes, bool):
        raise errors.InvalidTypeError(
            f"tapes: expected True (route tf.GradientTape too) or False, got "
            f"{type(tapes).__name__}: {tapes!r:.60}.")
    with _lock:
        if _active is not None:
            raise errors.PatchStateError(
                f"patch(): tf.gradients is already patched (checkpoints="
                f"{_active.checkpoints!r}). Call memsave_grads.unpatch() first, or use "
                "`with memsave_grads.patch(...):` so the patch ends by itself.")
        state = _Patch(checkpoints, fallback, tapes)
        state.apply()
        _active = state
    return state


def unpatch() -> None:
    """Restore every name that :func:`patch` replaced.

    Raises:
      PatchStateError: not patched.
    """
    global _active
    with _lock:
        if _active is None:
            raise errors.PatchStateError(
                "unpatch(): tf.gradients is not patched. Call memsave_grads.patch() first, or "
                "check memsave_grads.is_patched().")
        _active.restore()
        _active = None
