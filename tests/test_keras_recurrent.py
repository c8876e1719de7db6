"""Keras 3 recurrent layers under wrap_model: the cell recomputed inside the loop.

Design note "recurrent layers" (memsave_grads/keras.py): during the traced training step each
Keras 3 RNN layer's cell ``call`` runs under ``recompute()``, so the backward loop stores only
the cell's inputs, states and outputs per time step. Checked here: the same weights as stock
``fit`` (dropout and recurrent dropout included: their masks are drawn once, never redrawn),
a measured saving on a long sequence; nothing on the model changes outside the
step; ``recompute_cells=False`` keeps Keras's own loops; under XLA the plan recomputes the
loops' bodies, not the cells.
"""

import numpy as np
import pytest
import tensorflow as tf

import children
from memsave_grads import errors
from memsave_grads import measure
from memsave_grads import recomputation
from memsave_grads.keras import recomputed_recurrent_cells
from memsave_grads.keras import wrap_model

from keras_support import fresh_keras, keras3 as keras  # noqa: F401,E402

MIB = measure.MIB


def _data(steps, batch=8, features=6, classes=4, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, steps, features)).astype("float32")
    return x, rng.integers(0, classes, batch)


class _CheckedCell(keras.layers.Layer):
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units, self.state_size, self.output_size = units, units, units

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units))
        self.recurrent = self.add_weight(shape=(self.units, self.units))

    def call(self, inputs, states):
        h = tf.debugging.check_numerics(
            keras.ops.tanh(inputs @ self.kernel + states[0] @ self.recurrent), "h")
        with tf.control_dependencies([tf.debugging.assert_less_equal(h, 1.0)]):
            h = tf.identity(h)
        return h, [h]


def _recurrent_model(kind, steps, units=8, features=6, classes=4, jit_compile=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((steps, features))
    if kind == "lstm_stack":
        h = keras.layers.LSTM(units, return_sequences=True, dropout=0.2,
                              recurrent_dropout=0.2)(inputs)
        h = keras.layers.LSTM(units)(h)
    elif kind == "gru":
        h = keras.layers.GRU(units, dropout=0.2, reset_after=True)(inputs)
    elif kind == "bidirectional_simple_rnn":
        h = keras.layers.Bidirectional(keras.layers.SimpleRNN(units))(inputs)
    elif kind == "checked_cell":   # a user's cell with a numerics check and an assert
        h = keras.layers.RNN(_CheckedCell(units))(inputs)
    elif kind == "rnn_of_stacked_cells":
        cells = [keras.layers.LSTMCell(units), keras.layers.GRUCell(units, dropout=0.1)]
        h = keras.layers.RNN(keras.layers.StackedRNNCells(cells))(inputs)
    else:
        raise ValueError(kind)
    model = keras.Model(inputs, keras.layers.Dense(classes)(h))
    model.compile(optimizer=keras.optimizers.Adam(0.01), jit_compile=jit_compile,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


#: Recurrent cells per model: a Bidirectional layer runs two, StackedRNNCells is one cell.
CELLS = {"lstm_stack": 2, "gru": 1, "bidirectional_simple_rnn": 2, "rnn_of_stacked_cells": 1,
         "checked_cell": 1}


def _trained_weights(kind, wrapped, steps=12, jit_compile=False, **wrap_kwargs):
    model = _recurrent_model(kind, steps, jit_compile=jit_compile)
    if wrapped:
        wrap_model(model, "memory", **wrap_kwargs)
    x, y = _data(steps)
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    return model, history.history["loss"], model.get_weights()


@pytest.fixture
def recomputed_calls(monkeypatch):
    """The function names recompute() was traced with (its forward builds the replay plan)."""
    calls = []
    original = recomputation._recomputed  # pylint: disable=protected-access

    def counting(fn, args):
        calls.append(getattr(fn, "__name__", "fn"))
        return original(fn, args)

    monkeypatch.setattr(recomputation, "_recomputed", counting)
    return calls


@pytest.mark.parametrize("kind", ["lstm_stack", "gru", "bidirectional_simple_rnn",
                                  "rnn_of_stacked_cells", "checked_cell"])
def test_wrapped_recurrent_layers_train_as_stock_fit(kind, recomputed_calls):
    _, plain_loss, plain = _trained_weights(kind, wrapped=False)
    assert recomputed_calls == []
    keras.backend.clear_session(free_memory=False)
    _, loss, ours = _trained_weights(kind, wrapped=True)
    cells = CELLS[kind]
    # One recompute() per cell per trace: every cell's loop, not just one, recomputes.
    assert recomputed_calls and len(recomputed_calls) % cells == 0, (recomputed_calls, cells)
    assert len(recomputed_calls) >= cells
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-5)
    for i, (a, e) in enumerate(zip(ours, plain)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * np.abs(e).max(),
                                   err_msg=f"weight {i}")


@pytest.mark.never_worse
def test_under_xla_the_plan_recomputes_the_loops_the_cells_do_not(recomputed_calls, caplog):
    """Compiled by XLA, a cell recomputed by its own recompute() kept a copy of its kernels per
    step (docs/recurrent.md): the wrapped step leaves the cells as Keras builds them, says so
    once, and the plan recomputes each layer's loop body instead (its kernels read once before
    the loop, design note "loop reads under XLA"); it trains as stock fit under XLA."""
    _, plain_loss, plain = _trained_weights("lstm_stack", wrapped=False, jit_compile=True)
    keras.backend.clear_session(free_memory=False)
    with caplog.at_level("INFO"):
        model, loss, ours = _trained_weights("lstm_stack", wrapped=True, jit_compile=True)
    assert model.jit_compile is True
    # Each recompute() is the loop rewrite's step (one per loop per trace), none a cell's call.
    assert recomputed_calls and all("while_body" in name and name.endswith("_step")
                                    for name in recomputed_calls), recomputed_calls
    assert len(recomputed_calls) % CELLS["lstm_stack"] == 0, recomputed_calls
    assert caplog.text.count("recomputed by the plan, not by their cells") == 1, caplog.text
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-4)
    for i, (a, e) in enumerate(zip(ours, plain)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-4 * np.abs(e).max(),
                                   err_msg=f"weight {i}")


_XLA_LSTM_STEP = """
import json, sys
import numpy as np
import keras
from memsave_grads.keras import wrap_model

keras.utils.set_random_seed(0)
inputs = keras.Input((200, 32))
model = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.LSTM(128)(inputs)))
model.compile(optimizer=keras.optimizers.SGD(0.01), jit_compile=True,
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
if sys.argv[1] == "wrapped":
    wrap_model(model)
rng = np.random.default_rng(1)
x, y = rng.standard_normal((16, 200, 32)).astype("float32"), rng.integers(0, 4, 16)
model.train_on_batch(x, y)
peak, loss = measure.peak_bytes_of(lambda: model.train_on_batch(x, y))
print(json.dumps({"peak": peak, "loss": float(loss)}))
"""


@pytest.mark.never_worse
def test_an_lstm_under_xla_peaks_far_lower():
    """Compiled by XLA, stock fit's loop stores a copy of both kernels per step (design note
    "loop reads under XLA"); wrapped, the kernels are read once and the loop's body is
    recomputed. Measured (TF 2.21, CPU, fresh processes): LSTM(128), T = 200, batch 16:
    stock 62.5 MiB, wrapped 4.6 MiB (before this: the cells left alone, 62.5)."""
    stock, ours = (children.run_json(_XLA_LSTM_STEP, kind, env={"KERAS_BACKEND": "tensorflow"})
                   for kind in ("stock", "wrapped"))
    np.testing.assert_allclose(ours["loss"], stock["loss"], rtol=1e-5)
    assert ours["peak"] <= 0.25 * stock["peak"], (ours["peak"] / MIB, stock["peak"] / MIB)


def _loop_plans_of(layer, steps, input_differentiated=False):
    """``loops.plan`` of each loop ``layer`` builds in a ``jit_compile`` function, asked while
    it is traced (where XLA is in effect), for gradients with respect to the layer's weights
    (read inside the loop) or, ``input_differentiated``, its input too."""
    from memsave_grads._tf import graph as tf_graph  # pylint: disable=import-outside-toplevel
    from memsave_grads._tf import loops  # pylint: disable=import-outside-toplevel
    from memsave_grads.core import op_types  # pylint: disable=import-outside-toplevel
    plans = []

    @tf.function(jit_compile=True)
    def forward(x):
        y = layer(x)
        region = (frozenset(tf_graph.forward_region([y], [x])) if input_differentiated
                  else frozenset())
        plans.extend(loops.plan(op, region)
                     for op in tf.compat.v1.get_default_graph().get_operations()
                     if op.type in op_types.WHILE_OP_TYPES)
        return y

    forward.get_concrete_function(tf.TensorSpec([4, steps, 8]))
    return plans


def test_under_xla_a_layer_that_returns_its_last_output_replays_several_steps():
    """Under XLA a replay of k steps holds k copies of each tensor list the body writes, and
    of the gradient of each list it reads whose gradient is made, so ``loops.plan`` charges
    them. ``return_sequences=True`` writes every step's output into a list of T: one step at a
    time. Without it Keras writes each step into a list of one (``return_all_outputs=False``),
    which costs nothing, and the replay takes several steps (LSTM(256), T = 600, batch 32,
    ``fit`` under ``jit_compile``: 45-50 -> 30.9 MiB; stock 747), fewer where the layer's input
    sequence gets a gradient too (a second stacked layer's: T = 120, 128 units, batch 16,
    9.1 MiB at 5 steps a replay, 7.5 at one, which it now gets)."""
    last_only = _loop_plans_of(keras.layers.LSTM(32), 120)
    every_step = _loop_plans_of(keras.layers.LSTM(32, return_sequences=True), 120)
    input_too = _loop_plans_of(keras.layers.LSTM(32), 120, input_differentiated=True)
    assert last_only and all(p.unroll > 1 for p in last_only), last_only
    assert every_step and all(p.unroll == 1 for p in every_step), every_step
    # The input's gradient list is charged too: fewer steps a replay (8 features: 3, not 1).
    assert input_too and all(p.unroll < q.unroll for p, q in zip(input_too, last_only)), \
        (input_too, last_only)


def test_recompute_cells_false_keeps_kerass_loops(recomputed_calls):
    _trained_weights("gru", wrapped=True, recompute_cells=False)
    assert recomputed_calls == []


def test_the_cells_are_restored_after_the_step():
    model = _recurrent_model("lstm_stack", 5)
    cells = [layer.cell for layer in model.layers if hasattr(layer, "cell")]
    assert len(cells) == 2 and all("call" not in c.__dict__ for c in cells)
    with recomputed_recurrent_cells(model) as patched:
        assert {id(c) for c in patched} == {id(c) for c in cells}
        assert all("call" in c.__dict__ for c in cells)
    assert all("call" not in c.__dict__ for c in cells)
    with pytest.raises(RuntimeError), recomputed_recurrent_cells(model):
        raise RuntimeError("a failed trace")
    assert all("call" not in c.__dict__ for c in cells)
    # predict and evaluate never go through the step: the model's own cells there.
    assert model.predict(_data(5)[0], verbose=0).shape == (8, 4)


def test_recompute_cells_must_be_a_bool():
    model = _recurrent_model("gru", 5)
    with pytest.raises(errors.InvalidTypeError, match="recompute_cells: expected True or False"):
        wrap_model(model, recompute_cells="yes")
    assert not hasattr(model.train_step, "recompute_cells")


_LSTM_STEP_PEAK = """
import json, sys
import numpy as np
import keras
from memsave_grads.keras import wrap_model

wrapped, steps = sys.argv[1] == "wrapped", int(sys.argv[2])
keras.utils.set_random_seed(0)
inputs = keras.Input((steps, 32))
h = keras.layers.LSTM(128, dropout=0.1)(inputs)
model = keras.Model(inputs, keras.layers.Dense(4)(h))
model.compile(optimizer=keras.optimizers.SGD(0.01),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
if wrapped:
    wrap_model(model)
rng = np.random.default_rng(1)
x = rng.standard_normal((16, steps, 32)).astype("float32")
y = rng.integers(0, 4, 16)
model.train_on_batch(x, y)
runs = [measure.peak_bytes_of(lambda: model.train_on_batch(x, y)) for _ in range(3)]
print(json.dumps({"peak": min(peak for peak, _ in runs), "loss": float(runs[0][1])}))
"""


def _lstm_step_peak_mib(wrapped, steps):
    """The lowest of three steps' peaks, in a fresh process with one inter-op thread, whose
    executor runs the ops in one order whatever else the machine runs. With the default
    threads the peaks moved with the load (alone 18.2-19.1 MiB stock, 7.3 wrapped; beside a
    second busy TensorFlow process, such as a second pytest worker, 22.6-26.8 and 11.3-15.9:
    the backward loop runs up to 32 iterations at once, and how many do depends on the free
    threads)."""
    found = children.run_json(_LSTM_STEP_PEAK, "wrapped" if wrapped else "stock", str(steps),
                              env={"KERAS_BACKEND": "tensorflow", "TF_NUM_INTEROP_THREADS": "1"})
    return found["peak"] / MIB, found["loss"]


@pytest.mark.never_worse
def test_long_lstm_peaks_lower():
    """T=300, batch 16, 128 units: per step the stock loop stores the gates, their activations,
    c and tanh(c) (about 10 x 8 KiB); the recomputed cell keeps x_t, h and c. Measured (TF 2.21,
    CPU, one inter-op thread: _lstm_step_peak_mib): 25.9-26.4 MiB stock vs 14.6-15.9 wrapped,
    alone and beside other TensorFlow processes alike (with the default threads, alone: 18.4
    vs 6.9). At T=1000, batch 32, 256 units (docs/recurrent.md): 242 vs 83 MiB.

    Stock is measured in two processes and the larger counts: twice in about ten suite runs
    (2026-11-28) one stock process measured 18.1-18.2 MiB, the default threads' value, beside
    an ordinary 14.0-14.7 wrapped."""
    plain_mib, plain_loss = _lstm_step_peak_mib(False, 300)
    plain_mib = max(plain_mib, _lstm_step_peak_mib(False, 300)[0])
    ours_mib, loss = _lstm_step_peak_mib(True, 300)
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-5)
    assert plain_mib >= 15, plain_mib
    assert ours_mib <= 0.7 * plain_mib, (ours_mib, plain_mib)


@pytest.mark.never_worse
@pytest.mark.parametrize("recompute_cells", [False, True])
def test_where_the_plan_saves_nothing_the_warning_names_the_loops(recompute_cells, caplog):
    """The plan for a small GRU model saves nothing outside the loop. Keras's own loop: one
    warning, which says what would help (recompute the loop's step). A loop whose cell
    recomputes: no warning (the saving is inside the loop), an info line."""
    from memsave_grads import api  # pylint: disable=import-outside-toplevel
    api._WARNED_PLAIN.clear()  # pylint: disable=protected-access
    model = _recurrent_model("gru", 5)
    wrap_model(model, recompute_cells=recompute_cells)
    x, y = _data(5)
    with caplog.at_level("INFO"):
        model.train_on_batch(x, y)
        model.train_on_batch(x, y)
    warnings = [r.getMessage() for r in caplog.records
                if r.levelname == "WARNING" and "memsave_grads" in r.getMessage()]
    if recompute_cells:
        assert warnings == []
        assert "steps recompute inside" in caplog.text
    else:
        assert len(warnings) == 1, warnings
        assert "saves no memory" in warnings[0] and "1 of those ops are loops" in warnings[0]
        assert "memsave_grads.recompute(step_fn)" in warnings[0]
