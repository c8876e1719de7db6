"""Grappler's gradient accumulators (design note "Grappler's gradient accumulators"): where
Grappler thinks a step is near the device's memory, it turns sums of three or more gradients
into TemporaryVariable accumulators whose zero initializers constant folding keeps between
steps. ``without_grappler_scheduling`` runs functions without that pass; wrap_model's fit and
train_on_batch run under it."""

import contextlib
import gc

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2
from tensorflow.python.eager import context

import memsave_grads as mg
from keras_support import FLAVOURS, KERAS
from keras_support import fresh_keras  # noqa: F401  (fixture)
from memsave_grads._tf import grappler_options

MEMORY_OPTIONS = rewriter_config_pb2.RewriterConfig
#: 4096 x 4096 float32 activations (64 MiB): three gradient terms of that size pass the 205 MiB
#: (80% of the 256 MiB TensorFlow reports for a CPU) that makes Grappler accumulate them.
ROWS = COLUMNS = 4096


def _ops_after_grappler(call) -> set:
    """The op types of the graphs that ``call`` instantiated, as Grappler left them."""
    eager = context.context()
    eager.enable_graph_collection()
    try:
        call()
        metadata = eager.export_run_metadata()
    finally:
        eager.disable_graph_collection()
    found = set()
    for function_graphs in metadata.function_graphs:
        graph = function_graphs.post_optimization_graph
        found.update(node.op for node in graph.node)
        for function in graph.library.function:
            found.update(node.op for node in function.node_def)
    for graph in metadata.partition_graphs:
        found.update(node.op for node in graph.node)
    return found


def _three_readers_step():
    """A step whose activation ``y`` (64 MiB) is read by three ops: its gradient is a sum of
    three terms."""
    scale = tf.Variable(tf.ones([COLUMNS]))
    x = tf.random.stateless_uniform([ROWS, COLUMNS], seed=(1, 2))

    @tf.function
    def step():
        y = x * scale
        loss = (tf.reduce_sum(tf.sin(y)) + tf.reduce_sum(tf.cos(y))
                + tf.reduce_sum(tf.tanh(y)))
        return tf.gradients(loss, [scale])[0]

    return step


#: On a GPU the estimate stays far below 80% of the card's memory: Grappler leaves the sums.
CPU_ONLY = pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")),
                              reason="Grappler rewrites only near the device's memory")


@CPU_ONLY
def test_grappler_accumulates_a_large_gradient_sum_unless_told_not_to():
    # The first half is TensorFlow's behaviour the note describes: if it stops, the note and
    # the option need revisiting.
    assert "TemporaryVariable" in _ops_after_grappler(_three_readers_step())
    with mg.without_grappler_scheduling():
        ops = _ops_after_grappler(_three_readers_step())
    assert "TemporaryVariable" not in ops and "AddN" in ops


def test_the_option_holds_inside_and_is_restored_after():
    before = context.context().function_call_options
    assert grappler_options.memory_optimization(
        grappler_options.current_call_config()) == MEMORY_OPTIONS.DEFAULT_MEM_OPT
    with mg.without_grappler_scheduling():
        inside = grappler_options.current_call_config()
        assert grappler_options.memory_optimization(inside) == MEMORY_OPTIONS.SWAPPING_HEURISTICS
        # Everything else is as the context configured it.
        outside = tf.compat.v1.ConfigProto()
        outside.ParseFromString(before.config_proto_serialized)
        outside.graph_options.rewrite_options.memory_optimization = (
            MEMORY_OPTIONS.SWAPPING_HEURISTICS)
        assert inside == outside
    assert context.context().function_call_options is before


def test_a_memory_optimization_someone_chose_is_kept():
    eager = context.context()
    before = eager.function_call_options
    chosen = grappler_options.current_call_config()
    chosen.graph_options.rewrite_options.memory_optimization = MEMORY_OPTIONS.HEURISTICS
    eager.function_call_options = context.FunctionCallOptions(config_proto=chosen)
    try:
        with mg.without_grappler_scheduling():
            assert grappler_options.memory_optimization(
                grappler_options.current_call_config()) == MEMORY_OPTIONS.HEURISTICS
    finally:
        eager.function_call_options = before


def test_the_option_is_restored_when_the_body_raises():
    before = context.context().function_call_options
    with pytest.raises(ZeroDivisionError):
        with mg.without_grappler_scheduling():
            1 / 0  # pylint: disable=pointless-statement
    assert context.context().function_call_options is before


def _three_readers_model(keras):
    inputs = keras.Input((COLUMNS,))
    scaled = keras.layers.Dense(COLUMNS, use_bias=False)(inputs[:, :1]) * inputs
    summed = keras.layers.Add()([keras.activations.sigmoid(scaled),
                                 keras.activations.tanh(scaled), keras.activations.relu(scaled)])
    outputs = keras.layers.Dense(1)(summed)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    return model


@CPU_ONLY
@FLAVOURS
def test_wrapped_fit_and_train_on_batch_train_without_accumulators(flavour, monkeypatch):
    keras = KERAS[flavour]
    x = np.random.default_rng(0).standard_normal((ROWS, COLUMNS)).astype("float32")
    y = np.zeros((ROWS, 1), "float32")

    def ops_of(call):
        model = mg.wrap_model(_three_readers_model(keras), checkpoints="speed")
        if call == "fit":
            return _ops_after_grappler(lambda: model.fit(x, y, batch_size=ROWS, verbose=0))
        return _ops_after_grappler(lambda: model.train_on_batch(x, y))

    for call in ("train_on_batch", "fit"):
        assert "TemporaryVariable" not in ops_of(call), call
    # The control: the same wrapped step, with the option made a no-op, is rewritten.
    monkeypatch.setattr(grappler_options, "without_grappler_scheduling", contextlib.nullcontext)
    assert "TemporaryVariable" in ops_of("train_on_batch")


def test_a_setter_called_inside_keeps_its_result():
    # tf.config setters drop the thread's call options; restoring ours over theirs would undo
    # the user's setting.
    eager = context.context()
    before = eager.function_call_options
    placement = tf.config.get_soft_device_placement()
    try:
        with mg.without_grappler_scheduling():
            tf.config.set_soft_device_placement(not placement)
        # Not the options from before the block (they predate the setter): rebuilt from it.
        assert eager.function_call_options is not before
        assert grappler_options.memory_optimization(
            grappler_options.current_call_config()) == MEMORY_OPTIONS.DEFAULT_MEM_OPT
    finally:
        tf.config.set_soft_device_placement(placement)


def test_a_wrapped_models_bound_train_on_batch_keeps_it_alive():
    # As a bound method does: examples keep `step = build().train_on_batch` and call it later.
    keras = KERAS["keras3"]

    def build():
        inputs = keras.Input((8,))
        model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(8)(inputs)))
        model.compile(optimizer="sgd", loss="mse")
        return mg.wrap_model(model, checkpoints="speed")

    step, fit = build().train_on_batch, build().fit
    gc.collect()
    x, y = np.ones((4, 8), "float32"), np.ones((4, 1), "float32")
    step(x, y)
    fit(x, y, verbose=0)
