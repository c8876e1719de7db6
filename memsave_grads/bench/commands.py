"""The subcommands of ``memsave-grads``: each measures, prints its tables, returns an exit code.

:mod:`memsave_grads.cli` parses and validates the arguments, sets the allocator environment and
only then imports this module (and with it TensorFlow). Every function takes the parsed
``argparse.Namespace``. Tables go to stdout, progress to the ``memsave_grads`` logger (stderr); with
``--output FILE`` the tables are also written to a markdown file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import time

import tensorflow as tf

from memsave_grads import _explain as explain_lib
from memsave_grads import _tables as tables
from memsave_grads import errors
from memsave_grads import fit_limit
from memsave_grads import keras as mg_keras
from memsave_grads import measure
from memsave_grads.bench import build_time as bench_build_time
from memsave_grads.bench import control_flow as bench_control_flow
from memsave_grads.bench import hub as bench_hub
from memsave_grads.bench import harness
from memsave_grads.bench import models
from memsave_grads.bench import solvers as bench_solvers
from memsave_grads.bench import xla as bench_xla
from memsave_grads.core import budgets as core_budgets
from memsave_grads.core import memory_model
from memsave_grads.core import solvers as core_solvers

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)


def _environment_line() -> str:
    return (f"TensorFlow {tf.__version__}, device {measure.default_device()}, "
            f"{os.cpu_count()} CPU cores")


def _write(args: argparse.Namespace, text: str, title: str, data: dict | None = None) -> None:
    """Print ``text``; with ``--output``, also write it under ``title`` to that file. With
    ``--format json``, ``data`` instead (made plain by :func:`tables.plain_data`), with the
    date and the environment, printed and written as one JSON object."""
    if getattr(args, "format", "markdown") == "json":
        text = json.dumps({"title": title, "date": datetime.date.today().isoformat(),
                           "environment": _environment_line(),
                           **tables.plain_data(data or {})}, indent=2)
        print(text)
        if getattr(args, "output", None):
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text + "\n")
            _LOG.info("wrote %s", args.output)
        return
    print(text)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(f"# {title}\n\n{datetime.date.today().isoformat()}, {_environment_line()}."
                    f"\n\n{text}\n")
        _LOG.info("wrote %s", args.output)


def _budget_methods(fractions) -> list[harness.Method]:
    """tf.gradients, then one budget method per fraction of its predicted peak."""
    return [harness.REFERENCE] + [harness.Method(f"budget {f:.0%}", f"budget:{f * 100:g}%")
                                  for f in fractions]


def demo(args: argparse.Namespace) -> int:
    """``demo``: the residual MLP, tf.gradients against "memory", one table."""
    spec = models.residual_mlp(args.depth, args.width, args.batch)
    activation_mib = args.batch * args.width * 4 / measure.MIB
    weights_mib = args.depth * args.width * args.width * 4 / measure.MIB
    print(f"{spec.description}; {activation_mib:.3g} MiB per activation, "
          f"{weights_mib:.3g} MiB of weights; one SGD step per run, median of "
          f"{args.repeats}. {_environment_line()}.\n", flush=True)
    start = time.perf_counter()
    results = harness.measure_model(spec, harness.DEMO_METHODS, repeats=args.repeats)
    _LOG.info("demo measured in %.1f s", time.perf_counter() - start)
    print(harness.demo_table(results))
    print()
    line = harness.summary_line(results, harness.MEMORY)
    print(line or f"{harness.MEMORY.label}: n/a ({results[1].skipped or results[1].failed})")
    return 0


def benchmark(args: argparse.Namespace) -> int:
    """``benchmark``: every model family, then the XLA table (``--xla``); returns 1 if a
    model failed unexpectedly."""
    start = time.perf_counter()
    sections, status, data = [], 0, {"repeats": args.repeats}
    # A table runs where its flag is "with" and none says "only", or where its flag is "only".
    flags = {"xla": args.xla, "control_flow": args.control_flow, "hub": args.hub}
    only = {name for name, flag in flags.items() if flag == "only"}
    runs = {name: name in only if only else flag != "without" for name, flag in flags.items()}
    if not only:
        results, status = _graph_benchmark(args)
        data["graph"] = results
        sections.append(harness.benchmark_table(results) + "\n\n" + harness.TABLE_NOTES)
    if runs["xla"]:
        results, xla_status = _xla_benchmark(args)
        data["xla"] = results
        status = max(status, xla_status)
        if results:
            sections.append("## Under XLA\n\n" + bench_xla.table(results) + "\n\n" +
                            bench_xla.TABLE_NOTES)
    if runs["control_flow"]:
        results, cf_status = _control_flow_benchmark()
        data["control_flow"] = results
        status = max(status, cf_status)
        sections.append("## Control flow and calls\n\n" + bench_control_flow.table(results)
                        + "\n\n" + bench_control_flow.TABLE_NOTES)
    if runs["hub"]:
        results, hub_status = _hub_benchmark(args)
        data["hub"] = results
        status = max(status, hub_status)
        if results:
            sections.append("## keras_hub, with and without XLA\n\n" + bench_hub.table(results)
                            + "\n\n" + bench_hub.TABLE_NOTES)
    _LOG.info("benchmark measured in %.1f s", time.perf_counter() - start)
    _write(args, "\n\n".join(sections), f"memsave_grads benchmark, median of {args.repeats} "
           "steps", data)
    return status


def _graph_benchmark(args: argparse.Namespace) -> tuple[list, int]:
    """The results of :func:`models.benchmark_models` in v1 graphs, one list per model, and
    the exit status."""
    specs = models.select(models.benchmark_models(), args.models)
    all_results = []
    status = 0
    for i, spec in enumerate(specs, 1):
        _LOG.info("[%d/%d] %s ...", i, len(specs), spec.description)
        model_start = time.perf_counter()
        try:
            results = harness.measure_model(spec, repeats=args.repeats)
        except Exception as e:  # pylint: disable=broad-except  # keep the other models' rows
            _LOG.exception("[%d/%d] %s failed", i, len(specs), spec.name)
            results = harness.failed_results(spec, harness.DEFAULT_METHODS, e)
            status = 1
        all_results.append(results)
        summary = "; ".join(filter(None, (harness.summary_line(results, m)
                                          for m in harness.DEFAULT_METHODS[1:])))
        _LOG.info("[%d/%d] %s done in %.1f s. %s", i, len(specs), spec.name,
                  time.perf_counter() - model_start, summary or "")
    return all_results, status


def _xla_benchmark(args: argparse.Namespace) -> tuple[list, int]:
    """The results of :func:`models.xla_models` in tf.function, without and with jit_compile
    (none when ``--models`` names none of them), one list per model, and the exit status."""
    specs = models.select(models.xla_models(), args.models)
    all_results = []
    for i, spec in enumerate(specs, 1):
        _LOG.info("[XLA %d/%d] %s ...", i, len(specs), spec.description)
        all_results.append(bench_xla.measure_model(spec, repeats=args.repeats))
    failed = any(r.failed for results in all_results for r in results)
    return all_results, int(failed)


def _control_flow_benchmark() -> tuple[list, int]:
    """The results of :mod:`bench.control_flow` (six forward passes, without and with XLA, two
    methods) and the exit status."""
    shape = bench_control_flow.Shape()
    _LOG.info("[control flow] %d blocks, width %d, batch %d (%.3g MiB per activation), "
              "a fresh process per cell ...", shape.depth, shape.width, shape.batch,
              shape.activation_mib)
    results = bench_control_flow.measure_all(shape)
    return results, int(any(r.failed for r in results))


def _hub_benchmark(args: argparse.Namespace) -> tuple[list, int]:
    """The results of :mod:`bench.hub` (the architectures ``--models`` names, all where it
    names none of them), one list per architecture, and the exit status; needs keras-hub."""
    try:
        import keras_hub  # pylint: disable=import-outside-toplevel,unused-import
    except ImportError as e:
        raise CommandLineError(f"--hub needs keras_hub ({e}): pip install keras-hub") from e
    architectures = bench_hub.select(args.models) or list(bench_hub.ARCHITECTURES)
    _LOG.info("[keras_hub] %s, a fresh process per cell ...",
              ", ".join(a.label for a in architectures))
    results = bench_hub.measure_all(architectures, repeats=args.repeats)
    return results, int(any(r.failed or bench_hub.gradients_wrong(r)
                            for rs in results for r in rs))


def scaling(args: argparse.Namespace) -> int:
    """``scaling``: peak vs depth (table + optional PNG), then rewrite-time ratios."""
    methods = (harness.REFERENCE, harness.MEMORY)
    points, peak_ratios = [], []
    specs = models.scaling_models()
    for i, (depth, spec) in enumerate(zip(models.SCALING_DEPTHS, specs), 1):
        _LOG.info("[%d/%d] %s ...", i, len(specs), spec.description)
        plain, ours = harness.measure_model(spec, methods, repeats=1)
        points.append((depth, plain.peak_bytes / measure.MIB, ours.peak_bytes / measure.MIB))
        peak_ratios.append(harness.format_peak_ratio(plain.peak_bytes, ours.peak_bytes))
    peak_table = harness.scaling_table(points, peak_ratios)
    print(f"Residual MLP family, width 512, batch 128 (one activation 0.25 MiB):\n\n{peak_table}\n")
    if args.plot:
        _plot_scaling(points, args.plot)

    build_specs = [models.tanh_mlp(depth=1000, width=64, batch=64)]
    build_specs += models.select(models.keras_models(), args.models)
    rows = []
    for i, spec in enumerate(build_specs, 1):
        _LOG.info("[%d/%d] rewrite time of %s ...", i, len(build_specs), spec.name)
        plain_s, ours_s, forward_ops = harness.measure_build_seconds(spec)
        rows.append((spec.name, forward_ops, plain_s, ours_s))
    build_table = harness.build_time_table(rows)
    print("Graph construction time (best of 3, fresh graph each):\n\n" + build_table)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(f"# memsave_grads scaling\n\n{datetime.date.today().isoformat()}, "
                    f"{_environment_line()}.\n\n{peak_table}\n\n{build_table}\n")
    return 0


def _plot_scaling(points, path: str) -> None:
    # matplotlib is optional; the command line checked that it is installed before measuring.
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    from matplotlib import pyplot  # pylint: disable=import-outside-toplevel
    depths = [p[0] for p in points]
    figure, axes = pyplot.subplots(figsize=(6, 4))
    axes.plot(depths, [p[1] for p in points], "o-", label="tf.gradients")
    axes.plot(depths, [p[2] for p in points], "s-", label="memsave_grads 'memory'")
    scale = points[-1][2] / points[-1][0] ** 0.5
    axes.plot(depths, [scale * d ** 0.5 for d in depths], ":", color="gray",
              label="c * sqrt(depth)")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log", base=2)
    axes.set_xlabel("residual blocks (depth)")
    axes.set_ylabel("peak memory of one training step (MiB)")
    axes.set_title("Residual MLP, width 512, batch 128 (CPU, BFC allocator)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    _LOG.info("wrote %s", path)


def explain(args: argparse.Namespace) -> int:
    """``explain``: print the plan of each selected model (graphs only), or of --model."""
    if args.model:
        try:
            kind, model, _ = fit_limit.build(args.model, args.batch, args.sequence_length)
        except errors.MemsaveGradsError as e:
            raise CommandLineError(str(e)) from None
        except Exception as e:  # pylint: disable=broad-except  # the user's code, reported whole
            raise CommandLineError(f"argument --model: building {args.model} failed: "
                                   f"{fit_limit.error_text(e)}") from None
        if kind != "keras":
            raise CommandLineError(
                f"argument --model: explain --model needs a Keras model; {args.model} returned "
                "a training step. Call memsave_grads.explain(loss, variables) inside the step "
                "instead.")
        try:
            report = explain_lib.explain(model, checkpoints=args.checkpoints,
                                         batch_size=args.batch,
                                         sequence_length=args.sequence_length)
        except errors.MemsaveGradsError as e:  # the user's model: what is wrong with it
            raise CommandLineError(str(e)) from None
        reports = [(f"{args.model} ({getattr(model, 'name', '')}, batch {args.batch})", report)]
    else:
        reports = []
        specs = models.select(models.benchmark_models(), args.models)
        for i, spec in enumerate(specs, 1):
            _LOG.info("[%d/%d] %s ...", i, len(specs), spec.description)
            with tf.Graph().as_default():
                loss, variables = spec.build()
                try:
                    report = explain_lib.explain(loss, variables, checkpoints=args.checkpoints)
                except errors.MemsaveGradsError as e:  # an infeasible budget, ...
                    raise CommandLineError(f"{spec.description}: {e}") from None
                reports.append((spec.description, report))
    if args.format == "json":
        _write(args, "", "memsave_grads explain", {"plans": [
            {"model": name, **report.as_dict()} for name, report in reports]})
    else:
        for name, report in reports:
            print(f"## {name}\n{report}\n")
    return 0


def budgets(args: argparse.Namespace) -> int:
    """``budgets``: measured peak and overhead under budgets, per model."""
    methods = _budget_methods(args.fractions)
    all_results, status = [], 0
    for i, spec in enumerate(models.select(models.benchmark_models(), args.models), 1):
        _LOG.info("[%d] %s ...", i, spec.description)
        try:
            if args.calibrate:
                methods = harness.calibrated_methods(spec, args.fractions)
            all_results.append(harness.measure_model(spec, methods, repeats=args.repeats))
        except Exception as e:  # pylint: disable=broad-except  # keep the other models' rows
            _LOG.exception("%s failed", spec.name)
            all_results.append(harness.failed_results(spec, methods, e))
            status = 1
    notes = harness.BUDGET_NOTES + (" " + harness.CALIBRATED_NOTES if args.calibrate else "")
    _write(args, harness.budget_table(all_results) + "\n\n" + notes,
           "memsave_grads under memory budgets")
    return status


#: The network ``tradeoff`` draws when no --models is given.
TRADEOFF_DEFAULT_MODELS = ("resnet50",)


def tradeoff(args: argparse.Namespace) -> int:
    """``tradeoff``: Pareto front (predicted) with measured points, per model."""
    specs = models.select(models.benchmark_models(), args.models or TRADEOFF_DEFAULT_MODELS)
    sections, curves = [], []
    for spec in specs:
        with tf.Graph().as_default():
            problem = bench_solvers.problem_for(*spec.build())
        total = problem.graph.forward_cost()
        plain = memory_model.plain_peak_bytes(problem.graph)
        front = core_solvers.tradeoff(problem.with_budget(plain), points=16)
        methods = _budget_methods(args.fractions)
        measured = harness.measure_model(spec, methods, repeats=args.repeats)
        sections.append(harness.tradeoff_table(spec.name, front, total, plain, measured))
        curves.append((spec.name, front, total, plain, measured))
    _write(args, "\n\n".join(sections), "Peak memory vs recompute: the trade-off curve")
    if args.plot:
        harness.plot_tradeoff(curves, args.plot)
    return 0


def solvers_command(args: argparse.Namespace) -> int:
    """``solvers``: greedy vs dp vs milp on small graphs; with --models, greedy on networks."""
    if args.models:
        specs = models.select(models.benchmark_models(), args.models)
        rows = bench_solvers.compare({spec.name: spec.build for spec in specs}, args.fractions,
                                     ("greedy",))
        _write(args, bench_solvers.network_table(rows) + "\n\n" + bench_solvers.NETWORK_NOTES,
               "The greedy budget solver on networks")
        return 0
    rows = bench_solvers.compare(fractions=args.fractions)
    _write(args, bench_solvers.comparison_table(rows) + "\n\n" + bench_solvers.NOTES,
           "Budget solvers on small graphs")
    return 0


def build_time_command(args: argparse.Namespace) -> int:
    """``build-time``: gradient construction time against graph size, one table."""
    methods = [None, *args.checkpoints]
    results = []
    for family in args.families:
        for size in args.sizes or bench_build_time.DEFAULT_SIZES[family]:
            spec = bench_build_time.FAMILIES[family](size)
            _LOG.info("%s %d ...", spec.family, size)
            results.append(bench_build_time.measure(spec, methods, rounds=args.rounds))
    _write(args, bench_build_time.table(results, methods) + "\n\n" +
           bench_build_time.TABLE_NOTES, "Gradient construction time against graph size",
           {"notes": bench_build_time.TABLE_NOTES,
            "graphs": [bench_build_time.as_data(r) for r in results]})
    return 1 if any(r.failed for r in results) else 0


def _log_try(attempt: fit_limit.Attempt, index: int, dimension: str, baseline: str) -> None:
    outcome = "fits" if attempt.fits else (
        "out of memory" if attempt.out_of_memory else "failed")
    _LOG.info("%s: %s %d, try %d: %s",
              baseline if attempt.method == fit_limit.PLAIN else attempt.method, dimension,
              attempt.size, index, outcome)


class CommandLineError(errors.InvalidArgumentError):
    """Bad input a command finds once it has loaded it (the user's model): the command line
    prints it as a usage error, exit status 2. Other errors keep their tracebacks."""


def _check_fit_limit_model(args: argparse.Namespace) -> dict | None:
    """The model argument built once, before any try: a model that cannot train, a method it
    cannot have, or weights and optimizer state that alone fill the limit, is our error (the
    command line prints it as a usage error), not every method's failure in the table. Returns
    what :func:`fit_limit.check` says was built (None: it could not tell)."""
    start_batch = args.start if args.vary == "batch" else args.batch
    _LOG.info("%s: building it once to check it ...", args.model)
    try:
        built = fit_limit.check(args.model, start_batch,
                                None if args.vary == "batch" else args.start)
    except ValueError as e:
        raise CommandLineError(f"argument MODEL: {e}") from None
    if built is None:
        _LOG.warning("building %s once before the search did not finish (killed, or past "
                     "%d s); searching anyway", args.model, fit_limit.PROCESS_TIMEOUT_S)
    elif built["kind"] == "step":
        if args.keras_remat:
            raise CommandLineError(
                f"argument --keras-remat: keras.RematScope applies to Keras 3 models; "
                f"{args.model} returned a training step. Leave the flag out.")
        if args.release_gradients_early:
            raise CommandLineError(
                f"argument --release-gradients-early: applies to Keras models; {args.model} "
                "returned a training step, which releases its gradients early if it calls "
                "memsave_grads.minimize. Leave the flag out.")
    elif args.keras_remat and built["keras"] != mg_keras.KERAS3:
        raise CommandLineError(
            f"argument --keras-remat: keras.RematScope is Keras 3's; {args.model} is a "
            f"{built['keras']} model, which it would leave as it is. Leave the flag out.")
    if built is not None and built.get("ignores_sequence_length"):
        raise CommandLineError(
            f"argument --vary: sequence searches over sequence lengths, but {args.model} "
            f"gives the same batch shapes at lengths {args.start} and {args.start + 1}: its "
            "builder ignores sequence_length (or its inputs have a fixed length). Take "
            "sequence_length in the builder and size the inputs by it, or vary the batch.")
    if built is not None and "weights_bytes" in built:
        _check_limit_above_state(args, built["weights_bytes"], built["optimizer_state_bytes"])
    return built


def _check_limit_above_state(args: argparse.Namespace, weights_bytes: int,
                             optimizer_state_bytes: int) -> None:
    """No batch trains where the weights and the optimizer's state alone fill the limit:
    refused at once, rather than bisected down to a batch of one for every method."""
    state_bytes = weights_bytes + optimizer_state_bytes
    if state_bytes >= args.limit_mib * measure.MIB:
        size = core_budgets.format_bytes
        raise CommandLineError(
            f"argument --limit-mib: {args.model}'s weights ({size(weights_bytes)}) and its "
            f"optimizer's state ({size(optimizer_state_bytes)}) alone take "
            f"{size(state_bytes)}, more than the limit of {args.limit_mib} MiB, so no "
            "batch can train under it whatever the strategy: memsave_grads saves "
            "activations, not weights. Raise --limit-mib well above "
            f"{math.ceil(state_bytes / measure.MIB)}.")


def fit_limit_command(args: argparse.Namespace) -> int:
    """``fit-limit``: the largest size per method under the limit; table (+ PNG)."""
    methods = [fit_limit.PLAIN, *args.checkpoints]
    if args.release_gradients_early:
        methods += [f"{m}{fit_limit.EARLY_RELEASE}" for m in args.checkpoints]
    if args.keras_remat:
        methods.append(fit_limit.KERAS_REMAT)
    dimension = "batch" if args.vary == "batch" else "sequence length"
    built = _check_fit_limit_model(args)
    baseline = fit_limit.baseline_name(built["kind"] if built else None)
    searches = []
    for method in methods:
        _LOG.info("%s: searching from %s %d ...", baseline if method == fit_limit.PLAIN
                  else method, dimension, args.start)

        def try_once(size, method=method):
            if args.vary == "batch":
                return fit_limit.attempt(args.model, method, size, args.limit_mib,
                                         steps=args.steps, reserve_limit=args.reserve_limit)
            return fit_limit.attempt(args.model, method, args.batch, args.limit_mib,
                                     sequence_length=size, steps=args.steps,
                                     reserve_limit=args.reserve_limit)

        def try_size(size, try_once=try_once):
            if args.tries == 1:
                return try_once(size)
            return fit_limit.attempt_repeatedly(
                lambda: try_once(size), args.tries,
                on_try=lambda a, i: _log_try(a, i, dimension, baseline))

        searches.append(fit_limit.search(
            method, try_size, args.start, args.max,
            on_attempt=lambda a: _LOG.info("%s", fit_limit.progress_line(a, dimension,
                                                                         baseline))))
    timings = _time_fit_limit_methods(args, searches)
    fixed = f", batch {args.batch}" if args.vary == "sequence" else ""
    every = f", a size fits if all {args.tries} tries fit" if args.tries > 1 else ""
    reserved = ", the limit reserved as one region" if args.reserve_limit else ""
    title = f"{args.model}: limit {args.limit_mib} MiB{fixed}{every}{reserved}"
    table = fit_limit.table(searches, dimension, args.limit_mib, timings, baseline)
    _write(args, f"{title}\n\n{table}\n\n{fit_limit.TABLE_NOTES}",
           "How much larger: memsave_grads fit-limit", {
               "model": args.model, "limit_mib": args.limit_mib, "dimension": dimension,
               "reference": baseline, "tries": args.tries, "reserve_limit": args.reserve_limit,
               "methods": [fit_limit.search_record(s, searches, baseline)
                           for s in searches],
               "timings": timings})
    if args.plot:
        fit_limit.plot(searches, dimension, args.limit_mib, args.plot, title)
        _LOG.info("wrote %s", args.plot)
    if all(s.largest is None for s in searches):
        attempts = [a for s in searches for a in s.attempts]
        smallest = min((a.size for a in attempts), default=args.start)
        if attempts and not any(a.out_of_memory for a in attempts):
            # Not the limit: the step itself failed (the table's notes say how).
            _LOG.error("nothing fit under %d MiB with any method, and no try ran out of "
                       "memory: every one failed (%s %d: %s)", args.limit_mib, dimension,
                       attempts[0].size, attempts[0].error or "failed")
        else:
            _LOG.error("nothing fit under %d MiB, not even %s %d, with any method",
                       args.limit_mib, dimension, smallest)
        return 1
    # keras.RematScope failing is one of the answers (it does under fit on TensorFlow), not
    # the command's.
    return 0 if all(s.largest is not None or not s.failure for s in searches
                    if s.method != fit_limit.KERAS_REMAT) else 1


def _time_fit_limit_methods(args: argparse.Namespace, searches) -> list:
    """The methods that fit timed against the reference, each at its largest size, in one
    process (:func:`fit_limit.time_against`); none where the reference fit nothing."""
    reference = next((s.largest for s in searches if s.method == fit_limit.PLAIN), None)
    others = [s.largest for s in searches
              if s.method != fit_limit.PLAIN and s.largest is not None]
    if reference is None or not others:
        return []
    _LOG.info("timing %d method(s) against the reference in one process ...", len(others))
    timings, why = fit_limit.time_against(
        args.model, reference, others,
        sequence_length_fixed=args.batch if args.vary == "sequence" else None)
    if why:
        _LOG.warning("the methods could not be timed against each other: %s", why)
    return timings


#: Subcommand name -> its function (the parser in memsave_grads.cli has one subparser each).
COMMANDS = {"demo": demo, "benchmark": benchmark, "scaling": scaling, "explain": explain,
            "budgets": budgets, "tradeoff": tradeoff, "fit-limit": fit_limit_command,
            "solvers": solvers_command, "build-time": build_time_command}
