"""memsave-grads: compare tf.gradients with memsave_grads on peak memory, time and accuracy.

Usage: python -m memsave_grads <command> [flags]     (or: memsave-grads <command> [flags])

Commands:
  demo       One SGD step of a deep residual MLP (h = h + tanh(h @ W_i)) in a tf.compat.v1
             Session, three ways: tf.gradients, memsave_grads 'memory' and 'speed'. Prints a
             markdown table of peak memory, median step time and gradient error.
             Flags: --depth --width --batch --repeats.
  benchmark  The same measurements over model-scale networks: Keras 2 (tf_keras) ResNet50,
             DenseNet121, MobileNetV2, a U-Net and a Transformer encoder stack, a deep residual
             MLP, a tanh MLP chain and a small conv ResNet. Adds the predicted peak of the static
             memory model. Progress on stderr, the table on stdout and, with --output FILE, in a
             markdown file. Flags: --repeats --models --output. Needs: pip install
             'memsave-grads[bench]'.
  scaling    Peak memory vs depth of the residual MLP family (8..256 blocks), tf.gradients vs
             'memory', as a table and, with --plot FILE, a PNG (needs matplotlib); then the
             rewrite time of a 1,000-layer chain and of every --models Keras graph vs plain
             tf.gradients graph construction. Flags: --plot --models --output.
  explain    The plan 'memory' (or --checkpoints) makes for each --models network: checkpoints,
             segments, predicted peak vs tf.gradients. Builds graphs only; runs nothing.
  budgets    One training step of each --models network under memory budgets of --fractions
             (default 75%, 50%, 35%) of tf.gradients' predicted peak: measured peak against the
             budget taken from tf.gradients' *measured* peak, step-time overhead, solve time.
             Flags: --models --fractions --repeats --output.
  tradeoff   The Pareto front of predicted peak vs recomputed FLOPs across budgets for each
             --models network (default: ResNet50), as a table and, with --plot FILE, a PNG with
             measured points at --fractions. Flags: --models --fractions --plot --output.
  solvers    The greedy heuristic against the exact solvers (dp, milp) on graphs of <= 200 ops:
             recompute cost at each budget, relative to the best plan found, and solve times.

Peak memory on CPU needs TF_CPU_ALLOCATOR_USE_BFC=true in the environment before TensorFlow is
imported. Importing the package imports TensorFlow, so the command re-executes itself once with
the variable set when it was not.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

from absl import app
from absl import flags
from absl import logging

FLAGS = flags.FLAGS

#: Environment the measurements need before TensorFlow is imported (measure.CPU_BFC_ENV).
CPU_BFC_ENV = "TF_CPU_ALLOCATOR_USE_BFC"
COMMANDS = ("demo", "benchmark", "scaling", "explain", "budgets", "tradeoff", "solvers")
#: Set in the environment of the re-executed process (see _ensure_environment).
_RESTARTED_ENV = "MEMSAVE_GRADS_CLI_RESTARTED"


def _define_flags() -> None:
    """Define the command's flags (once per process; nothing is defined at import time)."""
    if "depth" in FLAGS:
        return
    flags.DEFINE_integer("depth", 64, "demo: residual blocks.", lower_bound=1)
    flags.DEFINE_integer("width", 1024, "demo: units per layer.", lower_bound=1)
    flags.DEFINE_integer("batch", 256, "demo: batch size.", lower_bound=1)
    flags.DEFINE_integer("repeats", 3, "Timed training steps per method (median reported), "
                         "after one warm-up step.", lower_bound=1)
    flags.DEFINE_list("models", [], "benchmark: only models whose name contains one of these "
                      "(case-insensitive) substrings, e.g. 'resnet,tanh'. Default: all.")
    flags.DEFINE_string("output", None, "benchmark, scaling: also write the tables to this "
                        "markdown file.")
    flags.DEFINE_string("plot", None, "scaling: write the peak-vs-depth plot to this PNG file.")
    flags.DEFINE_string("checkpoints", "memory", "explain: the strategy to explain.")
    flags.DEFINE_list("fractions", ["0.75", "0.5", "0.35"], "budgets, tradeoff: budgets as "
                      "fractions of tf.gradients' predicted peak.")


def _ensure_environment() -> None:
    """Set the allocator variable; re-execute if TensorFlow was imported without it.

    ``python -m memsave_grads`` and the ``memsave-grads`` script both import the package (and
    so TensorFlow) before any code of this module runs, and the CPU allocator only keeps the
    statistics the measurements read when the variable was set before that import.
    """
    needs_restart = "tensorflow" in sys.modules and os.environ.get(CPU_BFC_ENV) != "true"
    os.environ[CPU_BFC_ENV] = "true"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if needs_restart and not os.environ.get(_RESTARTED_ENV):  # never more than once
        os.environ[_RESTARTED_ENV] = "1"
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, "-m", "memsave_grads", *sys.argv[1:]])


def _environment_line() -> str:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from memsave_grads import measure  # pylint: disable=import-outside-toplevel
    return (f"TensorFlow {tf.__version__}, device {measure.default_device()}, "
            f"{os.cpu_count()} CPU cores")


def demo() -> int:
    """``demo``: the residual MLP, three methods, one table."""
    from memsave_grads.bench import harness  # pylint: disable=import-outside-toplevel
    from memsave_grads import measure  # pylint: disable=import-outside-toplevel

    spec = harness.residual_mlp(FLAGS.depth, FLAGS.width, FLAGS.batch)
    activation_mib = FLAGS.batch * FLAGS.width * 4 / measure.MIB
    weights_mib = FLAGS.depth * FLAGS.width * FLAGS.width * 4 / measure.MIB
    print(f"{spec.description}; {activation_mib:.3g} MiB per activation, "
          f"{weights_mib:.3g} MiB of weights; one SGD step per run, median of "
          f"{FLAGS.repeats}. {_environment_line()}.\n", flush=True)
    start = time.perf_counter()
    results = harness.measure_model(spec, repeats=FLAGS.repeats)
    logging.info("demo measured in %.1f s", time.perf_counter() - start)
    print(harness.demo_table(results))
    print()
    for method in harness.DEFAULT_METHODS[1:]:
        line = harness.summary_line(results, method)
        if line and method is not harness.MEMORY:
            print(line)
    line = harness.summary_line(results, harness.MEMORY)
    print(line or f"{harness.MEMORY.label}: n/a ({results[1].skipped or results[1].failed})")
    return 0


def benchmark() -> int:
    """``benchmark``: every model family; returns 1 if a model failed unexpectedly."""
    from memsave_grads.bench import harness  # pylint: disable=import-outside-toplevel

    models = _selected_models(harness.benchmark_models())
    all_results = []
    status = 0
    start = time.perf_counter()
    for i, spec in enumerate(models, 1):
        logging.info("[%d/%d] %s ...", i, len(models), spec.description)
        model_start = time.perf_counter()
        try:
            results = harness.measure_model(spec, repeats=FLAGS.repeats)
        except Exception as e:  # pylint: disable=broad-except  # keep the other models' rows
            logging.exception("[%d/%d] %s failed", i, len(models), spec.name)
            results = harness.failed_results(spec, harness.DEFAULT_METHODS, e)
            status = 1
        all_results.append(results)
        summary = "; ".join(filter(None, (harness.summary_line(results, m)
                                          for m in harness.DEFAULT_METHODS[1:])))
        logging.info("[%d/%d] %s done in %.1f s. %s", i, len(models), spec.name,
                     time.perf_counter() - model_start, summary or "")
    logging.info("benchmark measured in %.1f s", time.perf_counter() - start)

    table = harness.benchmark_table(all_results)
    print(table)
    print()
    print(harness.TABLE_NOTES)
    if FLAGS.output:
        with open(FLAGS.output, "w", encoding="utf-8") as f:
            f.write("# memsave_grads benchmark\n\n")
            f.write(f"{datetime.date.today().isoformat()}, {_environment_line()}, "
                    f"median of {FLAGS.repeats} steps.\n\n")
            f.write(table + "\n\n" + harness.TABLE_NOTES + "\n")
        logging.info("wrote %s", FLAGS.output)
    return status


def _selected_models(models):
    if not FLAGS.models:
        return models
    def simple(text):
        return text.lower().replace("-", "")
    wanted = [simple(w) for w in FLAGS.models]
    chosen = [m for m in models if any(w in simple(m.name) for w in wanted)]
    if not chosen:
        raise app.UsageError(f"--models={','.join(FLAGS.models)} matches no model.")
    return chosen


def scaling() -> int:
    """``scaling``: peak vs depth (table + optional PNG), then rewrite-time ratios."""
    from memsave_grads.bench import harness  # pylint: disable=import-outside-toplevel
    from memsave_grads.bench import keras_models  # pylint: disable=import-outside-toplevel
    from memsave_grads import measure  # pylint: disable=import-outside-toplevel

    methods = (harness.REFERENCE, harness.MEMORY)
    rows, points = [], []
    specs = harness.scaling_models()
    for i, spec in enumerate(specs, 1):
        logging.info("[%d/%d] %s ...", i, len(specs), spec.description)
        plain, ours = harness.measure_model(spec, methods, repeats=1)
        depth = harness.SCALING_DEPTHS[i - 1]
        points.append((depth, plain.peak_bytes / measure.MIB, ours.peak_bytes / measure.MIB))
        rows.append([str(depth), harness._number(points[-1][1]),  # pylint: disable=protected-access
                     harness._number(points[-1][2]),  # pylint: disable=protected-access
                     harness.format_peak_ratio(plain.peak_bytes, ours.peak_bytes),
                     f"{points[-1][2] / (depth ** 0.5):.2f}"])
    peak_table = harness._table(  # pylint: disable=protected-access
        ["depth", "tf.gradients peak MiB", "'memory' peak MiB", "ratio",
         "'memory' MiB / sqrt(depth)"], "rrrrr", rows)
    print(f"Residual MLP family, width 512, batch 128 (one activation 0.25 MiB):\n\n{peak_table}\n")
    if FLAGS.plot:
        _plot_scaling(points, FLAGS.plot)

    build_specs = [harness.tanh_mlp(depth=1000, width=64, batch=64)]
    build_specs += _selected_models([build() for build in keras_models.KERAS_MODELS.values()])
    rows = []
    for i, spec in enumerate(build_specs, 1):
        logging.info("[%d/%d] rewrite time of %s ...", i, len(build_specs), spec.name)
        plain, ours, forward_ops = harness.measure_build_seconds(spec)
        rows.append([spec.name, str(forward_ops), f"{plain:.2f}", f"{ours:.2f}",
                     f"{ours / plain:.2f}x"])
    build_table = harness._table(  # pylint: disable=protected-access
        ["graph", "ops before gradients", "tf.gradients s", "'memory' s", "ratio"], "lrrrr", rows)
    print("Graph construction time (best of 3, fresh graph each):\n\n" + build_table)
    if FLAGS.output:
        with open(FLAGS.output, "w", encoding="utf-8") as f:
            f.write(f"# memsave_grads scaling\n\n{datetime.date.today().isoformat()}, "
                    f"{_environment_line()}.\n\n{peak_table}\n\n{build_table}\n")
    return 0


def _plot_scaling(points, path: str) -> None:
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
        matplotlib.use("Agg")
        from matplotlib import pyplot  # pylint: disable=import-outside-toplevel
    except ImportError:
        logging.warning("--plot needs matplotlib (pip install 'memsave-grads[bench]'); skipped")
        return
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
    logging.info("wrote %s", path)


def explain() -> int:
    """``explain``: print the plan of each selected model (graphs only)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import memsave_grads  # pylint: disable=import-outside-toplevel
    from memsave_grads.bench import harness  # pylint: disable=import-outside-toplevel

    for spec in _selected_models(harness.benchmark_models()):
        with tf.Graph().as_default():
            loss, variables = spec.build()
            report = memsave_grads.explain(loss, variables, checkpoints=FLAGS.checkpoints)
        print(f"## {spec.description}\n{report}\n")
    return 0


def _write(text: str, title: str) -> None:
    print(text)
    if FLAGS.output:
        with open(FLAGS.output, "w", encoding="utf-8") as f:
            f.write(f"# {title}\n\n{datetime.date.today().isoformat()}, {_environment_line()}."
                    f"\n\n{text}\n")
        logging.info("wrote %s", FLAGS.output)


def budgets() -> int:
    """``budgets``: measured peak and overhead under budgets, per model."""
    from memsave_grads.bench import harness  # pylint: disable=import-outside-toplevel

    fractions = [float(f) for f in FLAGS.fractions]
    methods = [harness.REFERENCE] + [harness.Method(f"budget {f:.0%}", f"budget:{f * 100:g}%")
                                    for f in fractions]
    all_results, status = [], 0
    for i, spec in enumerate(_selected_models(harness.benchmark_models()), 1):
        logging.info("[%d] %s ...", i, spec.description)
        try:
            all_results.append(harness.measure_model(spec, methods, repeats=FLAGS.repeats))
        except Exception as e:  # pylint: disable=broad-except  # keep the other models' rows
            logging.exception("%s failed", spec.name)
            all_results.append(harness.failed_results(spec, methods, e))
            status = 1
    _write(harness.budget_table(all_results) + "\n\n" + harness.BUDGET_NOTES,
           "memsave_grads under memory budgets")
    return status


def tradeoff() -> int:
    """``tradeoff``: Pareto front (predicted) with measured points, per model."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from memsave_grads.bench import harness  # pylint: disable=import-outside-toplevel
    from memsave_grads.bench import solvers as bench_solvers  # pylint: disable=import-outside-toplevel
    from memsave_grads.core import memory_model  # pylint: disable=import-outside-toplevel
    from memsave_grads.core import solvers  # pylint: disable=import-outside-toplevel

    models = harness.benchmark_models()
    models = _selected_models(models) if FLAGS.models else [
        m for m in models if "resnet50" in m.name.lower()]
    fractions = [float(f) for f in FLAGS.fractions]
    sections, curves = [], []
    for spec in models:
        with tf.Graph().as_default():
            problem = bench_solvers.problem_for(*spec.build())
        total = sum(problem.graph.cost_of(v) for v in range(problem.graph.num_nodes))
        plain = memory_model.plain_peak_bytes(problem.graph)
        front = solvers.tradeoff(problem.with_budget(plain), points=16)
        methods = [harness.REFERENCE] + [harness.Method(f"budget {f:.0%}", f"budget:{f * 100:g}%")
                                        for f in fractions]
        measured = harness.measure_model(spec, methods, repeats=FLAGS.repeats)
        sections.append(harness.tradeoff_table(spec.name, front, total, plain, measured))
        curves.append((spec.name, front, total, plain, measured))
    _write("\n\n".join(sections), "Peak memory vs recompute: the trade-off curve")
    if FLAGS.plot:
        harness.plot_tradeoff(curves, FLAGS.plot)
    return 0


def solvers_command() -> int:
    """``solvers``: greedy vs dp vs milp on small graphs."""
    from memsave_grads.bench import solvers as bench_solvers  # pylint: disable=import-outside-toplevel
    rows = bench_solvers.compare()
    _write(bench_solvers.comparison_table(rows) + "\n\n" + bench_solvers.NOTES,
           "Budget solvers on small graphs")
    return 0


def main(argv: list[str]) -> int:
    """absl entry point: ``argv[1]`` is the command."""
    if len(argv) != 2 or argv[1] not in COMMANDS:
        raise app.UsageError(f"expected one command, one of {', '.join(COMMANDS)}; got "
                             f"{' '.join(argv[1:]) or 'none'}.")
    if os.environ.pop(_RESTARTED_ENV, None):
        logging.info("re-executed with %s=true (TensorFlow had been imported without it)",
                     CPU_BFC_ENV)
    return {"demo": demo, "benchmark": benchmark, "scaling": scaling, "explain": explain,
            "budgets": budgets, "tradeoff": tradeoff, "solvers": solvers_command}[argv[1]]()


def run() -> None:
    """Console entry point (``memsave-grads``) and ``python -m memsave_grads``."""
    _ensure_environment()
    _define_flags()
    entry = sys.modules.get("__main__")
    if entry is not None and not getattr(entry, "__doc__", None):
        entry.__doc__ = __doc__  # absl prints it as usage; the console script has none
    app.run(main)


if __name__ == "__main__":
    run()
