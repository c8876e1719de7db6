"""The command line (``python -m memsave_grads``), its measurement helpers, and the examples."""

import json
import logging
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import pytest
import tensorflow as tf

from memsave_grads import cli
from memsave_grads import measure
from memsave_grads.bench import harness
from memsave_grads.bench import models
from memsave_grads.core.solvers import greedy

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEMO_SMALL = ["demo", "--depth", "8", "--width", "64", "--batch", "8", "--repeats", "1"]


def _run(args, env_overrides=None, drop=(), timeout=120):
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for name in drop:
        env.pop(name, None)
    env.update(env_overrides or {})
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_demo_prints_table_and_summary():
    # Started without the allocator variable, as a user would: the command sets it before
    # TensorFlow is imported, so the peaks are measured (a number, not n/a).
    proc = _run(["-m", "memsave_grads", *DEMO_SMALL], drop=["TF_CPU_ALLOCATOR_USE_BFC"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert ("| method | peak MiB | predicted MiB | vs tf.gradients | median step ms | "
            "time ratio | max rel grad err |") in out
    for label in ("| tf.gradients |", "| memsave_grads 'memory' |"):
        assert label in out, out
    # Only measured differences: no row (or warning) for a strategy that would run
    # tf.gradients again on this network.
    assert "'speed'" not in out and "saves no memory" not in proc.stderr, proc.stderr
    reference_row = next(line for line in out.splitlines() if line.startswith("| tf.gradients |"))
    assert float(reference_row.split("|")[2]) > 0, reference_row
    assert out.strip().splitlines()[-1].startswith("memsave_grads 'memory': ")
    # Progress is logged; TensorFlow's INFO start-up lines are not (TF_CPP_MIN_LOG_LEVEL=2).
    assert "demo measured in" in proc.stderr
    assert "absl::InitializeLog" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("command", [["demo"], ["explain", "--models", "mlp"]])
def test_without_tensorflow_a_command_says_what_to_install_in_one_line(command):
    # sys.modules[name] = None makes `import name` fail, as a machine without the wheel does.
    proc = _run(["-c", "import sys; sys.modules['tensorflow'] = None; "
                 "from memsave_grads import cli; sys.exit(cli.main(sys.argv[1:]))", *command])
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("memsave-grads: error: memsave_grads needs TensorFlow >=2.16")
    assert 'pip install "memsave-grads[cpu]"' in lines[0]


def test_unknown_command_is_a_usage_error():
    proc = _run(["-m", "memsave_grads", "nonsense"], env_overrides={
        "TF_CPU_ALLOCATOR_USE_BFC": "true"})
    assert proc.returncode == 2
    assert "invalid choice: 'nonsense'" in proc.stderr and "demo" in proc.stderr


@pytest.mark.parametrize("script", ["session_loop.py", "tf_function_loop.py"])
def test_example_runs(script):
    proc = _run([str(ROOT / "examples" / script), "--steps", "3", "--depth", "4",
                 "--width", "32", "--batch", "16"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(lines) == 3, proc.stdout
    losses = [float(line.split()[-1]) for line in lines]
    assert all(loss == loss for loss in losses), losses  # no NaN
    assert losses[-1] < losses[0], losses


SMALL_EXAMPLES = {
    "lstm.py": ["--steps", "20", "--batch", "4", "--features", "8", "--units", "16",
                "--repeats", "1"],
    "keras_fit.py": ["--depth", "4", "--width", "32", "--batch", "32", "--epochs", "2",
                     "--steps_per_epoch", "2"],
    "distributed.py": ["--steps", "2", "--depth", "3", "--width", "16", "--batch", "8"],
    "early_release.py": ["--width", "128", "--depth", "3", "--batch", "4", "--runs", "1"],
}


@pytest.mark.parametrize("script", sorted(SMALL_EXAMPLES))
def test_integration_example_runs(script):
    """Every example runs (small sizes) and prints what it measured, without a traceback."""
    proc = _run([str(ROOT / "examples" / script), *SMALL_EXAMPLES[script]], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), proc.stderr[-3000:]
    assert "nan" not in proc.stdout.lower().split(), proc.stdout


def test_every_example_is_smoke_tested():
    scripts = {p.name for p in (ROOT / "examples").glob("*.py")}
    # The fit-limit command's models are in the package (memsave_grads.bench.fit_limit_models):
    # tests/test_fit_limit.py::test_the_readme_models_build_and_plan.
    assert scripts == set(SMALL_EXAMPLES) | {"session_loop.py", "tf_function_loop.py"}


def _elementwise_chain() -> models.ModelSpec:
    """No matmul at all: the 'speed' strategy has nothing to keep."""

    def build():
        w = tf.Variable(tf.ones([64, 64]), name="w")
        h = w
        for _ in range(6):
            h = tf.tanh(h * 1.5)
        return tf.reduce_mean(tf.square(h)), [w]

    return models.ModelSpec("elementwise chain", build)


def test_measure_model_reports_inapplicable_strategy_as_na():
    results = harness.measure_model(_elementwise_chain(), repeats=1)
    by_label = {r.method.label: r for r in results}
    speed = by_label["memsave_grads 'speed'"]
    assert speed.skipped and speed.peak_bytes is None
    reference = by_label["tf.gradients"]
    assert reference.peak_bytes is not None and reference.peak_bytes > 0
    table = harness.benchmark_table([results])
    assert "| elementwise chain |" in table
    assert "n/a (checkpoints='speed'" in table


def test_measure_model_gradients_match():
    results = harness.measure_model(models.residual_mlp(depth=6, width=32, batch=8), repeats=1)
    assert [r.method for r in results] == list(harness.DEFAULT_METHODS)
    for r in results:
        assert r.skipped is None and r.failed is None
        assert r.max_rel_error is not None and r.max_rel_error < 1e-5
        assert r.graph_ops > 0 and r.median_seconds > 0
    assert "| memsave_grads 'memory' |" in harness.demo_table(results)
    assert harness.summary_line(results, harness.MEMORY).startswith("memsave_grads 'memory': ")


@pytest.mark.slow  # ~50 s: every method compiled with and without XLA
def test_xla_measure_model_rows_and_table():
    from memsave_grads.bench import xla as bench_xla  # pylint: disable=import-outside-toplevel
    spec = models.XlaSpec("tiny residual MLP", "mlp",
                          {"depth": 6, "width": 32, "batch": 16, "residual": True})
    results = bench_xla.measure_model(spec, repeats=1)
    assert [(r.method, r.jit_compile) for r in results] == [
        (m, jit) for jit in (False, True) for m in bench_xla.METHODS]
    for r in results:
        assert r.failed is None, r.failed
        assert r.max_rel_error < 1e-5 and r.peak_bytes > 0 and r.median_seconds > 0
    table = bench_xla.table([results])
    assert "peak MiB XLA" in table
    assert table.count("| tiny residual MLP |") == len(bench_xla.METHODS)
    assert "| keras.RematScope |" in table and "| tf.recompute_grad |" in table


def test_xla_models_are_selected_by_the_benchmark_s_names():
    """--models is checked against benchmark_models(); each XLA model's name starts with the
    family name of the benchmark network it mirrors (its size may differ: the peer table's
    Transformer has sequence 128), so the same filter selects it."""
    families = {spec.name.split(" ")[0] for spec in models.benchmark_models()}
    for spec in models.xla_models():
        assert spec.name.split(" ")[0] in families, spec.name
        assert models.select(models.xla_models(), [spec.name.split(" ")[0]])
    assert [s.name for s in models.select(models.xla_models(), ["transformer"])] == [
        "Transformer 8 layers b=8 seq=128 (raw ops)"]


def test_a_row_that_ran_tf_gradients_again_shows_no_ratio_of_noise():
    reference = harness.Result("m", harness.REFERENCE, peak_bytes=100, median_seconds=1.0)
    again = harness.Result("m", harness.SPEED, peak_bytes=101, median_seconds=0.8,
                           max_rel_error=0.0, rewritten=False)
    row = harness.demo_table([reference, again]).splitlines()[-1]
    assert "1.00x (tf.gradients ran)" in row and "0.80x" not in row
    line = harness.summary_line([reference, again], harness.SPEED)
    assert line.endswith("so tf.gradients ran") and "step time" not in line


def test_ratio_formatting():
    assert harness.format_peak_ratio(400, 100) == "4.00x less"
    assert harness.format_peak_ratio(100, 120) == "1.20x more"
    assert harness.format_peak_ratio(100, 100) == "1.00x"
    assert harness.format_time_ratio(2.0, 2.6) == "1.30x"


def test_explain_command_prints_a_plan():
    proc = _run(["-m", "memsave_grads", "explain", "--models", "tanh MLP"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "memsave_grads plan for checkpoints='memory'" in proc.stdout
    assert "predicted peak:" in proc.stdout


def test_explain_command_prints_json_with_the_plan_in_bytes():
    proc = _run(["-m", "memsave_grads", "explain", "--models", "tanh MLP", "--format", "json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)   # stdout is the JSON object alone: logs go to stderr
    assert data["title"] == "memsave_grads explain" and data["environment"]
    [plan] = data["plans"]
    assert plan["model"].startswith("tanh MLP") and plan["checkpoints"] == "memory"
    assert 0 < plan["predicted_peak_bytes"] < plan["predicted_plain_peak_bytes"]
    assert plan["levels"] and all(level["recomputed_ops"] > 0 for level in plan["levels"])
    assert plan["checkpoint_names"] and 0 < plan["recompute_fraction"] <= 1


def test_explain_command_refuses_an_infeasible_budget_in_one_line():
    """As with --model: the error and how to raise the budget, exit status 2, no traceback."""
    proc = _run(["-m", "memsave_grads", "explain", "--models", "tanh MLP", "--checkpoints",
                 "budget:1%"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Raise the budget to at least" in proc.stderr


def test_benchmark_json_holds_every_result_plainly(monkeypatch, capsys, tmp_path):
    from memsave_grads.bench import commands  # pylint: disable=import-outside-toplevel
    results = [[harness.Result("m", harness.REFERENCE, peak_bytes=100, median_seconds=0.5),
                harness.Result("m", harness.MEMORY, peak_bytes=25, median_seconds=0.6,
                               max_rel_error=float("nan"))]]
    monkeypatch.setattr(commands, "_graph_benchmark", lambda args: (results, 0))
    args = cli.build_parser().parse_args(
        ["benchmark", "--xla", "without", "--format", "json", "--output",
         str(tmp_path / "b.json")])
    assert commands.benchmark(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == json.loads((tmp_path / "b.json").read_text())
    reference, ours = data["graph"][0]
    assert reference["method"] == {"label": "tf.gradients", "checkpoints": None}
    assert ours["peak_bytes"] == 25 and ours["max_rel_error"] is None   # NaN is not JSON


def test_build_time_command_prints_json_with_every_method_s_seconds():
    proc = _run(["-m", "memsave_grads", "build-time", "--families", "residual", "--sizes",
                 "8,16", "--checkpoints", "memory,budget:50%", "--rounds", "1", "--format",
                 "json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["title"] == "Gradient construction time against graph size"
    small, large = data["graphs"]
    assert (small["size"], large["size"]) == (8, 16) and small["graph_ops"] < large["graph_ops"]
    for row in (small, large):
        assert set(row["cpu_seconds"]) == {"tf.gradients", "memory", "budget:50%"}, row
        assert all(seconds > 0 for seconds in row["cpu_seconds"].values()) and not row["failed"]
        assert row["tf_gradients_ops"] > 0


def test_solvers_command_plans_the_chosen_networks():
    proc = _run(["-m", "memsave_grads", "solvers", "--models", "tanh MLP",
                 "--fractions", "0.5,0.3"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| tanh MLP")]
    assert len(rows) == 2 and "| 50% = " in rows[0] and "| 30% = " in rows[1], proc.stdout
    shares = [float(row.split("|")[4].split("%")[0]) for row in rows]
    assert 0 < shares[0] < shares[1], proc.stdout  # a smaller budget recomputes more
    ops = int(rows[0].split("|")[2])
    assert rows[0].endswith(f"| {greedy.plan_limit(ops)} |") and "greedy recomputes" in proc.stdout


@pytest.mark.slow  # ~20 s: the benchmark's Keras models at full size (graphs only)
def test_keras_models_build_and_explain():
    """Every Keras model of the benchmark builds in a graph and gets a plan that saves memory."""
    pytest.importorskip("tf_keras")
    import memsave_grads as mg  # pylint: disable=import-outside-toplevel
    for name, build in models.KERAS_MODELS.items():
        with tf.Graph().as_default():  # the benchmark's sizes: nothing runs, graphs only
            loss, variables = build().build()
            report = mg.explain(loss, variables, checkpoints="memory")
        assert report.predicted_saving > 1.5, (name, str(report))


def test_relative_error_ignores_rounding_noise_of_an_exactly_zero_gradient():
    # A key bias under softmax has gradient 0 in exact arithmetic; both sides hold 1e-11 noise.
    # It is compared against a floor of 1e-6 x the largest gradient, not against itself.
    reference = [tf.constant([0.5, -0.25]), tf.constant([5e-12, -3e-12])]
    noisy = [tf.constant([0.5, -0.25]), tf.constant([-4e-12, 6e-12])]
    wrong = [tf.constant([0.5, -0.2]), tf.constant([5e-12, -3e-12])]
    assert float(harness._max_relative_error(noisy, reference)) < 1e-4
    assert float(harness._max_relative_error(wrong, reference)) == pytest.approx(0.1, rel=1e-3)
    assert float(harness._max_relative_error([None, reference[1]], reference)) == float("inf")


# --------------------------------------------------------------------------------------------
# Parsing: help, version and usage errors come before TensorFlow and before any model
# --------------------------------------------------------------------------------------------

#: Run in a fresh interpreter: each argv through ``python -m memsave_grads``, then which of the
#: heavy modules got imported.
_PARSE_ONLY = textwrap.dedent("""
    import contextlib, io, json, runpy, sys
    results = []
    for argv in json.loads(sys.argv[1]):
        sys.argv = ["memsave_grads", *argv]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_module("memsave_grads", run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code
        results.append([code, out.getvalue(), err.getvalue()])
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "tf_keras", "keras")
                   or m in ("memsave_grads.bench.harness", "memsave_grads.bench.commands",
                            "memsave_grads.bench.graphs", "memsave_grads.bench.keras_graphs"))
    print(json.dumps({"results": results, "heavy": heavy}))
""")


def _parse_only(*argvs):
    """[(exit code, stdout, stderr)] of each argv, and the heavy modules imported meanwhile."""
    proc = _run(["-c", _PARSE_ONLY, json.dumps([list(a) for a in argvs])])
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout)
    return [tuple(r) for r in answer["results"]], answer["heavy"]


USAGE_ERRORS = [
    (["demo", "--depth", "0"], "argument --depth: expected a positive integer, got '0'"),
    (["demo", "--depth", "x"], "argument --depth: expected a positive integer, got 'x'"),
    (["demo", "--models", "mlp"], "memsave-grads demo: error: unrecognized arguments: --models"),
    (["benchmark", "--models", "resnet,nosuchnet"], "argument --models: expected comma-separated "
     "substrings of model names"),
    (["scaling", "--models", "tanh"], "got 'tanh'"),  # scaling's --models picks Keras networks
    (["budgets", "--fractions", "0.5,1.5"], "argument --fractions: expected comma-separated "
     "fractions in (0, 1] such as '0.75,0.5', got '1.5'"),
    (["explain", "--checkpoints", "fast"], "argument --checkpoints: expected a strategy "
     "(collection, memory, speed) or a budget"),
    (["explain", "--checkpoints", "budget:4XB"], "has an unknown unit 'XB'"),
    (["explain", "--models", "mlp", "--batch", "8"], "argument --batch: sizes a model of yours, "
     "given with --model; the benchmark networks have their own sizes. Got --batch 8 without "
     "--model"),
    (["explain", "--sequence-length", "16"], "Got --sequence-length 16 without --model"),
    (["tradeoff", "--output", "/no/such/folder/t.md"], "argument --output: expected a file in an "
     "existing folder, got '/no/such/folder/t.md'"),
    (["nonsense"], "argument COMMAND: invalid choice: 'nonsense'"),
    ([], "expected a command, one of demo, benchmark, scaling, explain, budgets, tradeoff, "
     "fit-limit, solvers, build-time; got none"),
    (["build-time", "--families", "residual,lstm"], "argument --families: expected "
     "comma-separated families of residual, transformer, convnet, got 'lstm'"),
]


def test_help_version_and_usage_errors_import_no_tensorflow():
    argvs = [["--help"], ["demo", "--help"], ["--version"], *(argv for argv, _ in USAGE_ERRORS)]
    results, heavy = _parse_only(*argvs)
    assert heavy == [], heavy  # nothing measured, nothing built, TensorFlow not even imported
    (help_code, help_out, _), (demo_code, demo_out, _), (version_code, version_out, _) = results[:3]
    assert help_code == demo_code == version_code == 0
    assert "COMMAND" in help_out and "demo" in help_out
    assert "--depth N" in demo_out
    assert version_out.strip() == "memsave-grads 0.1.0"
    for (argv, expected), (code, out, err) in zip(USAGE_ERRORS, results[3:]):
        assert code == 2, (argv, code, err)
        assert expected in err, (argv, err)
        assert len(err.strip().splitlines()) == 1 and not out, (argv, err)


def test_top_level_help_lists_every_command_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name, summary, _ in cli._COMMANDS:  # pylint: disable=protected-access
        assert name in out and summary.split()[0] in out, (name, out)
    assert "--depth" not in out  # options belong to the commands' own help


@pytest.mark.parametrize("command, present, absent", [
    ("demo", ["--depth N", "(default: 64)", "--width N", "(default: 1024)", "--batch N",
              "(default: 256)", "--repeats N", "(default: 3)"], ["--models", "--checkpoints"]),
    ("benchmark", ["--repeats", "--models", "--output", "--xla", "(default: with)"],
     ["--depth", "--fractions", "--plot"]),
    ("scaling", ["--models", "--plot", "--output", "all Keras networks"], ["--repeats"]),
    ("explain", ["--models", "--checkpoints", "(default: memory)", "--format"],
     ["--repeats", "--output"]),
    ("budgets", ["--models", "--fractions", "(default: 0.75,0.5,0.35)", "--repeats",
                 "--output"], ["--plot"]),
    ("tradeoff", ["--models", "(default: ResNet50)", "--fractions", "--plot", "--output"],
     ["--depth"]),
    ("solvers", ["--output", "--models", "--fractions", "(default: 0.75,0.6,0.5,0.4,0.35)"],
     ["--repeats", "--plot"]),
    ("build-time", ["--families", "--sizes", "--checkpoints", "(default: memory,budget:50%)",
                    "--rounds", "(default: 3)", "--output", "--format"], ["--repeats", "--plot"]),
])
def test_each_command_has_its_own_help(command, present, absent, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for text in present:
        assert text in out, (command, text, out)
    for text in absent:
        assert text not in out, (command, text, out)


def test_valid_arguments_parse_to_what_the_commands_read():
    parser = cli.build_parser()
    args = parser.parse_args(["budgets", "--models", "unet, tanh", "--fractions", "0.6,1",
                              "--repeats", "2"])
    assert (args.command, args.models, args.fractions, args.repeats) == (
        "budgets", ["unet", "tanh"], [0.6, 1.0], 2)
    assert parser.parse_args(["explain", "--checkpoints", "budget:50%:milp"]).checkpoints == (
        "budget:50%:milp")
    defaults = parser.parse_args(["tradeoff"])
    assert defaults.models == [] and defaults.fractions == [0.75, 0.5, 0.35]


def test_plot_needs_matplotlib(monkeypatch):
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["scaling", "--plot", "scaling.png"])
    assert exit_info.value.code == 2


def test_every_command_has_a_parser_and_a_function():
    from memsave_grads.bench import commands  # pylint: disable=import-outside-toplevel
    assert [name for name, _, _ in cli._COMMANDS] == list(commands.COMMANDS)  # pylint: disable=protected-access


def test_cli_strategy_names_are_the_library_s():
    from memsave_grads._tf import selection  # pylint: disable=import-outside-toplevel
    assert sorted(cli.STRATEGY_NAMES) == sorted(selection.STRATEGIES)


def test_cli_explain_batch_is_the_library_s():
    from memsave_grads import _explain  # pylint: disable=import-outside-toplevel
    assert cli.EXPLAIN_BATCH == _explain.EXPLAINED_BATCH_SIZE


def test_models_filter_matches_names_without_building():
    specs = models.benchmark_models()
    assert len({spec.name for spec in specs}) == len(specs)
    assert [s.name for s in models.select(specs, ["unet"])] == ["U-Net depth=4 b=4 128x128"]
    assert {s.name for s in models.select(specs, ["RESNET"])} == {
        "ResNet50 b=8 128x128", "conv ResNet 16 blocks b=32 32x32"}
    assert models.select(specs, []) == specs
    assert models.unmatched_filters(specs, ["mlp", "vgg"]) == ["vgg"]


def test_environment_is_set_and_a_late_tensorflow_import_warned(monkeypatch):
    # TensorFlow is imported in this process: without the variable the allocator keeps no
    # statistics, which the command says (once) instead of re-executing itself.
    monkeypatch.delenv(measure.CPU_BFC_ENV, raising=False)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    with pytest.warns(RuntimeWarning, match="peak memory cannot be measured"):
        before = cli._prepare_environment("demo")  # pylint: disable=protected-access
    assert os.environ[measure.CPU_BFC_ENV] == "true"
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"  # the user's level wins
    cli._restore_environment(before)  # pylint: disable=protected-access
    assert measure.CPU_BFC_ENV not in os.environ and os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"


def test_main_in_process_warns_only_where_it_measures_peaks_and_keeps_the_environment(
        monkeypatch, capsys):
    """A command that builds graphs only says nothing of the allocator, and main() called in
    a process of the caller's leaves its environment as it found it."""
    monkeypatch.delenv(measure.CPU_BFC_ENV, raising=False)
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cli.main(["explain", "--models", "tanh MLP", "--format", "json"]) == 0
    assert '"plans"' in capsys.readouterr().out
    assert measure.CPU_BFC_ENV not in os.environ and "TF_CPP_MIN_LOG_LEVEL" not in os.environ


# cuInit's failure is an error line on every machine without a GPU driver, and says no more
# than the INFO line before it: it is hidden with the INFO lines. Other errors pass at level 2.
@pytest.mark.parametrize("level, kept", [("2", [4, 5, 6]), ("1", [0, 2, 4, 5, 6]),
                                         ("0", [0, 1, 2, 3, 4, 5, 6]), ("3", [5, 6])])
def test_start_up_noise_is_filtered_by_the_log_level(level, kept, monkeypatch, capfd):
    lines = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
        "I0000 00:00:1795411840.110411    5636 cudart_stub.cc:31] Could not find cuda drivers",
        "W0000 00:00:1795411840.110411    5636 some_file.cc:9] a warning",
        "E0000 00:00:1795411905.660503    6541 cuda_platform.cc:52] failed call to cuInit: "
        "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
        "E0000 00:00:1795411905.660503    6541 some_file.cc:52] a real error",
        "Traceback (most recent call last):",
        "UserWarning: the user's own warning",
    ]
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", level)
    with cli._start_up_noise_filtered():  # pylint: disable=protected-access
        os.write(2, ("\n".join(lines) + "\n").encode())
    err = capfd.readouterr().err
    assert err.splitlines() == [lines[i] for i in kept], err


def _logger_states():
    return [(logger.handlers[:], logger.level, logger.propagate)
            for logger in (logging.getLogger("memsave_grads"), tf.get_logger())]


@pytest.mark.parametrize("argv", [["explain", "-v"], ["-v", "explain"], ["explain"]])
def test_a_command_logs_once_to_stderr_and_leaves_the_loggers_as_they_were(
        argv, monkeypatch, capsys):
    from memsave_grads.bench import commands  # pylint: disable=import-outside-toplevel
    from tensorflow.python.platform import tf_logging  # pylint: disable=import-outside-toplevel

    def command(args):
        logging.getLogger("memsave_grads.api").debug("a debug line")
        logging.getLogger("memsave_grads.api").info("a progress line")
        tf_logging.warning("a deprecation")
        return 0

    monkeypatch.setitem(commands.COMMANDS, "explain", command)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    # A handler on the root logger, as absl's handler is once absl logging is used: it printed
    # TensorFlow's deprecation warnings a second time.
    root_handler = logging.StreamHandler(sys.stderr)
    logging.getLogger().addHandler(root_handler)
    try:
        before = _logger_states()
        assert cli.main(argv) == 0
        assert _logger_states() == before
    finally:
        logging.getLogger().removeHandler(root_handler)
    err = capsys.readouterr().err
    assert err.count("a deprecation") == 1, err
    assert err.count("a progress line") == 1 and "memsave_grads.api] a progress line" in err, err
    assert ("a debug line" in err) == ("-v" in argv), err
