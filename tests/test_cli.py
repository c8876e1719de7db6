"""The command line (``python -m memsave_grads``), its measurement helpers, and the examples."""

import os
import pathlib
import subprocess
import sys

import pytest
import tensorflow as tf

from memsave_grads.bench import harness

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
    # Started without the allocator variable, as a user would: the command must re-execute
    # itself with TF_CPU_ALLOCATOR_USE_BFC=true (TensorFlow is imported with the package).
    proc = _run(["-m", "memsave_grads", *DEMO_SMALL], drop=["TF_CPU_ALLOCATOR_USE_BFC"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert ("| method | peak MiB | predicted MiB | vs tf.gradients | median step ms | "
            "time ratio | max rel grad err |") in out
    for label in ("| tf.gradients |", "| memsave_grads 'memory' |", "| memsave_grads 'speed' |"):
        assert label in out, out
    assert out.strip().splitlines()[-1].startswith("memsave_grads 'memory': ")
    assert "re-executed with TF_CPU_ALLOCATOR_USE_BFC=true" in proc.stderr


def test_unknown_command_is_a_usage_error():
    proc = _run(["-m", "memsave_grads", "nonsense"], env_overrides={
        "TF_CPU_ALLOCATOR_USE_BFC": "true"})
    assert proc.returncode != 0
    assert "expected one command" in proc.stderr


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
    assert scripts == set(SMALL_EXAMPLES) | {"session_loop.py", "tf_function_loop.py"}


def _elementwise_chain() -> harness.ModelSpec:
    """No matmul at all: the 'speed' strategy has nothing to keep."""

    def build():
        w = tf.Variable(tf.ones([64, 64]), name="w")
        h = w
        for _ in range(6):
            h = tf.tanh(h * 1.5)
        return tf.reduce_mean(tf.square(h)), [w]

    return harness.ModelSpec("elementwise chain", build)


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
    results = harness.measure_model(harness.residual_mlp(depth=6, width=32, batch=8), repeats=1)
    assert [r.method for r in results] == list(harness.DEFAULT_METHODS)
    for r in results:
        assert r.skipped is None and r.failed is None
        assert r.max_rel_error is not None and r.max_rel_error < 1e-5
        assert r.graph_ops > 0 and r.median_seconds > 0
    assert "| memsave_grads 'memory' |" in harness.demo_table(results)
    assert harness.summary_line(results, harness.MEMORY).startswith("memsave_grads 'memory': ")


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


def test_keras_models_build_and_explain():
    """Every Keras model of the benchmark builds in a graph and gets a plan that saves memory."""
    pytest.importorskip("tf_keras")
    import memsave_grads as mg  # pylint: disable=import-outside-toplevel
    from memsave_grads.bench import keras_models  # pylint: disable=import-outside-toplevel
    for name, build in keras_models.KERAS_MODELS.items():
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
