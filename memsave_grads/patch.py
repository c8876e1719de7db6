"""Route ``tf.gradients`` (and everything that calls it) through memsave_grads.

TensorFlow exposes the same function object under many module attributes
(``tf.gradients``, ``tf.compat.v1.gradients``, ``tensorflow.python.ops.gradients.gradients``
used by v1 optimizers, the ``_api.v2`` modules, ``tensorflow.compat.v2.compat.v1`` used by
tf_keras...). :func:`patch` replaces every module attribute that *is* the original function and
remembers each one, so :func:`unpatch` restores exactly those (design note "patching").
"""

from __future__ import annotations

import sys
import threading

import tensorflow as tf
from absl import logging

from memsave_grads import _select
from memsave_grads import _tf_graph
from memsave_grads import api
from memsave_grads import errors

_FALLBACKS = ("warn", "error")
_lock = threading.Lock()
_active = None  # the live _Patch, if any


def original_gradients(*args, **kwargs):
    """The unpatched ``tf.gradients``, whatever the patch state."""
    return _tf_graph.ORIGINAL_GRADIENTS(*args, **kwargs)


def is_patched() -> bool:
    return _active is not None


class _Patch:
    """A live patch; also a context manager that unpatches on exit."""

    def __init__(self, checkpoints, fallback: str):
        self.checkpoints = checkpoints
        self.fallback = fallback
        self.replaced: list[tuple[object, str]] = []
        self.wrapper = self._make_wrapper()

    def _make_wrapper(self):
        patch_state = self

        @tf.autograph.experimental.do_not_convert
        def gradients(ys, xs, grad_ys=None, name="gradients", colocate_gradients_with_ops=False,
                      gate_gradients=False, aggregation_method=None, stop_gradients=None,
                      unconnected_gradients=tf.UnconnectedGradients.NONE):
            kwargs = dict(name=name, colocate_gradients_with_ops=colocate_gradients_with_ops,
                          gate_gradients=gate_gradients, aggregation_method=aggregation_method,
                          stop_gradients=stop_gradients,
                          unconnected_gradients=unconnected_gradients)
            if _active is not patch_state:  # a stale reference kept past unpatch()
                return _tf_graph.ORIGINAL_GRADIENTS(ys, xs, grad_ys, **kwargs)
            try:
                return api.gradients(ys, xs, grad_ys, checkpoints=patch_state.checkpoints,
                                     **kwargs)
            except errors.FALLBACK_ERRORS as exc:
                if patch_state.fallback == "error":
                    raise
                logging.warning("memsave_grads: falling back to tf.gradients: %s", exc)
                return _tf_graph.ORIGINAL_GRADIENTS(ys, xs, grad_ys, **kwargs)

        gradients.__doc__ = (f"tf.gradients patched by memsave_grads "
                             f"(checkpoints={self.checkpoints!r}).")
        gradients.__wrapped__ = _tf_graph.ORIGINAL_GRADIENTS
        return gradients

    def apply(self) -> None:
        original = _tf_graph.ORIGINAL_GRADIENTS
        for module_name, module in list(sys.modules.items()):
            if module is None or module_name.split(".")[0] == "memsave_grads":
                continue
            try:
                namespace = vars(module)
            except TypeError:
                continue
            for attr, value in list(namespace.items()):
                if value is original:
                    setattr(module, attr, self.wrapper)
                    self.replaced.append((module, attr))
        logging.info("memsave_grads: patched %d references to tf.gradients", len(self.replaced))

    def restore(self) -> None:
        for module, attr in self.replaced:
            if getattr(module, attr, None) is self.wrapper:
                setattr(module, attr, _tf_graph.ORIGINAL_GRADIENTS)
        self.replaced.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        if _active is self:
            unpatch()
        return False


def patch(checkpoints="memory", fallback: str = "warn") -> _Patch:
    """Make ``tf.gradients`` and its aliases compute gradients with memsave_grads.

    Routes ``tf.gradients``, ``tf.compat.v1.gradients``, v1 ``Optimizer.minimize`` /
    ``compute_gradients`` and Keras 2 (tf_keras) graph-mode gradients. ``tf.GradientTape`` is
    not affected. Use as ``patch(...)`` ... ``unpatch()``, or ``with patch(...):``.

    Args:
      checkpoints: as in :func:`memsave_grads.gradients`.
      fallback: ``"warn"`` (default): where the strategy finds nothing to keep or the graph
        cannot be rewritten (``NoCheckpointsFoundError``, ``UnsupportedGraphError``), log a
        warning and compute that gradient with the original ``tf.gradients``; ``"error"``: raise.

    Raises:
      PatchStateError: already patched (call ``unpatch()`` first).
    """
    global _active
    if fallback not in _FALLBACKS:
        raise errors.InvalidArgumentError(
            f"fallback: expected one of {list(_FALLBACKS)}, got {fallback!r}.")
    if isinstance(checkpoints, str) and checkpoints not in _select.STRATEGIES:
        raise errors.UnknownStrategyError(
            f"checkpoints: unknown strategy {checkpoints!r}. Expected one of "
            f"{sorted(_select.STRATEGIES)}, a list of tensors, or a list of name patterns.")
    with _lock:
        if _active is not None:
            raise errors.PatchStateError(
                f"patch(): tf.gradients is already patched (checkpoints="
                f"{_active.checkpoints!r}). Call memsave_grads.unpatch() first, or use "
                "`with memsave_grads.patch(...):` so the patch ends by itself.")
        state = _Patch(checkpoints, fallback)
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
