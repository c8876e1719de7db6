"""Tape routing in Keras (design note "tape routing"): a model whose own ``train_step`` uses
``tf.GradientTape``, as Keras' guides teach for custom losses and GANs, trains under
``wrap_model`` and under ``patch()`` exactly as it trains stock, with its tapes computed by
memsave_grads; so does Keras 3's stock ``fit`` under ``patch()`` (Keras 3 differentiates with a
tape). Keras 3 and Keras 2 (tf_keras).
"""

import numpy as np
import pytest
import tensorflow as tf

import memsave_grads as mg
from keras_support import FLAVOURS, KERAS, fresh_keras, keras3, tf_keras  # noqa: F401

WIDTH, DEPTH, ROWS, BATCH = 16, 6, 64, 16


def _data():
    rng = np.random.RandomState(0)
    return (rng.randn(ROWS, WIDTH).astype(np.float32),
            rng.randn(ROWS, 1).astype(np.float32))


def _custom_model_class(keras, penalty: bool):
    """A functional model whose own train_step takes one tape's gradient; with ``penalty``,
    the loss also penalises the input gradient's norm, taken by a nested tape."""

    class CustomStep(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                if penalty:
                    with tf.GradientTape() as inner:
                        inner.watch(x)
                        y_pred = self(x, training=True)
                        total = tf.reduce_sum(y_pred)
                    slope = inner.gradient(total, x)
                else:
                    y_pred = self(x, training=True)
                loss = tf.reduce_mean(tf.square(y_pred - y))
                if penalty:
                    loss += 0.1 * tf.reduce_mean(tf.square(slope))
            variables = self.trainable_variables
            grads = tape.gradient(loss, variables)
            self.optimizer.apply_gradients(zip(grads, variables))
            return {"objective": loss}  # not "loss": Keras 3 reports its own tracker there

    return CustomStep


def _build(keras, cls):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    h = inputs
    for _ in range(DEPTH):
        h = keras.layers.Add()([h, keras.layers.Dense(WIDTH, activation="tanh")(h)])
    model = cls(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def _train(keras, cls, how: str):
    """Losses and final weights of 3 epochs of 4 steps: stock, wrapped or patched."""
    x, y = _data()
    model = _build(keras, cls)
    if how == "wrap_model":
        mg.wrap_model(model, "memory", fallback="error")
    if how == "patch":
        with mg.patch("memory", fallback="error"):
            model.fit(x[:BATCH], y[:BATCH], epochs=1, batch_size=BATCH, verbose=0)  # traced here
            model.set_weights(_build(keras, cls).get_weights())
    history = model.fit(x, y, epochs=3, batch_size=BATCH, shuffle=False, verbose=0)
    return history.history["objective"], model.get_weights()


@FLAVOURS
@pytest.mark.parametrize("penalty", [False, True], ids=["one_tape", "nested_tapes"])
@pytest.mark.parametrize("how", ["wrap_model", "patch"])
def test_own_train_step_trains_as_stock(flavour, penalty, how, spy):
    keras = KERAS[flavour]
    cls = _custom_model_class(keras, penalty)
    want_losses, want_weights = _train(keras, cls, "stock")
    assert not spy
    got_losses, got_weights = _train(keras, cls, how)
    tapes = 2 if penalty else 1
    assert spy and len(spy) % tapes == 0, spy  # every tape of each trace went to memsave_grads
    assert want_losses[-1] < want_losses[0]
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for got, want in zip(got_weights, want_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_keras3_stock_fit_is_routed_under_patch(spy):
    x, y = _data()
    model = _build(keras3, keras3.Model)
    initial = model.get_weights()
    want = model.fit(x, y, epochs=2, batch_size=BATCH, shuffle=False, verbose=0)
    assert not spy
    model = _build(keras3, keras3.Model)
    model.set_weights(initial)
    with mg.patch("memory", fallback="error"):
        got = model.fit(x, y, epochs=2, batch_size=BATCH, shuffle=False, verbose=0)
    assert spy
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=1e-5)


def test_a_calibrated_budget_measures_the_own_train_step(monkeypatch, spy):
    from memsave_grads.keras import calibration  # pylint: disable=import-outside-toplevel
    real = calibration.calibrate_model
    monkeypatch.setattr(calibration, "calibrate_model", lambda model, budget, **kwargs: real(
        model, budget, runs=1, max_measurements=3,
        **{k: v for k, v in kwargs.items() if k != "runs"}))
    cls = _custom_model_class(keras3, penalty=False)
    want_losses, _ = _train(keras3, cls, "stock")
    x, y = _data()
    model = _build(keras3, cls)
    mg.wrap_model(model, "budget:60%:calibrated")
    history = model.fit(x, y, epochs=3, batch_size=BATCH, shuffle=False, verbose=0)
    step = model.train_step
    assert step.calibrated and all(not b.calibrate for b in step.calibrated.values())
    # The calibration's plans ran the model's own step, its tape routed with each plan.
    assert sum(isinstance(c, mg.Budget) for c in spy) >= 2, spy
    np.testing.assert_allclose(history.history["objective"], want_losses, rtol=1e-5)


def _step_class(keras, how: str):
    """A model whose own train_step takes its gradients ``how``: with tf.gradients (which
    wrap_model does not route), or through memsave_grads itself."""

    class OwnGradients(keras.Model):
        def train_step(self, data):
            if how == "keras_train_step":
                return mg.keras.train_step(self, data)
            x, y = data
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
            variables = self.trainable_variables
            handles = [getattr(v, "value", v) for v in variables]  # Keras 3 wraps tf.Variables
            grads = (tf.gradients(loss, handles) if how == "tf.gradients"
                     else mg.gradients(loss, handles, checkpoints="memory"))
            self.optimizer.apply_gradients(zip(grads, variables))
            return {"objective": loss}

    return OwnGradients


@pytest.mark.parametrize("how", ["tf.gradients", "mg.gradients", "keras_train_step"])
def test_own_train_step_computing_nothing_through_memsave_grads_is_said(how, caplog):
    x, y = _data()
    cls = _step_class(keras3, how)
    with caplog.at_level("WARNING"):
        for _ in range(2):  # said once per class
            model = _build(keras3, cls)
            mg.wrap_model(model, "memory")
            model.fit(x, y, epochs=1, batch_size=BATCH, verbose=0)
    said = [m for m in caplog.messages if "computed no gradient through memsave_grads" in m]
    assert len(said) == (1 if how == "tf.gradients" else 0), caplog.messages
    if how != "tf.gradients":
        return
    model = _build(keras3, cls)
    mg.wrap_model(model, "memory", fallback="error")
    with pytest.raises(mg.InvalidArgumentError, match="OwnGradients.train_step computed no"):
        model.fit(x, y, epochs=1, batch_size=BATCH, verbose=0)


def test_own_train_step_and_early_release_are_refused_together():
    model = _build(keras3, _custom_model_class(keras3, penalty=False))
    with pytest.raises(mg.InvalidArgumentError, match="release_gradients_early"):
        mg.wrap_model(model, release_gradients_early=True)
    assert not mg.is_wrapped(model)


@pytest.mark.slow
def test_benchmark_targets():
    """The issue's targets, at the benchmark's size (docs/benchmarks.md, "GradientTape"): the
    patched tape loop and a wrapped own train_step peak at least 3x below the unrouted ones,
    with the same losses and weights. Each cell is a fresh process."""
    from memsave_grads.bench import tapes  # pylint: disable=import-outside-toplevel
    text = tapes.table(blocks=32, width=512, batch=2048,
                       programs=("tape loop", "own train_step"))
    rows = [line.split("|")[1:-1] for line in text.splitlines()[2:]]
    for program, way, _, ratio, loss_diff, weight_diff in rows:
        if way.strip() in ("tf.GradientTape", "stock fit"):
            continue
        assert float(ratio.strip().rstrip("x")) >= 3.0, text
        assert float(loss_diff) <= 1e-5 and float(weight_diff) <= 1e-5, text


def _two_tape_lstm_model(keras):
    """A GAN-style own train_step: two tapes at once over one forward pass through an LSTM
    (a tf.while_loop, which TensorFlow wraps in a function call for the two tapes), each
    differentiated with respect to its own variables."""

    class TwoTapes(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as first, tf.GradientTape() as second:
                out = self(x, training=True)
                squared = tf.reduce_mean(tf.square(out - y))
                absolute = tf.reduce_mean(tf.abs(out - y))
            own, rest = self.trainable_variables[:3], self.trainable_variables[3:]
            grads = first.gradient(squared, own) + second.gradient(absolute, rest)
            self.optimizer.apply_gradients(zip(grads, own + rest))
            return {"objective": squared}

    keras.utils.set_random_seed(0)
    inputs = keras.Input((12, 8))
    model = TwoTapes(inputs, keras.layers.Dense(1)(keras.layers.LSTM(16)(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    return model


@pytest.mark.parametrize("how", ["wrap_model", "patch"])
def test_an_own_two_tape_step_with_an_lstm_trains_as_stock(how):
    """TensorFlow wraps the LSTM's loop for the two tapes; routed, the wrapped loop's reads are
    hoisted, except where its body holds a custom gradient (the cells ``wrap_model``
    recomputes): rebuilt, that body had left TensorFlow's tape reading the old one
    (``InaccessibleTensorError``; design note "tape routing")."""
    rng = np.random.RandomState(1)
    x, y = rng.randn(32, 12, 8).astype(np.float32), rng.randn(32, 1).astype(np.float32)

    def train(how):
        model = _two_tape_lstm_model(keras3)
        if how == "wrap_model":
            mg.wrap_model(model, "memory")
        if how == "patch":
            with mg.patch("memory"):
                history = model.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
        else:
            history = model.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
        return history.history["objective"], model.get_weights()

    want_losses, want_weights = train("stock")
    got_losses, got_weights = train(how)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for got, want in zip(got_weights, want_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
