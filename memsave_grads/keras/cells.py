"""Recurrent layers: their cells recompute their internals in the backward loop.

Design note "recurrent layers": a Keras 3 recurrent layer runs its cell in a while loop, and the
loop's gradient stores every tensor of every step that the cell's gradient reads (gates and
their activations), which the planner cannot reach: to it the loop is one op. For the traced
training step only, each recurrent layer's cell ``call`` is wrapped in recompute(), which
keeps just the step's inputs, states, outputs and stateful draws and replays the rest in the
backward iteration (docs/recurrent.md). Keras 3 makes the dropout masks before the loop, so
they are inputs of the cell and never redrawn. A layer that runs a fused kernel instead of its
cell (cuDNN on GPU, tf_keras's LSTM and GRU) does not call the cell, and keeps its own memory.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref

from memsave_grads import recomputation
from memsave_grads._tf import ordering
from memsave_grads.keras import flavour as flavour_lib
from memsave_grads.keras.flavour import Flavour

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)


def recurrent_cells(model, flavour: Flavour) -> list:
    """The cells of the model's recurrent layers that are recomputed (Keras 3: LSTM, GRU,
    SimpleRNN, RNN(cell), ConvLSTM, inside Bidirectional and nested models), once each."""
    layer_type = flavour.recurrent_layer_type()
    if layer_type is None:
        return []
    cells = []
    for layer in flavour_lib.all_layers(model):
        cell = getattr(layer, "cell", None)
        if isinstance(layer, layer_type) and cell is not None and not any(
                cell is c for c in cells):
            cells.append(cell)
    return cells


def _recomputed_call(call):
    """``cell.call`` whose gradient recomputes the cell's internals (keyword arguments, such
    as ``training``, are bound: recompute() takes positional tensors)."""

    @functools.wraps(call)
    def recomputed(inputs, states, *args, **kwargs):
        def step(step_inputs, step_states):
            return call(step_inputs, step_states, *args, **kwargs)
        return recomputation.recompute(step)(inputs, states)

    return recomputed


#: Models already told that under XLA the plan, not the cells, recomputes their loops.
_LOGGED_XLA_CELLS: "weakref.WeakSet" = weakref.WeakSet()


def recompute_cells_here(model, flavour: Flavour, recompute_cells: bool) -> bool:
    """Whether this trace recomputes the cells: asked for, and not under XLA. Compiled by XLA,
    a cell recomputed by its own ``recompute`` kept a copy of its kernels per step (LSTM(256),
    batch 32, T = 600, CPU: stock 747 MiB, recomputed 806 MiB; docs/recurrent.md); there the
    loops are left as Keras builds them, and the plan recomputes their bodies itself, with
    the kernels read once before each loop (``_tf.loops``, design note "loop reads under
    XLA": 740 -> 45 MiB)."""
    if not recompute_cells or not ordering.xla_in_effect():
        return recompute_cells
    if recurrent_cells(model, flavour) and model not in _LOGGED_XLA_CELLS:
        _LOGGED_XLA_CELLS.add(model)
        _LOG.info(
            "memsave_grads.keras: %s's step is compiled by XLA; its recurrent layers' loops "
            "are recomputed by the plan, not by their cells (with 'memory' and budgets; "
            "docs/recurrent.md).",
            getattr(model, "name", model))
    return False


@contextlib.contextmanager
def recomputed_cells(model, flavour: Flavour):
    """:func:`recomputed_recurrent_cells` for a model of a known flavour."""
    cells = recurrent_cells(model, flavour)
    with flavour_lib.overridden([(cell, "call", _recomputed_call(cell.call))
                                 for cell in cells]):
        if cells:
            _LOG.debug("memsave_grads.keras: recomputing inside the loops of %d recurrent "
                       "cell(s) of %s", len(cells), getattr(model, "name", model))
        yield cells


def recomputed_recurrent_cells(model):
    """Within this context, the cells of ``model``'s Keras 3 recurrent layers recompute their
    internals in the backward loop (design note "recurrent layers"); outside it, nothing on the
    model changes. :func:`memsave_grads.keras.train_step` traces the forward pass inside it."""
    return recomputed_cells(model, flavour_lib.flavour_of(model))


def maybe_recomputed_cells(model, flavour: Flavour, recompute_cells: bool):
    """:func:`recomputed_cells` where :func:`recompute_cells_here` says so, else nothing."""
    if recompute_cells_here(model, flavour, recompute_cells):
        return recomputed_cells(model, flavour)
    return contextlib.nullcontext()
