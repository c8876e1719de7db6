"""docs/profiling.md's recipe: TensorBoard's profiler shows a wrapped ``fit``'s saving.

The profiler's memory_profile tool reads the allocator's events from the trace; this test
profiles the same steps of a Keras 3 ``fit`` with and without ``wrap_model`` and reads the
peaks from the trace files as the page shows, so that the recipe stays true.
"""

import glob
import json

import numpy as np
import pytest
import tensorflow as tf

import memsave_grads as mg

profiler_plugin = pytest.importorskip(
    "tensorflow.python.profiler.internal._pywrap_profiler_plugin")
keras = pytest.importorskip("keras")

BLOCKS, WIDTH, BATCH = 12, 256, 512


def _model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    h = inputs
    for _ in range(BLOCKS):
        h = keras.layers.Dense(WIDTH, activation="gelu")(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _profiled_peaks_bytes(model, logdir) -> dict[str, int]:
    """The memory_profile peak of each allocator over two ``fit`` steps, after a first
    ``fit`` that traced the step (what ``profile_batch=(3, 4)`` skips in the docs), above the
    lowest point of its timeline."""
    rng = np.random.default_rng(0)
    x = rng.random((2 * BATCH, WIDTH), dtype=np.float32)
    y = rng.random((2 * BATCH, 1), dtype=np.float32)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    with tf.profiler.experimental.Profile(str(logdir)):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    paths = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
    assert paths, f"no trace file under {logdir}"
    data, _ = profiler_plugin.xspace_to_tools_data(paths, "memory_profile", {})
    profiles = json.loads(data)["memoryProfilePerAllocator"]
    # Above the timeline's lowest point: what the process held before (weights, the batches,
    # earlier tests' tensors) is not the steps'.
    return {name: int(p["profileSummary"]["peakStats"]["peakBytesInUse"])
            - min(int(s["aggregationStats"]["heapAllocatedBytes"])
                  for s in p["memoryProfileSnapshots"])
            for name, p in profiles.items()}


def test_the_profilers_memory_timeline_shows_the_wrapped_fits_saving(tmp_path):
    held = tf.ones([16, 1024, 1024])  # 64 MiB held throughout, as earlier tests may leave
    plain = _profiled_peaks_bytes(_model(), tmp_path / "plain")
    wrapped = _profiled_peaks_bytes(mg.wrap_model(_model(), fallback="error"),
                                    tmp_path / "wrapped")
    # On CPU the BFC allocator (tests/conftest.py switches it on) records the events, under
    # the name the page gives.
    allocator = "bfc_cpu_allocator_for_gpu"
    assert allocator in plain and allocator in wrapped, (plain, wrapped)
    # 12 blocks of 512x256 float32 activations (0.5 MiB each, a few per block): the plain
    # step holds them all at its peak, the wrapped one about sqrt(12) of them. Measured: 26.5 and 8.0 MiB above the lowest point.
    assert wrapped[allocator] < 0.7 * plain[allocator], (plain, wrapped)
    del held
