"""Measurement machinery of the command line: one training step per method, then a table.

One :class:`~memsave_grads.bench.models.ModelSpec` builds a forward pass and a loss inside a
``tf.Graph``. For every :class:`Method`, :func:`measure_model` adds that method's gradients and
an SGD update of all trainable variables to the *same* graph, then measures in one
``tf.compat.v1.Session``:

* the gradient error of each method against ``tf.gradients``, all of them in one
  ``session.run`` (same inputs, before any update): ``max|a - b| / max|b|`` per variable, the
  largest over the variables;
* the peak memory of one training step (:func:`memsave_grads.measure.peak_bytes_of`), in bytes
  above what was in use before the step (variables and inputs are resident, so not counted);
* the median wall time of a training step, the methods timed in turns
  (:func:`memsave_grads.measure.interleaved_median_seconds`).

The models feed nothing: their inputs live in variables (:mod:`memsave_grads.bench.graphs`).

TensorFlow must be imported after ``TF_CPU_ALLOCATOR_USE_BFC=true`` is set for the peak memory
to be right on CPU; the command line (:mod:`memsave_grads.cli`) takes care of that. Nothing
here prints: progress goes to the ``memsave_grads`` logger, tables are returned as strings.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Sequence

import tensorflow as tf

from memsave_grads import api
from memsave_grads._tf import graph as tf_graph
from memsave_grads import errors
from memsave_grads import _explain as explain_lib
from memsave_grads import measure
from memsave_grads import _tables as tables
from memsave_grads.bench.models import PEAK_RUNS, ModelSpec
from memsave_grads.core import budgets
from memsave_grads.core import calibration as core_calibration
from memsave_grads.patching import original_gradients

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Methods
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Method:
    """One way to compute gradients: ``tf.gradients`` or a ``memsave_grads`` strategy."""

    label: str
    checkpoints: "str | budgets.Budget | None"  # None: plain tf.gradients (the reference)

    @property
    def is_reference(self) -> bool:
        return self.checkpoints is None

    def gradients(self, loss: tf.Tensor, variables: Sequence[tf.Variable]) -> list:
        if self.is_reference:  # the unpatched tf.gradients, even under memsave_grads.patch()
            return original_gradients(loss, list(variables))
        # "error": a strategy that does not apply is reported n/a, not measured as tf.gradients.
        return api.gradients(loss, list(variables), checkpoints=self.checkpoints,
                             fallback="error")


REFERENCE = Method("tf.gradients", None)
MEMORY = Method("memsave_grads 'memory'", "memory")
SPEED = Method("memsave_grads 'speed'", "speed")
#: The methods the command line compares; the reference comes first.
DEFAULT_METHODS = (REFERENCE, MEMORY, SPEED)
#: The demo's: the default strategy against tf.gradients ("speed" keeps matmul outputs, which
#: on the demo's MLP is everything tf.gradients keeps: it would run plain tf.gradients).
DEMO_METHODS = (REFERENCE, MEMORY)


def measure_build_seconds(spec: ModelSpec, checkpoints: str = "memory",
                          repeats: int = 3) -> tuple[float, float, int]:
    """Best-of-``repeats`` seconds to build plain tf.gradients and memsave_grads' gradients of
    ``spec`` (each in a fresh graph), and the forward ops between xs and ys."""
    def once(method):
        graph = tf.Graph()
        with graph.as_default():
            loss, variables = spec.build()
            start = time.perf_counter()
            method(loss, variables)
            return time.perf_counter() - start, len(graph.get_operations())
    plain = min(once(lambda l, v: original_gradients(l, list(v)))[0] for _ in range(repeats))
    ours = min(once(lambda l, v: api.gradients(l, list(v), checkpoints=checkpoints,
                                               fallback="error"))[0]
               for _ in range(repeats))
    graph = tf.Graph()
    with graph.as_default():
        spec.build()
        forward_ops = len(graph.get_operations())
    return plain, ours, forward_ops


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    """One row: a model trained with one method.

    ``skipped`` says why a strategy does not apply (n/a); ``failed`` names an unexpected error.
    ``rewritten``: whether memsave_grads rewrote the gradients (False: its never-worse rule
    handed them to plain tf.gradients, so the row measures tf.gradients again; None: the
    reference, or not built).
    """

    model: str
    method: Method
    graph_ops: int | None = None
    peak_bytes: int | None = None
    median_seconds: float | None = None
    max_rel_error: float | None = None
    build_seconds: float | None = None
    predicted_peak_bytes: int | None = None
    skipped: str | None = None
    failed: str | None = None
    rewritten: bool | None = None


def _reachable_ops(fetch: tf.Operation) -> int:
    """How many ops a run of ``fetch`` needs (data and control inputs, before grappler)."""
    return sum(1 for _ in tf_graph.walk([fetch], tf_graph.dependency_ops))


def _dense(grad):
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad


#: A gradient whose reference is this small next to the largest one is compared against that
#: floor: it is exactly zero in exact arithmetic (a key bias under softmax), and both sides hold
#: only rounding noise.
RELATIVE_ERROR_FLOOR = 1e-6


def _max_relative_error(grads: Sequence, reference: Sequence) -> tf.Tensor:
    """A scalar tensor: max over variables of ``max|a - b| / max(max|b|, floor)``, where the floor
    is :data:`RELATIVE_ERROR_FLOOR` times the largest ``max|b|`` of all variables (``inf`` if
    a is missing)."""
    pairs, missing = [], False
    for a, b in zip(grads, reference):
        if a is None and b is None:
            continue
        if a is None or b is None:
            missing = True
            continue
        a, b = _dense(a), _dense(b)
        pairs.append((tf.reduce_max(tf.abs(a - b)), tf.reduce_max(tf.abs(b))))
    if missing:
        return tf.constant(math.inf)
    if not pairs:
        return tf.constant(0.0)
    floor = RELATIVE_ERROR_FLOOR * tf.reduce_max(tf.stack([scale for _, scale in pairs]))
    ratios = [tf.where(tf.maximum(scale, floor) > 0, diff / tf.maximum(tf.maximum(scale, floor),
                                                                      1e-30), diff)
              for diff, scale in pairs]
    return tf.reduce_max(tf.stack(ratios))


def _short_reason(error: Exception, limit: int = 90) -> str:
    text = " ".join(str(error).split())
    first = text.split(". ")[0]
    return first if len(first) <= limit else first[:limit - 3] + "..."


#: A method that raises one of these is reported as n/a for that model, not as a failure.
_NOT_APPLICABLE = errors.FALLBACK_ERRORS + (errors.InfeasibleBudgetError,)


def measure_model(spec: ModelSpec, methods: Sequence[Method] = DEFAULT_METHODS,
                  repeats: int = 3, learning_rate: float = 1e-4) -> list[Result]:
    """Build ``spec`` once, add each method's training step, and measure them all.

    All steps live in one graph and one session (see the module docstring). The gradient
    errors are read first, in one run, before any update; then each step is run once to warm
    up and ``repeats`` times in turns with the others for the median time, and :data:`PEAK_RUNS`
    more times for the median peak memory.

    The first method is the reference for gradient errors (normally ``tf.gradients``). A method
    whose strategy raises one of :data:`_NOT_APPLICABLE` (for instance an infeasible budget, or
    ``NoCheckpointsFoundError``) is reported with ``skipped`` set instead of failing.
    """
    graph = tf.Graph()
    results = [Result(spec.name, m) for m in methods]
    steps: dict[int, tf.Operation] = {}
    grads_of: dict[int, list] = {}
    with graph.as_default():
        loss, variables = spec.build()
        for i, (method, result) in enumerate(zip(methods, results)):
            result.predicted_peak_bytes = _predicted_peak(method, loss, variables)
            start = time.perf_counter()
            ops_before = len(graph.get_operations())
            try:
                grads = method.gradients(loss, variables)
            except _NOT_APPLICABLE as e:  # nothing to gain, cannot rewrite, or budget too small
                result.skipped = _short_reason(e)
                _LOG.info("%s / %s: n/a (%s)", spec.name, method.label, e)
                continue
            optimizer = tf.compat.v1.train.GradientDescentOptimizer(learning_rate)
            steps[i] = optimizer.apply_gradients(
                [(g, v) for g, v in zip(grads, variables) if g is not None],
                name=f"train_step_{i}")
            grads_of[i] = grads
            result.build_seconds = time.perf_counter() - start
            if not method.is_reference:  # the rewrite names its ops under "<scope>_memsave"
                result.rewritten = any("_memsave" in op.name
                                       for op in graph.get_operations()[ops_before:])
            result.graph_ops = _reachable_ops(steps[i])
        errors_of = {}
        if 0 in grads_of:
            with tf.name_scope("grad_errors"):
                errors_of = {i: _max_relative_error(g, grads_of[0])
                             for i, g in grads_of.items() if i != 0}
        init = tf.compat.v1.global_variables_initializer()
    graph.finalize()

    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        if errors_of:
            values = session.run(errors_of)  # one run: same inputs, before any update
            for i, value in values.items():
                results[i].max_rel_error = float(value)
        if 0 in grads_of:
            results[0].max_rel_error = 0.0
        runners = {i: functools.partial(session.run, step) for i, step in steps.items()}
        # In turns, so that the time ratios do not move with the machine's load.
        for i, seconds in zip(runners, measure.interleaved_median_seconds(
                list(runners.values()), repeats=repeats, warmup=1)):
            results[i].median_seconds = seconds
        for i, run_step in runners.items():
            # The executor's order varies from run to run, and so does the peak (by up to
            # 10% on these networks): report the median of a few runs' peaks.
            peaks = sorted(measure.peak_bytes_of(run_step)[0] for _ in range(PEAK_RUNS))
            results[i].peak_bytes = peaks[len(peaks) // 2]
            _LOG.info("%s / %s: %d ops, peak %s MiB, median step %s ms, "
                      "max rel grad err %s (gradients built in %.1f s)",
                      spec.name, methods[i].label, results[i].graph_ops,
                      tables.number(results[i].peak_bytes / measure.MIB),
                      tables.number(results[i].median_seconds * 1e3),
                      _format_error(results[i].max_rel_error), results[i].build_seconds)
    return results


def _predicted_peak(method: Method, loss, variables) -> int | None:
    """The static memory model's peak for ``method`` (None if its strategy does not apply)."""
    if method.is_reference:
        return explain_lib.predicted_plain_peak_bytes(loss, list(variables))
    try:
        return explain_lib.explain(loss, list(variables),
                                   checkpoints=method.checkpoints).predicted_peak_bytes
    except _NOT_APPLICABLE:
        return None


def failed_results(spec: ModelSpec, methods: Sequence[Method], error: Exception) -> list[Result]:
    """Rows for a model whose measurement raised ``error`` (so a benchmark can go on)."""
    reason = f"{type(error).__name__}: {_short_reason(error, limit=60)}"
    return [Result(spec.name, m, failed=reason) for m in methods]


# --------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------


def _format_error(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value:.1e}"


def format_peak_ratio(reference_bytes: int | None, bytes_: int | None) -> str:
    """``"4.10x less"`` (or ``"1.20x more"``): the reference's peak over this peak."""
    if not reference_bytes or bytes_ is None:
        return "-"
    if bytes_ <= 0:
        return "inf"
    ratio = reference_bytes / bytes_
    if abs(ratio - 1) < 0.005:
        return "1.00x"
    return f"{ratio:.2f}x less" if ratio > 1 else f"{1 / ratio:.2f}x more"


def format_prediction(result: Result) -> str:
    """``"88.0 (-3%)"``: the predicted peak in MiB and its error relative to the measured one."""
    if result.predicted_peak_bytes is None or not result.peak_bytes:
        return "-"
    error = (result.predicted_peak_bytes - result.peak_bytes) / result.peak_bytes
    return f"{tables.number(result.predicted_peak_bytes / measure.MIB)} ({error:+.0%})"


def format_time_ratio(reference_s: float | None, seconds: float | None) -> str:
    """``"1.30x"``: this step time over the reference's."""
    if not reference_s or seconds is None:
        return "-"
    return f"{seconds / reference_s:.2f}x"


def _cells(result: Result, reference: Result) -> list[str]:
    if result.skipped is not None:
        reason = result.skipped.replace("|", "/")
        return [f"n/a ({reason})", "-", "-", "-", "-", "-"]
    if result.failed is not None:
        reason = result.failed.replace("|", "/")
        return [f"error ({reason})", "-", "-", "-", "-", "-"]
    # A row that ran plain tf.gradients again differs from the reference's by noise alone.
    plain_again = result.rewritten is False
    return [tables.number(result.peak_bytes / measure.MIB), format_prediction(result),
            "1.00x (tf.gradients ran)" if plain_again else
            format_peak_ratio(reference.peak_bytes, result.peak_bytes),
            tables.number(result.median_seconds * 1e3),
            "-" if plain_again else
            format_time_ratio(reference.median_seconds, result.median_seconds),
            "-" if result.method.is_reference else _format_error(result.max_rel_error)]


def demo_table(results: Sequence[Result]) -> str:
    """The demo's table: method | peak MiB | vs tf.gradients | median step ms | ..."""
    reference = results[0]
    return tables.markdown_table(
        ["method", "peak MiB", "predicted MiB", "vs tf.gradients", "median step ms",
         "time ratio", "max rel grad err"], "lrrrrrr",
        [[r.method.label, *_cells(r, reference)] for r in results])


def scaling_table(points: Sequence[tuple[int, float, float]], peak_ratios: Sequence[str]) -> str:
    """``memsave-grads scaling``'s peak table: one row per (depth, tf.gradients MiB, 'memory'
    MiB), with the peak ratio and the 'memory' peak over sqrt(depth) (flat under sqrt growth)."""
    rows = [[str(depth), tables.number(plain_mib), tables.number(ours_mib), ratio,
             f"{ours_mib / (depth ** 0.5):.2f}"]
            for (depth, plain_mib, ours_mib), ratio in zip(points, peak_ratios)]
    return tables.markdown_table(["depth", "tf.gradients peak MiB", "'memory' peak MiB", "ratio",
                   "'memory' MiB / sqrt(depth)"], "rrrrr", rows)


def build_time_table(rows: Sequence[tuple[str, int, float, float]]) -> str:
    """Graph construction seconds per (graph, forward ops, tf.gradients s, 'memory' s)."""
    return tables.markdown_table(["graph", "ops before gradients", "tf.gradients s", "'memory' s", "ratio"],
                  "lrrrr", [[name, str(forward_ops), f"{plain:.2f}", f"{ours:.2f}",
                             f"{ours / plain:.2f}x"]
                            for name, forward_ops, plain, ours in rows])


def benchmark_table(results_per_model: Sequence[Sequence[Result]]) -> str:
    """The benchmark's table: one row per (model, method)."""
    rows = []
    for results in results_per_model:
        reference = results[0]
        for r in results:
            ops = "-" if r.graph_ops is None else str(r.graph_ops)
            build = ("-" if r.build_seconds is None else
                     f"{tables.number(r.build_seconds)} s "
                     f"({format_time_ratio(reference.build_seconds, r.build_seconds)})")
            rows.append([r.model, ops, r.method.label, *_cells(r, reference), build])
    return tables.markdown_table(
        ["model", "graph ops", "method", "peak MiB", "predicted MiB", "peak ratio",
         "median step ms", "time ratio", "max rel grad err", "build (ratio)"], "lrlrrrrrrr",
        rows)


TABLE_NOTES = (
    "peak MiB: allocator peak during one training step (gradients + SGD update) above the memory "
    "in use before it (variables and inputs). predicted MiB: the static memory model's peak "
    "(memsave_grads.explain) and its error relative to the measured peak. peak ratio / vs "
    "tf.gradients: tf.gradients' peak "
    "over this one. time ratio: median step time over tf.gradients'. max rel grad err: "
    "max over variables of max|g - g_tf| / max|g_tf|, one run, same inputs. graph ops: ops a "
    "training step needs (forward, gradients, update) before grappler. build (ratio): seconds to "
    "construct the gradients and the SGD update op in the graph (the rewrite, for memsave_grads), "
    "and its ratio to tf.gradients'.")


def summary_line(results: Sequence[Result], method: Method) -> str | None:
    """``"memsave_grads 'memory': 4.1x less peak memory at 1.3x step time"``, or that the
    method ran plain tf.gradients (None if n/a)."""
    reference = results[0]
    for r in results:
        if r.method == method and r.rewritten is False:
            return (f"{method.label}: saves nothing on this network (its plan is not predicted "
                    "to beat tf.gradients), so tf.gradients ran")
        if (r.method == method and r.peak_bytes and reference.peak_bytes
                and r.median_seconds and reference.median_seconds):
            ratio = reference.peak_bytes / r.peak_bytes
            if abs(ratio - 1) < 0.05:
                amount = "the same"
            else:
                amount = f"{ratio:.1f}x less" if ratio > 1 else f"{1 / ratio:.1f}x more"
            return (f"{method.label}: {amount} peak memory at "
                    f"{r.median_seconds / reference.median_seconds:.1f}x step time")
    return None


# --------------------------------------------------------------------------------------------
# Budgets and the trade-off curve
# --------------------------------------------------------------------------------------------


def _budget_fraction(method: Method) -> float | None:
    """The fraction of tf.gradients' peak the method's budget asks for (a calibrated budget:
    what was asked, not the fraction it plans at)."""
    budget = budgets.as_budget(method.checkpoints)
    if budget is None:
        return None
    return budget.calibration.asked.fraction if budget.calibration else budget.fraction


def _budget_cell(method: Method, fraction: float) -> str:
    budget = method.checkpoints
    if isinstance(budget, budgets.Budget) and budget.calibration:
        return f"{fraction:.0%} (planned at {budget.fraction:.0%})"
    return f"{fraction:.0%}"


def calibrate(spec: ModelSpec, asked: budgets.Budget, runs: int = 2,
              learning_rate: float = 1e-4) -> budgets.Budget:
    """``asked`` calibrated on ``spec``'s SGD step (design note "calibrated budgets"): each
    plan in a graph and session of its own, a warm-up run, then the largest of ``runs``
    allocator peaks. :func:`measure_model` then measures the calibrated plan afresh."""
    def measure_step(planned: budgets.Budget | None) -> int:
        graph = tf.Graph()
        with graph.as_default():
            loss, variables = spec.build()
            grads = original_gradients(loss, list(variables)) if planned is None else \
                api.gradients(loss, list(variables), checkpoints=planned, fallback="error")
            step = tf.compat.v1.train.GradientDescentOptimizer(learning_rate).apply_gradients(
                [(g, v) for g, v in zip(grads, variables) if g is not None])
            init = tf.compat.v1.global_variables_initializer()
        graph.finalize()
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(init)
            return measure.step_peak_bytes(lambda: session.run(step), runs)
    calibrated = core_calibration.calibrate(asked, measure_step)
    _LOG.info("%s: %s", spec.name, calibrated.calibration)
    return calibrated


def calibrated_methods(spec: ModelSpec, fractions: Sequence[float]) -> list[Method]:
    """tf.gradients, then ``spec``'s calibrated budget at each fraction (a fraction no plan
    measured within is logged and left out)."""
    methods = [REFERENCE]
    for fraction in fractions:
        try:
            budget = calibrate(spec, budgets.Budget(fraction=fraction))
        except errors.InfeasibleBudgetError as e:
            _LOG.warning("%s at %.0f%%: %s", spec.name, fraction * 100, e)
            continue
        methods.append(Method(f"budget {fraction:.0%} calibrated", budget))
    return methods


def budget_table(results_per_model: Sequence[Sequence[Result]]) -> str:
    """One row per (model, budget): measured peak against the budget, time overhead."""
    rows = []
    for results in results_per_model:
        reference = results[0]
        for result in results[1:]:
            fraction = _budget_fraction(result.method)
            if fraction is None:
                continue
            budget = fraction * reference.peak_bytes if reference.peak_bytes else None
            if result.peak_bytes is None or budget is None:
                rows.append([result.model, _budget_cell(result.method, fraction), "-", "-",
                             "-", "-",
                             result.skipped or result.failed or "-", "-"])
                continue
            verdict = "yes" if result.peak_bytes <= 1.05 * budget else "**no**"
            rows.append([
                result.model, _budget_cell(result.method, fraction),
                tables.number(budget / measure.MIB),
                f"{tables.number(result.peak_bytes / measure.MIB)} ({result.peak_bytes / budget:.2f})",
                verdict, format_prediction(result),
                format_time_ratio(reference.median_seconds, result.median_seconds),
                f"{result.build_seconds:.2f} s" if result.build_seconds else "-"])
    header = ["model", "budget", "budget MiB (of measured tf.gradients)",
              "measured peak MiB (x budget)", "<= budget +5%", "predicted MiB",
              "step time vs tf.gradients", "plan + rewrite"]
    return tables.markdown_table(header, ["l", "r", "r", "r", "l", "r", "r", "r"], rows)


BUDGET_NOTES = (
    "budget: Budget(fraction=f), i.e. f x tf.gradients' *predicted* peak is what the solver "
    "plans for; the budget column applies f to tf.gradients' *measured* peak, which is what "
    "the measured peak is held against (+5% allocator slack). predicted MiB: the static memory "
    "model's peak for the plan (and its error). plan + rewrite: seconds to solve the budget and "
    "build the gradients.")


CALIBRATED_NOTES = (
    "With --calibrate, each budget is first calibrated (memsave_grads.calibrate_budget's "
    "search on the same SGD step, each plan in a graph of its own): the budget column says "
    "at which fraction of the *predicted* plain peak the calibrated plan is planned; the "
    "measured peak is that plan measured again, beside the other methods.")


def tradeoff_table(name: str, front, forward_flops: float, plain_bytes: int,
                   measured: Sequence[Result]) -> str:
    """The predicted Pareto front, then the measured points."""
    lines = [f"### {name}", "", "Predicted front (greedy solver):", "",
             "| predicted peak MiB | x less than tf.gradients | recomputed FLOPs (of forward) |",
             "|---:|---:|---:|"]
    for plan in front:
        lines.append(f"| {tables.number(plan.predicted_peak_bytes / measure.MIB)} | "
                     f"{plain_bytes / max(plan.predicted_peak_bytes, 1):.2f}x | "
                     f"{plan.recompute_cost / forward_flops:.0%} |")
    lines += ["", "Measured:", "",
              "| method | measured peak MiB | step time vs tf.gradients |", "|---|---:|---:|"]
    reference = measured[0]
    for result in measured:
        peak = tables.number(result.peak_bytes / measure.MIB) if result.peak_bytes else "-"
        lines.append(f"| {result.method.label} | {peak} | "
                     f"{format_time_ratio(reference.median_seconds, result.median_seconds)} |")
    return "\n".join(lines)


def plot_tradeoff(curves, path: str) -> None:
    """Per model: predicted front (peak vs recomputed FLOPs) and measured (peak vs time)."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, front, total, _, measured in curves:
        axes[0].plot([p.predicted_peak_bytes / measure.MIB for p in front],
                     [100 * p.recompute_cost / total for p in front], "o-", label=name)
        reference = measured[0]
        points = [(r.peak_bytes / measure.MIB,
                   100 * (r.median_seconds / reference.median_seconds - 1),
                   r.method.label) for r in measured if r.peak_bytes and r.median_seconds]
        axes[1].plot([p[0] for p in points], [p[1] for p in points], "s--", label=name)
        for x, y, label in points:
            axes[1].annotate(label.replace("memsave_grads ", ""), (x, y), fontsize=7)
    axes[0].set(xlabel="predicted peak (MiB)", ylabel="recomputed FLOPs (% of forward)",
                title="Predicted Pareto front")
    axes[1].set(xlabel="measured peak (MiB)", ylabel="step-time overhead (%)",
                title="Measured (one SGD step, CPU)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    _LOG.info("wrote %s", path)
