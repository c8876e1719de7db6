"""Graph constructs that Keras models are made of, through the rewrite (issue 14 item 3).

tf.functions called inside the forward pass (plain, nested, reading a variable, capturing a
tensor, ``jit_compile=True``: how Keras runs grouped convolutions), and Keras layers in Keras 2
(tf_keras) and Keras 3: grouped convolutions, a ConvNeXt-style block stack, attention, LSTM/GRU,
batch normalization in training mode, dropout. Each gives tf.gradients' values, and each is
really rewritten: copies of its forward ops run again, and nothing falls back to tf.gradients.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import memsave_grads as mg
from conftest import assert_grads_close
from memsave_grads import api
from memsave_grads import measure
from memsave_grads.keras import is_wrapped
from memsave_grads.keras import wrap_model

from keras_support import FLAVOURS, KERAS, clear_session, fresh_keras, keras3, tf_keras  # noqa: F401,E402

MIB = measure.MIB
RECOMPUTE_SCOPE = "_memsave/recompute"  # where the rewrite puts the copies it runs again
from memsave_grads.core.op_types import FUNCTION_CALL_OP_TYPES as CALL_OP_TYPES  # noqa: E402


@pytest.fixture
def spy(monkeypatch):
    """The op types each memsave_grads.gradients call copied to run again, one list per call
    (Keras' training step calls it through api.gradients_or_fallback)."""
    calls = []
    real = api.gradients

    def recording(ys, xs, *args, **kwargs):
        graph = (ys[0] if isinstance(ys, (list, tuple)) else ys).graph
        before = len(graph.get_operations())
        grads = real(ys, xs, *args, **kwargs)
        calls.append(_recomputed_types(graph.get_operations()[before:]))
        return grads

    monkeypatch.setattr(api, "gradients", recording)
    return calls


def _recomputed_types(ops) -> list:
    return [op.type for op in ops if RECOMPUTE_SCOPE in op.name]


def _fallback_warnings(caplog) -> list:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and "falling back" in r.getMessage()]


def _atol_floor(expected) -> float:
    """An absolute floor for gradients that are zero by cancellation: the key bias of
    attention (softmax ignores a constant shift of its logits), a bias before batch
    normalization. Their tf.gradients value is rounding noise of the other gradients' size."""
    scales = [float(np.max(np.abs(e))) for e in expected if e is not None and np.size(e)]
    return 1e-5 * max(scales, default=0.0)


def _assert_same_kinds(ours, reference):
    """None where tf.gradients gives None, IndexedSlices where it gives IndexedSlices."""
    assert [type(g).__name__ for g in ours] == [type(g).__name__ for g in reference]


# ------------------------------------------------------------------------------------------
# tf.functions called in the forward pass
# ------------------------------------------------------------------------------------------

DEPTH, ROWS, WIDTH = 6, 4, 16
INNER_KINDS = ["plain", "nested", "reads_variable", "captures_tensor", "jit_compile",
               "calls_jit_compile"]


def _inner_functions(scale_variable, captured):
    """One block function per kind. ``captured`` is a tensor of the caller's graph that the
    captures_tensor function closes over."""

    @tf.function
    def plain(h):
        return tf.tanh(h) * 0.5 + tf.sin(h) * 0.25

    @tf.function
    def nested(h):
        return plain(tf.sin(h)) * h  # a call op whose function calls another function

    @tf.function
    def nested_twice(h):
        return nested(h) + 0.1 * h  # two levels of calls below the step's graph

    @tf.function
    def reads_variable(h):
        return tf.tanh(h * scale_variable)  # a stateful call: it reads a variable

    @tf.function
    def captures_tensor(h):
        return tf.tanh(h * captured)  # the captured tensor becomes an input of the call op

    @tf.function(jit_compile=True)
    def jit_compiled(h):
        return tf.tanh(h) * tf.sin(h)

    @tf.function
    def calls_jit_compiled(h):  # Keras' grouped convolution: an XLA function inside a layer
        return jit_compiled(h) + h * 0.5

    return {"plain": plain, "nested": nested_twice, "reads_variable": reads_variable,
            "captures_tensor": captures_tensor, "jit_compile": jit_compiled,
            "calls_jit_compile": calls_jit_compiled}


class _Chain:
    """h = h + block_i(h @ w_i): a residual chain whose blocks are called tf.functions."""

    def __init__(self):
        rng = np.random.RandomState(0)
        self.weights = [tf.Variable(rng.randn(WIDTH, WIDTH).astype(np.float32) * 0.4,
                                    name=f"w{i}") for i in range(DEPTH)]
        self.scale = tf.Variable(np.linspace(0.5, 1.5, WIDTH).astype(np.float32), name="scale")
        self.x_value = rng.randn(ROWS, WIDTH).astype(np.float32)

    def loss(self, x, kinds):
        """The loss and the residual stream; block i is of kind ``kinds[i % len(kinds)]``.
        The captured tensor depends on x, so x's gradient also flows through the call op's
        captured input."""
        captured = 1.0 + 0.5 * tf.tanh(tf.reduce_mean(x, axis=0))
        functions = _inner_functions(self.scale, captured)
        h, stream = x, []
        for i, w in enumerate(self.weights):
            h = h + functions[kinds[i % len(kinds)]](tf.matmul(h, w))
            stream.append(h)
        return tf.reduce_sum(h * h), stream

    def xs(self, x):
        return [x, *self.weights, self.scale]


def _gradients_in_tf_function(chain, kinds, checkpoints):
    """(ours, tf.gradients', op types recomputed) inside one traced step."""
    recomputed = []  # filled while tracing

    @tf.function
    def step(x):
        loss, stream = chain.loss(x, kinds)
        xs = chain.xs(x)
        before = len(loss.graph.get_operations())
        ours = mg.gradients(loss, xs, checkpoints=checkpoints(stream))
        recomputed.extend(_recomputed_types(loss.graph.get_operations()[before:]))
        reference = tf.gradients(loss, xs)
        _assert_same_kinds(ours, reference)
        return ours, reference

    ours, reference = step(tf.constant(chain.x_value))
    return ours, reference, recomputed


def _every_other_block(stream):
    return stream[1:-1:2]


@pytest.mark.parametrize("kind", INNER_KINDS)
def test_tf_function_calls_in_the_forward_pass(kind):
    chain = _Chain()
    ours, reference, recomputed = _gradients_in_tf_function(chain, [kind], _every_other_block)
    assert_grads_close(ours, reference)
    assert (reference[-1] is not None) == (kind == "reads_variable")
    # Between the checkpoints the call ops run again, except a stateful call (it reads a
    # variable): its output is kept instead.
    copied_calls = [t for t in recomputed if t in CALL_OP_TYPES]
    assert recomputed and bool(copied_calls) == (kind != "reads_variable"), recomputed


@pytest.mark.parametrize("strategy", ["memory", "speed"])
def test_every_kind_of_call_under_a_planned_strategy(strategy):
    chain = _Chain()
    ours, reference, recomputed = _gradients_in_tf_function(chain, INNER_KINDS,
                                                            lambda stream: strategy)
    assert_grads_close(ours, reference)
    assert recomputed


def test_tf_function_calls_in_a_v1_graph(graph, session):
    chain = _Chain()
    x = tf.constant(chain.x_value)
    loss, stream = chain.loss(x, INNER_KINDS)
    before = len(graph.get_operations())
    ours = mg.gradients(loss, chain.xs(x), checkpoints=_every_other_block(stream))
    recomputed = _recomputed_types(graph.get_operations()[before:])
    reference = tf.gradients(loss, chain.xs(x))
    session.run([v.initializer for v in chain.weights + [chain.scale]])
    assert_grads_close(*session.run([ours, reference]))
    assert set(recomputed) & set(CALL_OP_TYPES), recomputed


def test_speed_keeps_calls_that_run_a_matmul():
    """"speed" keeps matmul outputs; here every matmul runs inside a called function."""
    weights = _Chain().weights

    @tf.function
    def dense_tanh(h, w):
        return tf.tanh(tf.matmul(h, w))

    @tf.function
    def step(x):
        h = x
        for w in weights:
            h = h + dense_tanh(h, w) * 0.5
        loss = tf.reduce_sum(h * h)
        before = len(loss.graph.get_operations())
        ours = mg.gradients(loss, [x, *weights], checkpoints="speed")
        recomputed.extend(_recomputed_types(loss.graph.get_operations()[before:]))
        return ours, tf.gradients(loss, [x, *weights])

    recomputed = []
    ours, reference = step(
        tf.constant(np.random.RandomState(1).randn(ROWS, WIDTH).astype(np.float32)))
    assert_grads_close(ours, reference)
    assert recomputed and not set(recomputed) & set(CALL_OP_TYPES), recomputed


# ------------------------------------------------------------------------------------------
# Keras layers: one small model holding every construct (one trace per Keras keeps this fast)
# ------------------------------------------------------------------------------------------

def _convnext_block(keras, h, width, name):
    """ConvNeXt: depthwise 7x7, LayerNorm, pointwise MLP with GELU, residual."""
    layers = keras.layers
    update = layers.DepthwiseConv2D(7, padding="same", name=f"{name}_dw")(h)
    update = layers.LayerNormalization(epsilon=1e-6, name=f"{name}_ln")(update)
    update = layers.Dense(4 * width, activation="gelu", name=f"{name}_pw1")(update)
    update = layers.Dense(width, name=f"{name}_pw2")(update)
    return layers.Add(name=f"{name}_add")([h, update])


def _convnext(keras, size, width, blocks_per_stage):
    """Stages of ConvNeXt blocks joined by a grouped 3x3 stride-2 convolution (RegNet-style;
    Keras runs it as an XLA-compiled function)."""
    layers = keras.layers
    x = keras.Input((size, size, 3))
    h = layers.Conv2D(width, 1, name="stem")(x)
    for stage, blocks in enumerate(blocks_per_stage):
        if stage:
            h = layers.Conv2D(width, 3, strides=2, padding="same", groups=4,
                              name=f"grouped{stage}")(h)
        for i in range(blocks):
            h = _convnext_block(keras, h, width, f"s{stage}b{i}")
    h = layers.GlobalAveragePooling2D()(h)
    return keras.Model(x, layers.Dense(3, name="head")(h), name="convnext")


IMAGE, TOKENS, VOCABULARY, CHANNELS = 8, 16, 20, 8


def _every_construct(keras):
    """Grouped convolutions, a ConvNeXt block, batch norm and dropout on an image; its 4x4
    feature map as 16 tokens, plus a token embedding (a sparse gradient); self-attention,
    LSTM, GRU."""
    layers = keras.layers
    keras.utils.set_random_seed(0)
    image = keras.Input((IMAGE, IMAGE, 3), name="image")
    tokens = keras.Input((TOKENS,), dtype="int32", name="tokens")
    h = layers.Conv2D(CHANNELS, 1, name="stem")(image)
    h = layers.Conv2D(CHANNELS, 3, padding="same", groups=4, activation="tanh",
                      name="grouped")(h)
    h = _convnext_block(keras, h, CHANNELS, "convnext")
    h = layers.BatchNormalization(momentum=0.5, name="batch_norm")(h)
    h = layers.Dropout(0.25, name="dropout")(h)
    h = layers.Conv2D(CHANNELS, 3, strides=2, padding="same", groups=2, name="grouped_down")(h)
    h = layers.Reshape((TOKENS, CHANNELS), name="to_tokens")(h)
    h = layers.Add(name="with_embedding")(
        [h, layers.Embedding(VOCABULARY, CHANNELS, name="embedding")(tokens)])
    normed = layers.LayerNormalization(name="attention_ln")(h)
    h = layers.Add(name="attention_add")(
        [h, layers.MultiHeadAttention(2, 4, name="attention")(normed, normed)])
    h = layers.LSTM(CHANNELS, return_sequences=True, name="lstm")(h)
    h = layers.GRU(CHANNELS, name="gru")(h)
    return keras.Model([image, tokens], layers.Dense(3, name="head")(h), name="constructs")


def _inputs(rows, seed=0):
    rng = np.random.RandomState(seed)
    return ([rng.randn(rows, IMAGE, IMAGE, 3).astype(np.float32),
             rng.randint(0, VOCABULARY, (rows, TOKENS)).astype(np.int32)],
            rng.randn(rows, 3).astype(np.float32))


def _dense(g):
    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def _weight_names(model, weights):
    return [getattr(w, "path", None) or w.name for w in weights]


@FLAVOURS
def test_keras_constructs_gradients(flavour):
    """mg.gradients of a training-mode forward pass gives tf.gradients' values, and kinds,
    on the same graph (so the same dropout mask and batch statistics)."""
    keras = KERAS[flavour]
    model = _every_construct(keras)
    (image, tokens), target = _inputs(rows=4)
    kinds, recomputed = [], []  # filled while tracing

    @tf.function
    def step(image, tokens):
        loss = tf.reduce_mean(tf.square(model([image, tokens], training=True) - target))
        variables = list(model.trainable_weights)
        before = len(loss.graph.get_operations())
        ours = mg.gradients(loss, variables, checkpoints="memory")
        recomputed.extend(_recomputed_types(loss.graph.get_operations()[before:]))
        reference = tf.gradients(loss, variables)
        kinds.append(([type(g).__name__ for g in ours], [type(g).__name__ for g in reference]))
        return [_dense(g) for g in ours], [_dense(g) for g in reference]

    ours, reference = step(tf.constant(image), tf.constant(tokens))
    names = _weight_names(model, model.trainable_weights)
    assert kinds[0][0] == kinds[0][1], list(zip(names, *kinds[0]))
    assert "IndexedSlices" in kinds[0][1]  # the embedding's gradient stays sparse
    assert recomputed, f"{flavour}: nothing was recomputed"
    atol = _atol_floor(reference)
    for name, a, e in zip(names, ours, reference):
        try:
            assert_grads_close([a], [e], atol=atol)
        except AssertionError as error:
            raise AssertionError(f"{flavour} {name}: {error}") from None


def _assert_weights_close(actual, expected, initial, names, rtol=1e-5):
    """rtol per element with two floors: rtol x the largest magnitude of that weight (sums of
    the same partials in another order differ by ulps of the largest term), and rtol x the
    largest change of any weight (a weight whose gradient is zero by cancellation, such as
    attention's key bias, moves by rounding noise of the other gradients' size)."""
    assert len(actual) == len(expected) == len(initial) == len(names)
    largest_change = max(float(np.abs(e - i).max()) for e, i in zip(expected, initial))
    for name, a, e in zip(names, actual, expected):
        atol = rtol * max(float(np.abs(e).max()), largest_change)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol + 1e-30, err_msg=name)


def _build_optimizer(model):
    """Create the optimizer's variables now: a first step that creates them is traced twice
    (TensorFlow traces a tf.function again once it has created variables), rewrite and all."""
    model.optimizer.build(model.trainable_variables)


def _fit(keras, wrapped):
    clear_session(keras)
    model = _every_construct(keras)
    initial = model.get_weights()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    _build_optimizer(model)
    if wrapped:
        assert wrap_model(model) is model and is_wrapped(model)
    (image, tokens), y = _inputs(rows=16)
    # Full batches from a dataset: from arrays, tf_keras traces its step twice.
    batches = tf.data.Dataset.from_tensor_slices(((image, tokens), y)).batch(
        8, drop_remainder=True)
    history = model.fit(batches, epochs=1, shuffle=False, verbose=0)
    return history.history["loss"], initial, model.get_weights(), _weight_names(model,
                                                                                model.weights)


@FLAVOURS
def test_wrapped_fit_matches_stock_fit(flavour, spy, caplog):
    """Two SGD steps of wrap_model's fit against stock fit: the same losses, weights and batch
    norm moving statistics (updated in the forward pass), with the step rewritten."""
    keras = KERAS[flavour]
    plain_loss, initial, plain_weights, names = _fit(keras, wrapped=False)
    assert spy == [], "stock Keras must not reach memsave_grads"
    with caplog.at_level(logging.WARNING):
        loss, _, weights, _ = _fit(keras, wrapped=True)
    assert not _fallback_warnings(caplog), _fallback_warnings(caplog)
    assert spy and all(spy), f"traced {len(spy)} step(s), recomputed {spy}"
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-5)
    _assert_weights_close(weights, plain_weights, initial, names)
    moving_statistics = [(name, w, w0) for name, w, w0 in zip(names, weights, initial)
                         if "moving" in name]
    assert len(moving_statistics) == 2, names
    for name, w, w0 in moving_statistics:
        assert not np.allclose(w, w0), f"{name} was not updated"


# ------------------------------------------------------------------------------------------
# Memory: a ConvNeXt-style stack with a grouped convolution, one train_on_batch
# ------------------------------------------------------------------------------------------

def _convnext_step_peak_mib(keras, wrapped):
    clear_session(keras)
    keras.utils.set_random_seed(0)
    # 8 x 32 x 32 x 32 float32: 1 MiB per block activation, 4 MiB per MLP hidden layer.
    model = _convnext(keras, size=32, width=32, blocks_per_stage=(4, 1))
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    _build_optimizer(model)
    if wrapped:
        wrap_model(model)
    rng = np.random.RandomState(0)
    x = rng.randn(8, 32, 32, 3).astype(np.float32)
    y = rng.randn(8, 3).astype(np.float32)
    initial = model.get_weights()
    model.train_on_batch(x, y)  # traces the step; the first run allocates kernel scratch
    peak, loss = measure.peak_bytes_of(lambda: model.train_on_batch(x, y))
    return peak / MIB, loss, (model.get_weights(), initial,
                              _weight_names(model, model.weights))


@FLAVOURS
@pytest.mark.never_worse
def test_convnext_with_grouped_convs_peaks_lower(flavour, spy, caplog):
    """One train_on_batch of 5 ConvNeXt blocks and a grouped convolution, CPU BFC peak.

    Measured (TF 2.21, CPU, several runs): Keras 3 95-102 MiB stock vs 33-38 MiB wrapped;
    Keras 2 102-105 vs 37-38 MiB. Before grouped convolutions were told apart from TF1 control
    flow, wrap_model fell back to tf.gradients here and saved nothing.
    """
    keras = KERAS[flavour]
    plain_mib, plain_loss, (plain_weights, initial, names) = _convnext_step_peak_mib(
        keras, wrapped=False)
    with caplog.at_level(logging.WARNING):
        ours_mib, loss, (weights, _, _) = _convnext_step_peak_mib(keras, wrapped=True)
    assert not _fallback_warnings(caplog), _fallback_warnings(caplog)
    assert spy and all(spy)
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-5)
    _assert_weights_close(weights, plain_weights, initial, names)
    assert plain_mib >= 70, f"stock {flavour} step peaked at only {plain_mib:.1f} MiB"
    assert ours_mib <= 0.55 * plain_mib, (
        f"wrapped {flavour} step peaked at {ours_mib:.1f} MiB vs stock {plain_mib:.1f} MiB")
