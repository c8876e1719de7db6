"""calibrate_budget: budgets held against measured steps, on Keras models of both versions and
on a step function (the search itself: test_calibration_core.py)."""

import numpy as np
import pytest
import tensorflow as tf

import memsave_grads as mg
from children import ALLOCATOR_PREAMBLE, run_json
from keras_support import KERAS, bn_dropout_mlp, fresh_keras  # noqa: F401  (fixture)
from keras_support import one_flavour_by_default
from tf_builders import residual_mlp_step
from memsave_grads.keras import calibration as keras_calibration
from memsave_grads import measure

MIB = 2**20


def _values(variables):
    return [np.array(v.numpy()) for v in variables]


# keras3's measured calibration: tests/test_calibrated_wrap.py (fit holds a calibrated budget).
@one_flavour_by_default("keras2")
def test_a_keras_model_s_calibrated_budget_measures_within_what_was_asked(flavour):
    keras = KERAS[flavour]
    model = bn_dropout_mlp(keras)
    # Batch 1024: activations (~40 MiB plain) outweigh the weight gradients (4 MiB), which
    # tf_keras holds to the end; at batch 256 no plan measured below 67% of the plain step.
    x = np.random.default_rng(0).standard_normal((1024, 256)).astype("float32")
    y = np.zeros((1024, 10), "float32")
    before = _values(model.variables)

    budget = mg.calibrate_budget(model, "budget:50%", data=(x, y), runs=1)

    record = budget.calibration
    assert record.asked == mg.Budget(fraction=0.5)
    assert record.target_bytes == int(0.5 * record.plain_measured_bytes)
    assert record.batch_size == 1024  # what a step traced with a None batch is planned for
    held = record.held
    assert held is not None and held.measured_bytes <= record.target_bytes
    assert budget.fraction == held.planned_fraction
    # Measuring trained nothing: weights, batch-norm statistics and dropout seeds as before.
    for old, new in zip(before, _values(model.variables)):
        np.testing.assert_array_equal(old, new)
    # The same plan measured again, in a fresh trace, stays near what calibration saw (the
    # executor's order moves a peak by up to ~10%).
    again, _ = keras_calibration._calibration_measure(  # pylint: disable=protected-access
        model, 32, None, (x, y), runs=2, static_batch=False)
    again = again(budget)
    assert again <= 1.15 * record.target_bytes, (again / MIB, record)
    # And it trains under fit, planned for the batch size the calibration recorded.
    mg.wrap_model(model, budget)
    history = model.fit(x, y, batch_size=1024, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert model.train_step.traced_batch_size == 1024


def test_a_step_function_is_calibrated_with_tf_gradients_as_its_plain_step():
    width, depth = 256, 24   # weight gradients 6 MiB (returned, so held), activations ~70 MiB
    rng = np.random.default_rng(1)
    weights = [tf.Variable(rng.standard_normal((width, width)).astype("float32") / width**0.5)
               for _ in range(depth)]
    x = tf.constant(rng.standard_normal((2048, width)).astype("float32"))
    seen = []
    step = residual_mlp_step(x, weights, seen)

    # 50%: well above the smallest plan (~25%), so that a peak moved by a busy machine's
    # executor order (up to ~10%) still leaves plans to hold (0.4 failed once in CI).
    budget = mg.calibrate_budget(step, mg.Budget(fraction=0.5), runs=1)
    assert seen[0] is None and all(isinstance(s, mg.Budget) for s in seen[1:])
    record = budget.calibration
    assert record.held.measured_bytes <= record.target_bytes
    # The plain step holds every layer's activations: several MiB each; the plan far fewer.
    assert record.plain_measured_bytes > 20 * MIB
    # Calibrating a calibrated budget starts again from what was asked.
    again = mg.calibrate_budget(step, budget, runs=1)
    assert again.calibration.asked == mg.Budget(fraction=0.5)


def test_a_budget_no_plan_measures_within_is_refused_in_measured_terms():
    model = bn_dropout_mlp(KERAS["keras3"], depth=2, width=64)
    with pytest.raises(mg.InfeasibleBudgetError) as caught:
        mg.calibrate_budget(model, "budget:1%", batch_size=16, max_measurements=2)
    error = caught.value
    assert "of the plain tf.gradients step" in str(error)
    assert error.plain_peak_bytes and error.budget_bytes < error.plain_peak_bytes


@pytest.mark.parametrize("kwargs, kind, words", [
    (dict(model_or_step=3, budget="budget:50%"), mg.InvalidTypeError, "model_or_step"),
    (dict(budget="memory"), mg.InvalidTypeError, "budget"),
    (dict(budget=0.5), mg.InvalidTypeError, "budget"),
    (dict(budget="budget:50%", runs=0), mg.InvalidArgumentError, "runs"),
    (dict(budget="budget:50%", max_measurements=True), mg.InvalidArgumentError,
     "max_measurements"),
    (dict(budget="budget:50%", batch_size=0), mg.InvalidArgumentError, "batch_size"),
    (dict(model_or_step=lambda checkpoints: [], budget="budget:50%", batch_size=-5),
     mg.InvalidArgumentError, "batch_size"),
])
def test_bad_arguments_are_refused_before_anything_runs(kwargs, kind, words, monkeypatch):
    model = bn_dropout_mlp(KERAS["keras3"], depth=1, width=8)
    ran = []
    monkeypatch.setattr(measure, "step_peak_bytes", lambda *a, **k: ran.append(1))
    kwargs.setdefault("model_or_step", model)
    with pytest.raises(kind, match=words):
        mg.calibrate_budget(**kwargs)
    assert not ran


def test_without_allocator_statistics_it_says_how_to_switch_them_on():
    result = run_json(
        "import json, tensorflow as tf, memsave_grads as mg\n"
        "try:\n"
        "    mg.calibrate_budget(lambda c: [], 'budget:50%')\n"
        "    print(json.dumps({'raised': None}))\n"
        "except Exception as e:\n"
        "    print(json.dumps({'raised': type(e).__name__, 'ours': isinstance(e, "
        "mg.MemsaveGradsError), 'builtin': isinstance(e, RuntimeError), 'text': str(e)}))\n",
        preamble="import os\nos.environ.pop('TF_CPU_ALLOCATOR_USE_BFC', None)\n")
    assert result["raised"] == measure.AllocatorStatsUnavailableError.__name__, result
    assert result["ours"] and result["builtin"]
    assert "TF_CPU_ALLOCATOR_USE_BFC=true" in result["text"]
    assert ALLOCATOR_PREAMBLE  # the preamble the other tests' children use switches it on
