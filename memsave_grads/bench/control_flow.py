"""The control-flow benchmark: the same residual blocks, written six ways (plain, a ``tf.cond``
per block, the same with dropout in the training branch, a nested ``tf.function`` per block,
one calling another per block, one ``tf.while_loop`` over stacked weights), trained one SGD
step in a ``tf.function``, without and with ``jit_compile``, with ``tf.gradients`` and with
memsave_grads ``"memory"`` (``memsave-grads benchmark --control-flow only``;
docs/benchmarks.md, "Control flow and calls").

Every (forward pass, method) is measured in a fresh process (:func:`measure`, which runs this
module as a script): the executor's order and the allocator's history move a step's peak, and
a process that ran another step before measured up to 1.5x more (``bench.xla``). Peaks are the
CPU BFC allocator's, in bytes above what is in use before the step (the weights and the input
are resident), over :data:`PEAK_RUNS` steps after one warm-up step. The gradient error compares
the two methods' gradients after those steps, each traced on its own (dropout seeded per block:
the same draws).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from typing import Sequence

import tensorflow as tf

from memsave_grads import _explain as explain_lib
from memsave_grads import api
from memsave_grads import _child as child
from memsave_grads import _tables as tables
from memsave_grads import measure as measure_lib
from memsave_grads.bench.models import PEAK_RUNS
from memsave_grads.patching import original_gradients

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

#: The forward passes, in table order: (key, label).
FORWARDS = (
    ("plain", "plain blocks"),
    ("cond", "each block's branch inside tf.cond(training, ...)"),
    ("cond_dropout", "the same, with dropout in the training branch"),
    ("function", "each block a nested tf.function"),
    ("function_of_function", "each block a tf.function calling another (a layer, a sublayer)"),
    ("while", "the blocks in one tf.while_loop over stacked weights"),
    ("range", "the same as AutoGraph writes it: for i in tf.range(depth)"),
)
#: The residual branch's scale at inference in the cond rows (stochastic depth's survival
#: probability).
SURVIVAL_PROBABILITY = 0.9
#: The methods: (key, label); the first is the reference.
METHODS = (("tf.gradients", "tf.gradients"), ("memory", "memsave_grads 'memory'"))
#: The dropout rate of the cond row's training branch.
DROPOUT_RATE = 0.1


@dataclasses.dataclass(frozen=True)
class Shape:
    """The blocks: ``h = h + tanh(h @ W_i)``, ``depth`` of them, ``width`` units, ``batch``
    examples."""

    depth: int = 32
    width: int = 512
    batch: int = 2048

    @property
    def activation_mib(self) -> float:
        return self.batch * self.width * 4 / measure_lib.MIB


def _block(h, w):
    return h + tf.tanh(tf.matmul(h, w))


def _range_blocks(h, stacked, depth):
    """The blocks over stacked weights as a TF2 user writes them in a ``tf.function``
    (AutoGraph turns the loop into a while op that captures the range's limit and step)."""
    for i in tf.range(depth):
        h = _block(h, tf.gather(stacked, i))
    return h


class Model:
    """Eager weights and input, and the forward pass of one row (built while tracing)."""

    def __init__(self, forward: str, shape: Shape, seed: int = 0):
        self.forward_kind = forward
        self.shape = shape
        stddev = 0.5 / math.sqrt(shape.width)
        initial = [tf.random.stateless_normal([shape.width, shape.width], seed=[seed + 1 + i, 1],
                                              stddev=stddev) for i in range(shape.depth)]
        self.inputs = tf.random.stateless_normal([shape.batch, shape.width], seed=[seed, 0])
        if forward in ("while", "range"):
            self.variables = [tf.Variable(tf.stack(initial), name="stacked_weights")]
        else:
            self.variables = [tf.Variable(w, name=f"w{i}") for i, w in enumerate(initial)]
        # One tf.function per block, made once: the nested function row calls each in the step.
        self.block_functions = [tf.function(lambda h, w=w: _block(h, w), autograph=False)
                                for w in self.variables] if forward == "function" else []
        if forward == "function_of_function":
            inner = [tf.function(lambda h, w=w: tf.tanh(tf.matmul(h, w)), autograph=False)
                     for w in self.variables]
            self.block_functions = [tf.function(lambda h, f=f: h + f(h), autograph=False)
                                    for f in inner]

    def loss(self, training: tf.Tensor) -> tf.Tensor:
        h = self.inputs
        if self.forward_kind == "plain":
            for w in self.variables:
                h = _block(h, w)
        elif self.forward_kind == "cond":
            # Stochastic depth's shape: the residual branch, scaled at inference.
            for w in self.variables:
                h = h + tf.cond(training, lambda h=h, w=w: tf.tanh(tf.matmul(h, w)),
                                lambda h=h, w=w: SURVIVAL_PROBABILITY * tf.tanh(tf.matmul(h, w)))
        elif self.forward_kind == "cond_dropout":
            for i, w in enumerate(self.variables):
                # Seeded: the reference's step and ours draw the same masks (gradient error).
                h = h + tf.cond(
                    training,
                    lambda h=h, w=w, i=i: tf.nn.dropout(tf.tanh(tf.matmul(h, w)), DROPOUT_RATE,
                                                        seed=i + 1),
                    lambda h=h, w=w: tf.tanh(tf.matmul(h, w)))
        elif self.forward_kind in ("function", "function_of_function"):
            for block in self.block_functions:
                h = block(h)
        elif self.forward_kind == "while":
            stacked = self.variables[0]

            def body(i, h):
                return i + 1, _block(h, tf.gather(stacked, i))

            # The bound: XLA sizes the gradient's accumulators by it (it compiles no loop
            # without one).
            _, h = tf.while_loop(lambda i, h: i < self.shape.depth, body,
                                 [tf.constant(0), h], maximum_iterations=self.shape.depth)
        elif self.forward_kind == "range":
            # Converted here: the steps that trace this may switch AutoGraph off.
            h = tf.autograph.to_graph(_range_blocks)(h, self.variables[0], self.shape.depth)
        else:
            raise ValueError(f"unknown forward pass {self.forward_kind!r}")
        return tf.reduce_mean(tf.square(h))

    def gradients(self, loss: tf.Tensor, method: str) -> list:
        if method == METHODS[0][0]:
            return original_gradients(loss, self.variables)
        return api.gradients(loss, self.variables, checkpoints=method)


@dataclasses.dataclass
class Result:
    """One (forward pass, method) measurement."""

    forward: str
    method: str
    jit_compile: bool = False
    peak_bytes: list | None = None
    predicted_plan_bytes: int | None = None
    predicted_plain_bytes: int | None = None
    rewrite: bool | None = None
    max_rel_error: float | None = None
    failed: str | None = None

    @property
    def median_peak_bytes(self) -> int | None:
        if not self.peak_bytes:
            return None
        ordered = sorted(self.peak_bytes)
        return ordered[len(ordered) // 2]


def measure(forward: str, method: str, shape: Shape = Shape(),
            jit_compile: bool = False) -> Result:
    """One cell in a fresh process; the step compiled by XLA where ``jit_compile``."""
    request = {"forward": forward, "method": method, "shape": dataclasses.asdict(shape),
               "jit_compile": jit_compile}
    outcome = child.run(__name__, request)
    result = Result(forward, method, jit_compile)
    if outcome.returncode != 0 or outcome.result is None:
        result.failed = outcome.last_error_line()
        _LOG.error("%s / %s failed:\n%s", forward, method, outcome.stderr[-3000:])
        return result
    for key, value in outcome.result.items():
        setattr(result, key, value)
    _LOG.info("%s / %s%s: peaks %s MiB", forward, method, " / XLA" if jit_compile else "",
              [round(p / measure_lib.MIB, 1) for p in result.peak_bytes])
    return result


def measure_all(shape: Shape = Shape(), forwards: Sequence[str] | None = None,
                jit_compile: Sequence[bool] = (False, True)) -> list[Result]:
    """Every (forward pass, without and with XLA, method), each in its own process."""
    keys = [key for key, _ in FORWARDS if forwards is None or key in forwards]
    return [measure(forward, method, shape, jit) for forward in keys for jit in jit_compile
            for method, _ in METHODS]


def _max_rel_error(grads, reference) -> float:
    worst = 0.0
    for g, r in zip(grads, reference):
        g, r = tf.convert_to_tensor(g), tf.convert_to_tensor(r)
        scale = float(tf.reduce_max(tf.abs(r)))
        worst = max(worst, float(tf.reduce_max(tf.abs(g - r))) / (scale or 1.0))
    return worst


def _measure_here(request: dict, learning_rate: float = 1e-4) -> dict:
    """The child's side of :func:`measure`."""
    measure_lib.reserve_cpu_heap()
    tf.random.set_seed(0)
    shape = Shape(**request["shape"])
    model = Model(request["forward"], shape)
    method = request["method"]
    jit_compile = bool(request.get("jit_compile"))
    training = tf.constant(True)
    out: dict = {}
    signature = [tf.TensorSpec([], tf.bool)]

    @tf.function(input_signature=signature, autograph=False, jit_compile=jit_compile)
    def step(training):
        loss = model.loss(training)
        if method != METHODS[0][0]:
            report = explain_lib.explain(loss, model.variables, checkpoints=method)
            out["predicted_plan_bytes"] = report.predicted_peak_bytes
            out["predicted_plain_bytes"] = report.predicted_plain_peak_bytes
            out["rewrite"] = report.rewrite
        for v, g in zip(model.variables, model.gradients(loss, method)):
            v.assign_sub(learning_rate * g)
        return loss

    def run_step():
        return step(training).numpy()

    run_step()  # warm-up: one-time allocations are not the step's
    out["peak_bytes"] = [measure_lib.peak_bytes_of(run_step)[0] for _ in range(PEAK_RUNS)]
    if method != METHODS[0][0] and jit_compile:
        # One forward pass for both: XLA draws seeded random numbers afresh in each compiled
        # function (dropout seeded alike differed by 11 in a check). Ours first: tf.gradients'
        # rewrite of the conds and calls would leave nothing to replay.
        @tf.function(input_signature=signature, autograph=False, jit_compile=True)
        def both_gradients(training):
            loss = model.loss(training)
            ours = model.gradients(loss, method)
            return ours, model.gradients(loss, METHODS[0][0])

        ours, reference = both_gradients(training)
        out["max_rel_error"] = _max_rel_error(ours, reference)
        del ours, reference
    elif method != METHODS[0][0]:
        # Each in its own function, called once: the same seeded draws, and neither sees the
        # other's gradient ops (a gradient built first changes what the forward ops output).
        @tf.function(input_signature=signature, autograph=False)
        def reference_gradients(training):
            return model.gradients(model.loss(training), METHODS[0][0])

        @tf.function(input_signature=signature, autograph=False)
        def our_gradients(training):
            return model.gradients(model.loss(training), method)

        reference = reference_gradients(training)
        out["max_rel_error"] = _max_rel_error(our_gradients(training), reference)
        del reference
    else:
        out["max_rel_error"] = 0.0

    return out


def _mib(value: int | None) -> str:
    return "-" if value is None else tables.number(value / measure_lib.MIB)


def _range_mib(values: list | None) -> str:
    if not values:
        return "-"
    low, high = min(values) / measure_lib.MIB, max(values) / measure_lib.MIB
    if round(low) == round(high):
        return f"{high:.0f}"
    return f"{low:.0f}-{high:.0f}"


def table(results: Sequence[Result]) -> str:
    """One row per forward pass: tf.gradients' peak, "memory"'s peak, the ratio of the
    medians, the memory model's predictions for both, and the gradient error."""
    by_key = {(r.forward, r.jit_compile, r.method): r for r in results}
    rows = []
    for (forward, label), jit in itertools.product(FORWARDS, (False, True)):
        reference = by_key.get((forward, jit, METHODS[0][0]))
        ours = by_key.get((forward, jit, METHODS[1][0]))
        if reference is None or ours is None:
            continue
        cells = [label + (", jit_compile" if jit else "")]
        for r in (reference, ours):
            cells.append("failed: " + r.failed[:40] if r.failed else _range_mib(r.peak_bytes))
        plain_peak, our_peak = reference.median_peak_bytes, ours.median_peak_bytes
        cells.append(f"{plain_peak / our_peak:.2f}x" if plain_peak and our_peak else "-")
        cells.append(f"{_mib(ours.predicted_plan_bytes)} / {_mib(ours.predicted_plain_bytes)}")
        cells.append({True: "plan", False: "tf.gradients", None: "-"}[ours.rewrite])
        cells.append("-" if ours.max_rel_error is None else f"{ours.max_rel_error:.1e}")
        rows.append(cells)
    header = ["forward pass", "tf.gradients MiB", "'memory' MiB", "saving",
              "predicted MiB (plan / plain)", "runs", "grad err"]
    return tables.markdown_table(header, "lrrrrlr", rows)


TABLE_NOTES = (
    "One SGD step in tf.function of the same residual blocks (h = h + tanh(h @ W_i)), written "
    "six ways, each without and with jit_compile (XLA). MiB: the CPU BFC allocator's peak of "
    "the step above what is in use before it, "
    f"the range over {PEAK_RUNS} steps after a warm-up, one fresh process per cell. saving: "
    "tf.gradients' median over 'memory''s. predicted: the memory model's peak of the plan and "
    "of plain tf.gradients (explain()). runs: what 'memory' ran, its plan or tf.gradients (the "
    "never-worse rule). grad err: max over variables of max|g - g_tf| / max|g_tf| against "
    "tf.gradients' (first steps, before any update; dropout seeded: the same draws; under XLA, "
    "which draws afresh per compiled function, both gradients of one forward pass).")


if __name__ == "__main__":
    child.serve(_measure_here)
