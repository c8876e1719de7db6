"""The benchmark under XLA: one training step in ``tf.function``, with and without
``jit_compile``, four ways: tf.gradients, memsave_grads ``"memory"``, and the two peers a
user already has: ``tf.recompute_grad`` around every ``k ~ sqrt(n)`` blocks (what a
TensorFlow user would write) and Keras 3's ``keras.RematScope(mode="full")`` (every block a
Keras layer created in the scope, so Keras wraps each block's call in ``tf.recompute_grad``:
per-block rematerialization).

The models are built as *blocks* (``h -> h``) between a stem and a head, so that the peers can
wrap them; the variables and inputs are created eagerly, once, and every step function reads
them.

Each (model, method, compilation) has its peak and gradient error measured in a fresh process
(:func:`measure`, which runs this module as a script); the step times of one compilation are
measured in one more process, every method's step timed in turns
(:func:`measure.interleaved_median_seconds`), so that their ratios hold on a loaded machine
where separate processes' times do not. XLA allocates a step's temporaries as one buffer, and the BFC
allocator does not split a free chunk that is less than twice the request: in a process whose
heap earlier steps left in pieces, the same program measured up to 1.5x more (the residual
MLP: 22.5 instead of 17 MiB) depending on what ran before. Peaks are the allocator's (on CPU,
XLA allocates through the BFC allocator too; on GPU, ``get_memory_info("GPU:0")``), in bytes
above what is in use before the step, the median of :data:`PEAK_RUNS` runs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Sequence

import tensorflow as tf

from memsave_grads import api
from memsave_grads import measure as measure_lib
from memsave_grads import _child as child
from memsave_grads import _tables as tables
from memsave_grads.bench.models import PEAK_RUNS
from memsave_grads.bench.models import XlaSpec
from memsave_grads.patching import original_gradients

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)


@dataclasses.dataclass
class BlockModel:
    """A forward pass as ``head(blocks(stem()))``; ``variables`` are the trainable ones."""

    variables: list
    stem: Callable[[], tf.Tensor]
    blocks: list
    head: Callable[[tf.Tensor], tf.Tensor]


def _weight(shape, seed: int, stddev: float) -> tf.Variable:
    return tf.Variable(tf.random.stateless_normal(shape, seed=[seed, 1], stddev=stddev))


def _data(shape, seed: int) -> tf.Tensor:
    return tf.random.stateless_normal(shape, seed=[seed, 0])


def mlp(depth: int, width: int, batch: int, residual: bool, seed: int = 0) -> BlockModel:
    """The benchmark's MLPs (``bench.graphs.mlp``): ``h + tanh(h @ W)`` or ``tanh(h @ W)``."""
    stddev = (0.5 if residual else 1.0) / math.sqrt(width)
    weights = [_weight([width, width], seed + 1 + i, stddev) for i in range(depth)]
    inputs = _data([batch, width], seed)

    def block(w):
        def apply(h):
            out = tf.tanh(tf.matmul(h, w))
            return h + out if residual else out
        return apply

    return BlockModel(weights, lambda: inputs, [block(w) for w in weights],
                      lambda h: tf.reduce_mean(tf.square(h)))


def conv_resnet(blocks: int = 16, batch: int = 32, image: int = 32,
                channels: Sequence[int] = (32, 64), classes: int = 10,
                seed: int = 0) -> BlockModel:
    """The benchmark's conv ResNet (``bench.graphs.conv_resnet``) as blocks."""
    counter = iter(range(seed + 1, seed + 10_000))
    variables = []

    def conv_weight(k, cin, cout):
        w = _weight([k, k, cin, cout], next(counter), math.sqrt(2.0 / (k * k * cin)))
        variables.append(w)
        return w

    def bn_weights(c):
        gamma, beta = tf.Variable(tf.ones([c])), tf.Variable(tf.zeros([c]))
        variables.extend([gamma, beta])
        return gamma, beta

    def batch_norm(x, gamma_beta):
        mean, variance = tf.nn.moments(x, axes=[0, 1, 2])
        return tf.nn.batch_normalization(x, mean, variance, gamma_beta[1], gamma_beta[0], 1e-5)

    def block(cin, cout, stride):
        w1, bn1 = conv_weight(3, cin, cout), bn_weights(cout)
        w2, bn2 = conv_weight(3, cout, cout), bn_weights(cout)
        projection = None
        if stride != 1 or cin != cout:
            projection = conv_weight(1, cin, cout), bn_weights(cout)

        def apply(h):
            y = tf.nn.relu(batch_norm(tf.nn.conv2d(h, w1, stride, "SAME"), bn1))
            y = batch_norm(tf.nn.conv2d(y, w2, 1, "SAME"), bn2)
            shortcut = h
            if projection is not None:
                shortcut = batch_norm(tf.nn.conv2d(h, projection[0], stride, "SAME"),
                                      projection[1])
            return tf.nn.relu(y + shortcut)
        return apply

    images = _data([batch, image, image, 3], seed)
    labels = tf.random.stateless_uniform([batch], seed=[seed, 2], maxval=classes,
                                         dtype=tf.int32)
    stem_w, stem_bn = conv_weight(3, 3, channels[0]), bn_weights(channels[0])
    per_stage = [blocks // len(channels) + (1 if s < blocks % len(channels) else 0)
                 for s in range(len(channels))]
    block_fns, cin = [], channels[0]
    for stage, (cout, count) in enumerate(zip(channels, per_stage)):
        for j in range(count):
            block_fns.append(block(cin, cout, 2 if stage > 0 and j == 0 else 1))
            cin = cout
    dense = _weight([cin, classes], next(counter), 1.0 / math.sqrt(cin))
    variables.append(dense)

    def head(h):
        logits = tf.matmul(tf.reduce_mean(h, axis=[1, 2]), dense)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))

    return BlockModel(variables,
                      lambda: tf.nn.relu(batch_norm(tf.nn.conv2d(images, stem_w, 1, "SAME"),
                                                    stem_bn)),
                      block_fns, head)


def transformer(layers_count: int = 8, batch: int = 8, sequence: int = 256, d_model: int = 256,
                heads: int = 8, mlp_ratio: int = 4, classes: int = 10,
                seed: int = 0) -> BlockModel:
    """A pre-norm Transformer encoder stack from raw ops (the shape of the benchmark's Keras
    one: multi-head self-attention, LayerNorm, GELU MLP), mean-pooled into a softmax loss."""
    counter = iter(range(seed + 1, seed + 10_000))
    variables = []

    def weight(shape):
        w = _weight(shape, next(counter), 1.0 / math.sqrt(shape[0]))
        variables.append(w)
        return w

    def layer_norm(x, scale):
        mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
        return (x - mean) * tf.math.rsqrt(variance + 1e-6) * scale

    def block():
        qkv, out = weight([d_model, 3 * d_model]), weight([d_model, d_model])
        up, down = weight([d_model, mlp_ratio * d_model]), weight([mlp_ratio * d_model, d_model])
        ln1, ln2 = tf.Variable(tf.ones([d_model])), tf.Variable(tf.ones([d_model]))
        variables.extend([ln1, ln2])
        head_dim = d_model // heads

        def apply(h):
            q, k, v = tf.split(tf.einsum("bsd,de->bse", layer_norm(h, ln1), qkv), 3, axis=-1)
            split = lambda t: tf.reshape(t, [batch, sequence, heads, head_dim])  # noqa: E731
            scores = tf.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / math.sqrt(head_dim)
            attended = tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(scores), split(v))
            h = h + tf.einsum("bsd,de->bse", tf.reshape(attended, [batch, sequence, d_model]),
                              out)
            mlp = tf.nn.gelu(tf.einsum("bsd,de->bse", layer_norm(h, ln2), up))
            return h + tf.einsum("bsd,de->bse", mlp, down)
        return apply

    tokens = _data([batch, sequence, d_model], seed)
    labels = tf.random.stateless_uniform([batch], seed=[seed, 2], maxval=classes,
                                         dtype=tf.int32)
    block_fns = [block() for _ in range(layers_count)]
    classifier = weight([d_model, classes])

    def head(h):
        logits = tf.matmul(tf.reduce_mean(h, axis=1), classifier)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))

    return BlockModel(variables, lambda: tokens, block_fns, head)


# --------------------------------------------------------------------------------------------
# Methods and measurement
# --------------------------------------------------------------------------------------------

#: The four ways, by label; the first is the reference.
METHODS = ("tf.gradients", "memsave_grads 'memory'", "tf.recompute_grad", "keras.RematScope")
PLAIN, MEMORY, RECOMPUTE_GRAD, REMAT_SCOPE = METHODS


def group_size(blocks: int) -> int:
    """Blocks per ``tf.recompute_grad`` group: ~sqrt(n), Chen et al.'s choice for a chain."""
    return max(1, round(math.sqrt(blocks)))


def remat_scope_blocks(model: BlockModel) -> list:
    """Each block as a Keras 3 layer created inside ``keras.RematScope(mode="full")``; calling
    one wraps the block in ``tf.recompute_grad`` (Keras' remat on TensorFlow). The layer's
    ``call`` takes no ``training=`` argument, which is what lets the remat run in a traced step
    (docs: DESIGN.md fact 19). Built eagerly, once, like the variables."""
    import keras  # pylint: disable=import-outside-toplevel  # Keras 3, only for this method

    class Block(keras.layers.Layer):
        def __init__(self, fn, **kwargs):
            super().__init__(**kwargs)
            self.fn = fn

        def call(self, h):  # no training=: see the docstring
            return self.fn(h)

    with keras.RematScope(mode="full"):
        return [Block(fn, name=f"block_{i}") for i, fn in enumerate(model.blocks)]


def _loss_and_grads(model: BlockModel, method: str, layers: Sequence | None = None):
    """(loss, gradients of the variables) of one forward pass by ``method``; ``layers``: the
    blocks as RematScope layers (:func:`remat_scope_blocks`), for that method."""
    if method == REMAT_SCOPE:
        with tf.GradientTape() as tape:
            h = model.stem()
            for layer in layers:
                h = layer(h)
            loss = model.head(h)
        return loss, tape.gradient(loss, model.variables)
    if method == RECOMPUTE_GRAD:
        k = group_size(len(model.blocks))
        with tf.GradientTape() as tape:
            h = model.stem()
            for i in range(0, len(model.blocks), k):
                def group(x, fns=tuple(model.blocks[i:i + k])):
                    for fn in fns:
                        x = fn(x)
                    return x
                h = tf.recompute_grad(group)(h)
            loss = model.head(h)
        return loss, tape.gradient(loss, model.variables)
    h = model.stem()
    for fn in model.blocks:
        h = fn(h)
    loss = model.head(h)
    if method == PLAIN:
        return loss, original_gradients(loss, model.variables)
    return loss, api.gradients(loss, model.variables, checkpoints="memory", fallback="error")


@dataclasses.dataclass
class XlaResult:
    """One (model, method, jit_compile) measurement; ``median_seconds`` from the timing run
    of its compilation, where every method's step ran in turns."""

    model: str
    method: str
    jit_compile: bool
    peak_bytes: int | None = None
    median_seconds: float | None = None
    max_rel_error: float | None = None
    failed: str | None = None


def _max_rel_error(grads, reference) -> float:
    worst = 0.0
    for g, r in zip(grads, reference):
        scale = float(tf.reduce_max(tf.abs(r)))
        worst = max(worst, float(tf.reduce_max(tf.abs(g - r))) / (scale or 1.0))
    return worst


def measure_model(spec: XlaSpec, repeats: int = 3,
                  methods: Sequence[str] = METHODS) -> list[XlaResult]:
    """``methods`` (the first is the reference), without and with ``jit_compile``: each
    method's peak and error in its own process (:func:`measure`), then each compilation's
    step times in one process, in turns (:func:`measure_times`)."""
    results = []
    for jit in (False, True):
        row = [measure(spec, method, jit) for method in methods]
        timed = [r.method for r in row if not r.failed]
        seconds = measure_times(spec, timed, jit, repeats) if timed else {}
        for r in row:
            r.median_seconds = seconds.get(r.method)
        results += row
    return results


def _failed(result: XlaResult, outcome: child.ChildRun, what: str) -> None:
    result.failed = outcome.last_error_line()
    _LOG.error("%s / %s / jit_compile=%s: %s failed:\n%s", result.model, result.method,
               result.jit_compile, what, outcome.stderr[-3000:])


def measure(spec: XlaSpec, method: str, jit_compile: bool) -> XlaResult:
    """One (model, method, compilation) in a fresh process: the gradients' error against
    tf.gradients' under the same compilation (before any update), then the median peak of a
    training step (gradients + SGD update)."""
    request = {"function": spec.function, "kwargs": spec.kwargs, "methods": [method],
               "jit_compile": jit_compile, "measure": "peak"}
    outcome = child.run(__name__, request)
    result = XlaResult(spec.name, method, jit_compile)
    if outcome.returncode != 0 or outcome.result is None:
        _failed(result, outcome, "the peak")
        return result
    result.peak_bytes = outcome.result["peak_bytes"]
    result.max_rel_error = outcome.result["max_rel_error"]
    _LOG.info("%s / %s / jit_compile=%s: peak %s MiB, max rel grad err %s", spec.name,
              method, jit_compile, _mib(result.peak_bytes), result.max_rel_error)
    return result


def measure_times(spec: XlaSpec, methods: Sequence[str], jit_compile: bool,
                  repeats: int = 3) -> dict[str, float]:
    """The median step time of each of ``methods`` under one compilation, in one fresh
    process, their steps timed in turns; {} where that process failed."""
    request = {"function": spec.function, "kwargs": spec.kwargs, "methods": list(methods),
               "jit_compile": jit_compile, "measure": "time", "repeats": repeats}
    outcome = child.run(__name__, request)
    if outcome.returncode != 0 or outcome.result is None:
        _LOG.error("%s / jit_compile=%s: timing failed:\n%s", spec.name, jit_compile,
                   outcome.stderr[-3000:])
        return {}
    _LOG.info("%s / jit_compile=%s: median step ms %s", spec.name, jit_compile,
              {m: _ms(s) for m, s in outcome.result.items()})
    return outcome.result


def _training_step(model: BlockModel, method: str, jit: bool, learning_rate: float):
    """A compiled training step of ``method`` (gradients + SGD update), run to completion."""
    layers = remat_scope_blocks(model) if method == REMAT_SCOPE else None

    @tf.function(jit_compile=jit)
    def step():
        loss, grads = _loss_and_grads(model, method, layers)
        for v, g in zip(model.variables, grads):
            v.assign_sub(learning_rate * g)
        return loss

    return lambda: step().numpy()  # waits for the device (GPU kernels run asynchronously)


def _measure_here(request: dict, learning_rate: float = 1e-4) -> dict:
    """The child's side of :func:`measure` and :func:`measure_times`."""
    if measure_lib.default_device() == "CPU:0":
        measure_lib.reserve_cpu_heap()
    model = globals()[request["function"]](**request["kwargs"])
    methods, jit = request["methods"], request["jit_compile"]
    if request["measure"] == "time":
        steps = [_training_step(model, method, jit, learning_rate) for method in methods]
        seconds = measure_lib.interleaved_median_seconds(steps, repeats=request["repeats"])
        return dict(zip(methods, seconds))
    (method,) = methods
    out = {"max_rel_error": 0.0}
    if method != PLAIN:
        def gradients_of(way):
            layers = remat_scope_blocks(model) if way == REMAT_SCOPE else None
            return tf.function(lambda: _loss_and_grads(model, way, layers)[1],
                               jit_compile=jit)()
        reference = gradients_of(PLAIN)
        out["max_rel_error"] = _max_rel_error(gradients_of(method), reference)
        del reference
    run_step = _training_step(model, method, jit, learning_rate)
    run_step()  # compiled and warmed up before the peak is read
    peaks = sorted(measure_lib.peak_bytes_of(run_step)[0] for _ in range(PEAK_RUNS))
    out["peak_bytes"] = peaks[len(peaks) // 2]
    return out


def _mib(value: int | None) -> str:
    return "-" if value is None else tables.number(value / measure_lib.MIB)


def _ms(value: float | None) -> str:
    return "-" if value is None else tables.number(value * 1e3)


def _ratio(numerator, denominator) -> str:
    if not numerator or not denominator:
        return "-"
    return f"{numerator / denominator:.2f}x"


def table(results_per_model: Sequence[Sequence[XlaResult]]) -> str:
    """One row per (model, method): without XLA and with it, side by side."""
    rows = []
    for results in results_per_model:
        by_key = {(r.method, r.jit_compile): r for r in results}
        methods = list(dict.fromkeys(r.method for r in results))
        for method in methods:
            cells = [results[0].model, method]
            for jit in (False, True):
                r, ref = by_key[(method, jit)], by_key[(methods[0], jit)]
                if r.failed:
                    cells += ["failed", "-", "-", "-", r.failed[:40]]
                    continue
                cells += [_mib(r.peak_bytes), _ratio(ref.peak_bytes, r.peak_bytes),
                          _ms(r.median_seconds), _ratio(r.median_seconds, ref.median_seconds),
                          "-" if r.max_rel_error is None else f"{r.max_rel_error:.1e}"]
            rows.append(cells)
    header = ["model", "method"]
    for label in ("", " XLA"):
        header += [f"peak MiB{label}", f"peak ratio{label}", f"step ms{label}",
                   f"time ratio{label}", f"grad err{label}"]
    return tables.markdown_table(header, "ll" + "rrrrr" * 2, rows)


TABLE_NOTES = (
    "One training step (gradients + SGD update) in tf.function, without XLA and with "
    "jit_compile=True. peak MiB: allocator peak of the step above the memory in use before it "
    "(median of several runs, each method in a fresh process). peak ratio: tf.gradients' peak "
    "over this one, under the same compilation. step ms, time ratio: median step time, and its "
    "ratio to tf.gradients', every method of one compilation timed in turns in one process. "
    "grad err: max over variables of max|g - g_tf| / max|g_tf| against tf.gradients under the "
    "same compilation. tf.recompute_grad wraps groups of ~sqrt(n) blocks (Chen et al.'s "
    "spacing); keras.RematScope(mode='full') wraps every block (a Keras 3 layer whose call "
    "takes no training= argument) in tf.recompute_grad.")


if __name__ == "__main__":
    child.serve(_measure_here)
