"""memsave_grads.keras: wrap_model trains a Keras model as stock Keras does, with less memory.

Keras 2 (tf_keras) and Keras 3 (keras, the TensorFlow backend) side by side: the same model
(identical initial weights), the same data, shuffle=False, trained with and without wrap_model.
"""

import sys

import numpy as np
import pytest
import tensorflow as tf

import memsave_grads
from memsave_grads import api
from memsave_grads import measure
from memsave_grads.keras import is_wrapped
from memsave_grads.keras import train_step
from memsave_grads.keras import unwrap_model
from memsave_grads.keras import wrap_model

from keras_support import FLAVOURS, KERAS, clear_session, fresh_keras, keras3, tf_keras  # noqa: F401,E402

MIB = measure.MIB


@pytest.fixture
def spy(monkeypatch):
    """Records, per memsave_grads.gradients call, how many recomputed ops it added."""
    calls = []
    real = api.gradients

    def recording(ys, xs, *args, **kwargs):
        before = len(ys.graph.get_operations())
        grads = real(ys, xs, *args, **kwargs)
        added = ys.graph.get_operations()[before:]
        calls.append(sum("_memsave/recompute" in op.name for op in added))
        return grads

    monkeypatch.setattr(api, "gradients", recording)
    return calls


def _residual_mlp(keras, depth, width, inputs, regularize=False):
    """h = h + tanh(Dense(h)) blocks between an input and an output projection."""
    kwargs = {}
    if regularize:
        kwargs["kernel_regularizer"] = keras.regularizers.l2(1e-4)
    x = keras.Input((inputs,))
    h = keras.layers.Dense(width, name="stem")(x)
    for i in range(depth):
        update = keras.layers.Dense(
            width, activation="tanh", name=f"block{i}",
            kernel_initializer=keras.initializers.VarianceScaling(0.1, seed=i), **kwargs)(h)
        h = keras.layers.Add(name=f"add{i}")([h, update])
    return keras.Model(x, keras.layers.Dense(1, name="head")(h), name="resmlp")


def _optimizer(keras, name):
    if name == "sgd":
        return keras.optimizers.SGD(0.01, momentum=0.5)
    if name == "adam":
        return keras.optimizers.Adam(1e-3)
    inner = keras.optimizers.SGD(0.01)
    if keras is tf_keras:
        return tf_keras.mixed_precision.LossScaleOptimizer(inner)
    return keras.optimizers.LossScaleOptimizer(inner)


def _data(dtype, rows=128, inputs=16, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(rows, inputs).astype(dtype)
    y = np.sin(x @ rng.randn(inputs, 1)).astype(dtype)
    sample_weight = rng.uniform(0.5, 1.5, rows).astype(dtype)
    return x, y, sample_weight


def _fit(keras, optimizer, initial, wrapped, steps_per_execution=1, jit_compile=False):
    """(history, initial weights, final weights, model); initial=None keeps the model's own."""
    model = _residual_mlp(keras, depth=6, width=32, inputs=16, regularize=True)
    if initial is None:
        initial = model.get_weights()
    else:
        model.set_weights(initial)
    model.compile(optimizer=_optimizer(keras, optimizer), loss="mse", metrics=["mae"],
                  steps_per_execution=steps_per_execution, jit_compile=jit_compile)
    if wrapped:
        assert wrap_model(model, checkpoints="memory") is model
    x, y, sample_weight = _data(keras.backend.floatx())
    history = model.fit(x, y, sample_weight=sample_weight, epochs=2, batch_size=32,
                        shuffle=False, verbose=0)
    return history.history, initial, model.get_weights(), model


def _assert_weights_close(actual, expected, rtol=1e-5):
    """rtol per element, with the floor of rtol x the largest magnitude of that weight
    (conftest.assert_grads_close: sums in another order differ by ulps of the largest term)."""
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * np.abs(e).max(),
                                   err_msg=f"weight {i}")


# Adam runs in float64. It divides every gradient element by its own running magnitude, so in
# float32 an element whose gradient is rounding noise (summing the same partials in another
# order) moves its weight by up to the learning rate. Measured over 12 float32 Adam steps: the
# per-epoch losses agreed to 1e-7, but 1-2 of 16384 weights differed by up to 8e-5 relative --
# and stock Keras 2 and stock Keras 3 differ from each other on the same weight by as much. In
# float64 the wrapped run gives stock Keras's weights.
# Under XLA (jit_compile=True, compared with stock fit under XLA) the recomputation waits for
# its gradients through dataflow (design note "ordering under XLA"); float64, because XLA fuses
# the two steps' elementwise ops differently and float32 rounds the fusions differently.
@FLAVOURS
@pytest.mark.parametrize("optimizer,dtype,steps_per_execution,jit_compile", [
    ("sgd", "float32", 2, False), ("adam", "float64", 1, False),
    ("loss_scale", "float32", 1, False), ("adam", "float64", 2, True)],
    ids=["sgd", "adam", "loss_scale", "adam_xla"])
def test_fit_matches_stock_keras(flavour, optimizer, dtype, steps_per_execution, jit_compile,
                                 spy):
    keras = KERAS[flavour]
    keras.backend.set_floatx(dtype)
    keras.utils.set_random_seed(0)
    plain_history, initial, plain_weights, _ = _fit(
        keras, optimizer, None, wrapped=False, steps_per_execution=steps_per_execution,
        jit_compile=jit_compile)
    assert spy == [], "stock Keras must not reach memsave_grads"
    history, _, weights, model = _fit(keras, optimizer, initial, wrapped=True,
                                      steps_per_execution=steps_per_execution,
                                      jit_compile=jit_compile)

    assert is_wrapped(model) and model.jit_compile is jit_compile
    assert spy and all(recomputed > 0 for recomputed in spy), spy  # traced, and rewritten
    assert sorted(history) == sorted(plain_history) == ["loss", "mae"]
    for key in plain_history:
        np.testing.assert_allclose(history[key], plain_history[key], rtol=1e-5, err_msg=key)
    assert plain_history["loss"][-1] < plain_history["loss"][0]  # it trains at all
    _assert_weights_close(weights, plain_weights)


def _peak_of_train_step(keras, wrapped):
    keras.utils.set_random_seed(0)
    model = _residual_mlp(keras, depth=24, width=256, inputs=256)
    model.compile(optimizer=keras.optimizers.SGD(0.001), loss="mse")
    if wrapped:
        wrap_model(model)
    x, y, _ = _data("float32", rows=1024, inputs=256)
    model.train_on_batch(x, y)  # traces the step; the first run allocates kernel scratch
    peak, loss = measure.peak_bytes_of(lambda: model.train_on_batch(x, y))
    return peak / MIB, loss


@FLAVOURS
def test_wrapped_train_step_peaks_lower(flavour):
    """One train_on_batch of a 24-block residual MLP (1 MiB per activation), CPU BFC peak.

    Measured (TF 2.21, CPU, several runs): Keras 2 56-59.5 MiB stock vs 13.3-16.0 MiB wrapped
    (20.3-23, about the weights' 6 MiB more, until the wrapped tf_keras step skipped Keras'
    one-op sum over replicas and ordered its updates: design note "early release");
    Keras 3 50.3-53.2 vs 14.3-17.5 MiB.
    """
    keras = KERAS[flavour]
    plain_mib, plain_loss = _peak_of_train_step(keras, wrapped=False)
    clear_session(keras)
    ours_mib, loss = _peak_of_train_step(keras, wrapped=True)
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-5)
    assert plain_mib >= 45, f"stock {flavour} step peaked at only {plain_mib:.1f} MiB"
    assert ours_mib <= 30 and ours_mib <= 0.55 * plain_mib, (
        f"wrapped {flavour} step peaked at {ours_mib:.1f} MiB vs stock {plain_mib:.1f} MiB")


def _small_model(keras, depth=3, optimizer="sgd", **compile_kwargs):
    keras.utils.set_random_seed(0)
    model = _residual_mlp(keras, depth=depth, width=16, inputs=8)
    if optimizer is not None:
        model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    return model


def _small_fit(model, epochs=1):
    x, y, _ = _data("float32", rows=32, inputs=8)
    return model.fit(x, y, epochs=epochs, batch_size=16, shuffle=False, verbose=0)


@FLAVOURS
def test_recompile_keeps_wrapping_and_unwrap_restores(flavour, spy):
    keras = KERAS[flavour]
    model = wrap_model(_small_model(keras))
    model.compile(optimizer="sgd", loss="mse")  # compiling again keeps the wrapping
    _small_fit(model)
    assert is_wrapped(model) and len(spy) >= 1
    traced = len(spy)
    assert unwrap_model(model) is model and not is_wrapped(model)
    assert "train_step" not in vars(model)
    _small_fit(model)
    assert len(spy) == traced, "an unwrapped model must train with the stock step"


@FLAVOURS
@pytest.mark.parametrize("jit_compile", [True, False, "auto"])
def test_the_users_jit_compile_is_kept(flavour, jit_compile, spy):
    """wrap_model leaves XLA as the user compiled it, before and after compiling again."""
    keras = KERAS[flavour]
    if keras is tf_keras and jit_compile == "auto":
        pytest.skip("tf_keras has no jit_compile='auto'")
    model = _small_model(keras, optimizer="sgd", jit_compile=jit_compile)
    chosen = model.jit_compile  # Keras 3 resolves "auto" at compile time
    wrap_model(model)
    assert model.jit_compile == chosen
    _small_fit(model)
    assert model.jit_compile == chosen and spy and spy[0] > 0
    traced = len(spy)
    model.compile(optimizer="sgd", loss="mse", jit_compile=not chosen)
    _small_fit(model)
    assert model.jit_compile == (not chosen) and is_wrapped(model) and len(spy) > traced


@FLAVOURS
def test_checkpoint_name_patterns_and_fallback(flavour, spy, caplog):
    keras = KERAS[flavour]
    # Keras 3 suffixes op scopes inside the traced step ("resmlp_1/block1_1/Tanh").
    model = wrap_model(_small_model(keras), checkpoints=["*block1*/Tanh"])
    _small_fit(model)
    assert spy and spy[0] > 0
    clear_session(keras)
    # 'collection' finds nothing in a traced Keras step: "warn" falls back to tf.gradients...
    plain = _small_fit(_small_model(keras)).history["loss"]
    clear_session(keras)
    model = wrap_model(_small_model(keras), checkpoints="collection")
    with caplog.at_level("WARNING"):
        fallen_back = _small_fit(model).history["loss"]
    assert "falling back to tf.gradients" in caplog.text
    np.testing.assert_allclose(fallen_back, plain, rtol=1e-6)
    # ... and "error" raises our error type, through Keras 2's AutoGraph-converted step too.
    clear_session(keras)
    model = wrap_model(_small_model(keras), checkpoints="collection", fallback="error")
    with pytest.raises(memsave_grads.NoCheckpointsFoundError, match="collection"):
        _small_fit(model)


class _CustomStep(tf_keras.Model):
    """A subclassed Keras 2 model whose own train_step delegates to memsave_grads."""

    def __init__(self):
        super().__init__()
        self.blocks = [tf_keras.layers.Dense(16, activation="tanh") for _ in range(3)]
        self.head = tf_keras.layers.Dense(1)

    def call(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def train_step(self, data):
        return train_step(self, data, checkpoints="memory")


class _StockStep(_CustomStep):
    train_step = tf_keras.Model.train_step


def test_train_step_from_a_custom_train_step(spy):
    x, y, _ = _data("float32", rows=32, inputs=16)
    histories, initial = [], None
    for cls in (_StockStep, _CustomStep):
        model = cls()
        model(x[:1])
        if initial is None:
            initial = model.get_weights()
        else:
            model.set_weights(initial)
        model.compile(optimizer=tf_keras.optimizers.SGD(0.05), loss="mse")
        history = model.fit(x, y, epochs=3, batch_size=16, shuffle=False, verbose=0)
        histories.append(history.history["loss"])
        if cls is _StockStep:
            assert spy == []
    assert spy and spy[0] > 0
    assert histories[0][-1] < histories[0][0]
    np.testing.assert_allclose(histories[1], histories[0], rtol=1e-5)


# ------------------------------------------------------------------------------------------
# Bad input: our error types, raised before the model is changed
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("not_a_model", [object(), tf.Module(), "model", None])
def test_rejects_non_keras_objects(not_a_model):
    with pytest.raises(memsave_grads.InvalidTypeError, match="expected a Keras Model"):
        wrap_model(not_a_model)


def test_rejects_a_keras_layer_that_is_not_a_model():
    with pytest.raises(memsave_grads.InvalidTypeError, match="expected a Keras Model"):
        wrap_model(tf_keras.layers.Dense(3))


@FLAVOURS
def test_rejects_uncompiled_eager_models_and_early_release_of_an_own_step(flavour):
    keras = KERAS[flavour]
    model = _small_model(keras, optimizer=None)
    with pytest.raises(memsave_grads.InvalidArgumentError, match="not compiled.*compile"):
        wrap_model(model)
    model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    with pytest.raises(memsave_grads.InvalidArgumentError, match="runs eagerly.*run_eagerly"):
        wrap_model(model)
    assert not is_wrapped(model)

    class OwnStep(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    inputs = keras.Input((4,))
    own = OwnStep(inputs, keras.layers.Dense(1)(inputs))
    own.compile(optimizer="sgd", loss="mse")
    # Its tapes can be routed (tests/test_tape_keras.py), but not its updates ordered.
    with pytest.raises(memsave_grads.InvalidArgumentError,
                       match="release_gradients_early.*its own train_step"):
        wrap_model(own, release_gradients_early=True)
    assert not is_wrapped(own)


@pytest.mark.parametrize("checkpoints,error,match", [
    ("fastest", memsave_grads.UnknownStrategyError, "unknown strategy 'fastest'"),
    ("budget:lots", memsave_grads.InvalidArgumentError, "lots"),
    ([], memsave_grads.InvalidArgumentError, "empty list"),
    ([tf.constant(1.0)], memsave_grads.InvalidTypeError, r"checkpoints\[0\].*name pattern"),
    (3, memsave_grads.InvalidTypeError, "checkpoints: expected"),
])
def test_rejects_bad_checkpoints(checkpoints, error, match):
    model = _small_model(tf_keras)
    with pytest.raises(error, match=match):
        wrap_model(model, checkpoints=checkpoints)
    assert not is_wrapped(model)


def test_rejects_bad_fallback_and_unwrapping_an_unwrapped_model():
    model = _small_model(keras3)
    with pytest.raises(memsave_grads.InvalidArgumentError, match="fallback"):
        wrap_model(model, fallback="ignore")
    with pytest.raises(memsave_grads.InvalidArgumentError, match="not wrapped"):
        unwrap_model(model)


def test_rejects_a_keras2_model_built_in_a_v1_graph():
    with tf.Graph().as_default():
        model = _small_model(tf_keras)
        with pytest.raises(memsave_grads.InvalidArgumentError, match=r"memsave_grads\.patch"):
            wrap_model(model)


def test_train_step_called_eagerly_raises():
    model = _small_model(tf_keras)
    x, y, _ = _data("float32", rows=4, inputs=8)
    with pytest.raises(memsave_grads.EagerExecutionError, match="run_eagerly=False"):
        train_step(model, (x, y))


def test_missing_tf_keras_is_a_missing_dependency(monkeypatch):
    model = _small_model(tf_keras)
    monkeypatch.setitem(sys.modules, "tf_keras", None)  # `import tf_keras` now fails
    with pytest.raises(memsave_grads.MissingDependencyError, match="pip install tf-keras"):
        wrap_model(model)


def test_memsave_grads_keras_imports_no_keras_at_module_level():
    """tf_keras stays optional: the package imports Keras only inside functions."""
    import ast
    import pathlib
    import memsave_grads.keras as package

    top_level = set()
    for path in pathlib.Path(package.__file__).parent.glob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Import):
                top_level.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                top_level.add((node.module or "").split(".")[0])
    assert "tensorflow" in top_level  # the parse found the imports
    assert not top_level & {"tf_keras", "keras"}, top_level
