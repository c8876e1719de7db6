"""The benchmark under XLA: one training step in ``tf.function``, with and without
``jit_compile``, three ways: tf.gradients, memsave_grads ``"memory"``, and the peer a
TensorFlow user would pick, ``tf.recompute_grad`` around every ``k ~ sqrt(n)`` blocks.

The models are built as *blocks* (``h -> h``) between a stem and a head, so that
``tf.recompute_grad`` can wrap groups of them; the variables and inputs are created eagerly,
once, and every step function reads them.

Each (model, method, compilation) is measured in a fresh process (:func:`measure`, which runs
this module as a script). XLA allocates a step's temporaries as one buffer, and the BFC
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
from memsave_grads.bench.harness import PEAK_RUNS
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

#: The three ways, by label; the first is the reference.
METHODS = ("tf.gradients", "memsave_grads 'memory'", "tf.recompute_grad")


def group_size(blocks: int) -> int:
    """Blocks per ``tf.recompute_grad`` group: ~sqrt(n), Chen et al.'s choice for a chain."""
    return max(1, round(math.sqrt(blocks)))


def _loss_and_grads(model: BlockModel, method: str):
    if method == METHODS[2]:
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
    if method == METHODS[0]:
        return loss, original_gradients(loss, model.variables)
    return loss, api.gradients(loss, model.variables, checkpoints="memory", fallback="error")


@dataclasses.dataclass
class XlaResult:
    """One (model, method, jit_compile) measurement."""

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


def measure_model(spec: XlaSpec, repeats: int = 3) -> list[XlaResult]:
    """Every method of :data:`METHODS`, without and with ``jit_compile``, each in its own
    process (:func:`measure`)."""
    return [measure(spec, method, jit, repeats) for jit in (False, True) for method in METHODS]


def measure(spec: XlaSpec, method: str, jit_compile: bool, repeats: int = 3) -> XlaResult:
    """One (model, method, compilation) in a fresh process: the gradients' error against
    tf.gradients' under the same compilation (before any update), then a training step
    (gradients + SGD update): the median time of ``repeats`` steps and the median peak."""
    request = {"function": spec.function, "kwargs": spec.kwargs, "method": method,
               "jit_compile": jit_compile, "repeats": repeats}
    outcome = child.run(__name__, request)
    result = XlaResult(spec.name, method, jit_compile)
    if outcome.returncode != 0 or outcome.result is None:
        result.failed = outcome.last_error_line()
        _LOG.error("%s / %s / jit_compile=%s failed:\n%s", spec.name, method, jit_compile,
                   outcome.stderr[-3000:])
        return result
    for key, value in outcome.result.items():
        setattr(result, key, value)
    _LOG.info("%s / %s / jit_compile=%s: peak %s MiB, median step %s ms, max rel grad err "
              "%s", spec.name, method, jit_compile, _mib(result.peak_bytes),
              _ms(result.median_seconds), result.max_rel_error)
    return result


def _measure_here(request: dict, learning_rate: float = 1e-4) -> dict:
    """The child's side of :func:`measure`."""
    if measure_lib.default_device() == "CPU:0":
        measure_lib.reserve_cpu_heap()
    model = globals()[request["function"]](**request["kwargs"])
    method, jit = request["method"], request["jit_compile"]
    out = {}
    reference = tf.function(lambda: _loss_and_grads(model, METHODS[0])[1], jit_compile=jit)()
    if method != METHODS[0]:
        grads = tf.function(lambda: _loss_and_grads(model, method)[1], jit_compile=jit)()
        out["max_rel_error"] = _max_rel_error(grads, reference)
        del grads
    else:
        out["max_rel_error"] = 0.0
    del reference

    @tf.function(jit_compile=jit)
    def step():
        loss, grads = _loss_and_grads(model, method)
        for v, g in zip(model.variables, grads):
            v.assign_sub(learning_rate * g)
        return loss

    def run_step():
        return step().numpy()  # waits for the device (GPU kernels run asynchronously)

    out["median_seconds"] = measure_lib.median_seconds(run_step, repeats=request["repeats"])
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
        for method in METHODS:
            cells = [results[0].model, method]
            for jit in (False, True):
                r, ref = by_key[(method, jit)], by_key[(METHODS[0], jit)]
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
    "(median of several runs). peak ratio: tf.gradients' peak over this one, under the same "
    "compilation. time ratio: median step time over tf.gradients'. grad err: max over variables "
    "of max|g - g_tf| / max|g_tf| against tf.gradients under the same compilation. "
    "tf.recompute_grad wraps groups of ~sqrt(n) blocks (Chen et al.'s spacing).")


if __name__ == "__main__":
    child.serve(_measure_here)
