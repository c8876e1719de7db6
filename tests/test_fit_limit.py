"""fit-limit (memsave_grads/fit_limit.py): its search and table against fake tries, its
model argument, tries in their own capped processes, and the whole command (slow); and
explain(model) for Keras models."""

import dataclasses
import json
import subprocess
import sys

import keras
import tensorflow as tf
import pytest

import memsave_grads as mg
from memsave_grads import measure
from memsave_grads import fit_limit


def _fake(limit):
    """A try that fits up to ``limit`` and runs out of memory above it."""
    def try_size(size):
        if size <= limit:
            return fit_limit.Attempt("m", size, True, peak_bytes=size, step_seconds=0.1 * size)
        return fit_limit.Attempt("m", size, False, error="OOM", out_of_memory=True)
    return try_size


@pytest.mark.parametrize("limit", [1, 7, 8, 100, 1000])
def test_search_finds_the_largest_size_within_its_precision(limit):
    found = fit_limit.search("m", _fake(limit), start=1, maximum=4096)
    best = found.largest.size
    assert best <= limit and limit - best <= max(1, best // 16), (best, limit)
    assert all(a.size >= 1 for a in found.attempts)


def test_search_stops_at_a_failure_that_is_not_memory():
    def broken(size):
        return fit_limit.Attempt("m", size, False, error="ValueError: bad model")
    found = fit_limit.search("m", broken, start=8, maximum=64)
    assert found.largest is None and found.failure == "ValueError: bad model"
    assert "ValueError" in fit_limit.table([found], "batch", 100)


def test_the_table_compares_with_the_reference_and_names_it():
    plain = fit_limit.search(fit_limit.PLAIN, _fake(10), 1, 4096)
    ours = fit_limit.search("memory", _fake(40), 1, 4096)
    text = fit_limit.table([plain, ours], "batch", 100, baseline="stock fit")
    ratio = ours.largest.size / plain.largest.size
    assert f"| {ratio:.2f}x |" in text
    assert "| stock fit |" in text and "vs stock fit" in text and "tf.gradients" not in text
    # Without a timing run, no time ratio: times of separate processes are not compared.
    assert "| - |" in text.splitlines()[-1]


def test_a_size_ratio_that_is_a_bound_says_so():
    plain = fit_limit.search(fit_limit.PLAIN, _fake(10), 1, 64)
    reached = fit_limit.search("memory", _fake(1000), 1, 64)   # still fit at --max
    assert reached.reached_max and reached.largest_text == ">= 64"
    row = fit_limit.table([plain, reached], "batch", 100).splitlines()[-1]
    assert f"| >= {64 / plain.largest.size:.2f}x |" in row
    # The reference at --max: the ratio is an upper bound; both there: no ratio at all.
    assert fit_limit.ratio_text(0.5, at_least=False, at_most=True) == "<= 0.50x"
    assert fit_limit.ratio_text(1.0, at_least=True, at_most=True) == "-"


def test_time_ratios_are_the_median_of_rounds_run_in_one_process():
    plain = fit_limit.search(fit_limit.PLAIN, _fake(10), 1, 4096)
    ours = fit_limit.search("memory", _fake(40), 1, 4096)
    timing = fit_limit.Timing("memory", 1.21, 1.1, 1.4)
    row = fit_limit.table([plain, ours], "batch", 100, [timing]).splitlines()[-1]
    assert "| 1.21x (1.10-1.40) |" in row


def test_methods_are_timed_against_the_reference_in_one_process():
    """A real timing run: both steps built in one fresh process, one step each per round."""
    step = f"{MODELS}:tanh_chain_step"
    reference = fit_limit.Attempt(fit_limit.PLAIN, 64, True, peak_bytes=1, step_seconds=1.0)
    ours = fit_limit.Attempt("memory", 128, True, peak_bytes=1, step_seconds=1.0)
    timings, why = fit_limit.time_against(step, reference, [ours], rounds=3)
    assert not why and [t.method for t in timings] == ["memory"]
    timing = timings[0]
    assert 0 < timing.lowest <= timing.ratio <= timing.highest


def _tries(*outcomes):
    """Fake tries of one size, handed out in order; the list keeps what was not yet tried."""
    queue = list(outcomes)
    return queue, lambda: queue.pop(0)


def test_a_size_fits_only_if_every_try_fits():
    fit = [fit_limit.Attempt("m", 64, True, peak_bytes=p, step_peak_bytes=p - 10,
                             step_seconds=s) for p, s in [(500, 3.0), (520, 1.0), (510, 1.5)]]
    _, try_once = _tries(*fit)
    seen = []
    outcome = fit_limit.attempt_repeatedly(try_once, 3, on_try=lambda a, i: seen.append(i))
    assert outcome.fits and outcome.tries == 3 and seen == [1, 2, 3]
    assert outcome.peak_bytes == 520 and outcome.step_peak_bytes == 510   # the worst try's
    assert outcome.step_seconds == 1.5                    # the median try's, not the mean
    assert "fits in all 3 tries" in fit_limit.progress_line(outcome, "batch")
    # The reference method named as the table names it (Keras' own step: "stock fit").
    plain = dataclasses.replace(outcome, method=fit_limit.PLAIN)
    assert fit_limit.progress_line(plain, "batch", "stock fit").startswith("stock fit: ")
    assert fit_limit.attempt_repeatedly(lambda: fit[0], 1) == fit[0]   # one try: as it came

    out = fit_limit.Attempt("m", 64, False, error="OOM when allocating", out_of_memory=True)
    left, try_once = _tries(fit[0], out, fit[1])
    outcome = fit_limit.attempt_repeatedly(try_once, 3)
    assert not outcome.fits and outcome.out_of_memory and outcome.tries == 2
    assert outcome.error == "try 2 of 3 (after 1 that fit): OOM when allocating"
    assert left == [fit[1]]   # no try after the first that ran out
    assert fit_limit.attempt_repeatedly(lambda: out, 1) == out


def test_a_step_peak_unknown_in_any_try_stays_unknown():
    tries = [fit_limit.Attempt("m", 8, True, peak_bytes=5, step_peak_bytes=b, step_seconds=1.0)
             for b in (3, None)]
    _, try_once = _tries(*tries)
    assert fit_limit.attempt_repeatedly(try_once, 2).step_peak_bytes is None


def test_the_command_tries_each_size_as_often_as_asked(monkeypatch, capsys):
    """The command line to the search: --tries 2 runs two processes per size, and a size one
    of them ran out on is not the answer (fake tries instead of processes)."""
    calls = []

    def fake_attempt(source, method, batch_size, limit_mib, sequence_length=None, steps=3,
                     reserve_limit=False):
        assert reserve_limit  # --reserve-limit reaches every try
        calls.append((method, batch_size))
        fits = batch_size <= 16 or (batch_size <= 20 and calls.count((method, batch_size)) == 1)
        return (fit_limit.Attempt(method, batch_size, True, peak_bytes=batch_size * 2**20,
                                  step_peak_bytes=batch_size, step_seconds=0.01 * batch_size)
                if fits else fit_limit.Attempt(method, batch_size, False, error="OOM",
                                               out_of_memory=True))

    monkeypatch.setattr(fit_limit, "attempt", fake_attempt)
    monkeypatch.setattr(fit_limit, "check", lambda *a, **k: {"kind": "keras", "keras": "?"})
    monkeypatch.setattr(fit_limit, "time_against", lambda source, reference, others, **k: (
        [fit_limit.Timing(a.method, 1.2, 1.1, 1.3) for a in others], ""))
    from memsave_grads import cli  # pylint: disable=import-outside-toplevel
    from memsave_grads.bench import commands  # pylint: disable=import-outside-toplevel
    args = cli.build_parser().parse_args([
        "fit-limit", f"{MODELS}:residual_mlp", "--limit-mib", "64", "--checkpoints", "memory",
        "--start", "8", "--max", "64", "--tries", "2", "--reserve-limit"])
    assert commands.fit_limit_command(args) == 0
    table = capsys.readouterr().out
    assert "a size fits if all 2 tries fit, the limit reserved as one region" in table
    for method in (fit_limit.PLAIN, "memory"):
        sizes = [size for m, size in calls if m == method]
        assert sizes.count(8) == 2 and sizes.count(16) == 2     # every fitting size twice
        assert sizes.count(32) == 1                              # no second try after a failure
    rows = [line for line in table.splitlines() if line.startswith("| stock fit")]
    assert rows and rows[0].split("|")[2].strip() == "16"   # not a lucky 17-20


def _command(monkeypatch, argv, attempt, checked):
    monkeypatch.setattr(fit_limit, "attempt", attempt)
    monkeypatch.setattr(fit_limit, "check", lambda *a, **k: checked)
    monkeypatch.setattr(fit_limit, "time_against", lambda *a, **k: ([], "not timed"))
    from memsave_grads import cli  # pylint: disable=import-outside-toplevel
    from memsave_grads.bench import commands  # pylint: disable=import-outside-toplevel
    return commands, cli.build_parser().parse_args(["fit-limit", f"{MODELS}:residual_mlp", *argv])


def test_fit_limit_json_has_every_try_and_the_timings(monkeypatch, capsys):
    def fits_to_16(source, method, batch_size, *a, **k):
        if batch_size <= (16 if method == fit_limit.PLAIN else 64):
            return fit_limit.Attempt(method, batch_size, True, peak_bytes=batch_size,
                                     step_seconds=0.01)
        return fit_limit.Attempt(method, batch_size, False, error="OOM", out_of_memory=True)
    commands, args = _command(monkeypatch, ["--limit-mib", "100", "--max", "64", "--format",
                                            "json"], fits_to_16, {"kind": "step"})
    monkeypatch.setattr(fit_limit, "time_against", lambda source, reference, others, **k: (
        [fit_limit.Timing(a.method, 1.2, 1.1, 1.3) for a in others], ""))
    assert commands.fit_limit_command(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["reference"] == "tf.gradients" and data["limit_mib"] == 100
    plain, ours = data["methods"]
    assert plain["largest"] == 16 and not plain["lower_bound"]
    assert ours["largest"] == 64 and ours["lower_bound"] and ours["size_ratio"] == 4.0
    assert [a["size"] for a in ours["attempts"]] == [8, 16, 32, 64]
    assert data["timings"] == [{"method": "memory", "ratio": 1.2, "lowest": 1.1,
                                "highest": 1.3}]


def test_fit_limit_json_names_a_keras_reference_as_its_table_does(monkeypatch, capsys):
    def fits_to_16(source, method, batch_size, *a, **k):
        fits = batch_size <= (16 if method == fit_limit.PLAIN else 32)
        return fit_limit.Attempt(method, batch_size, fits, peak_bytes=batch_size,
                                 step_seconds=0.01, error="" if fits else "OOM",
                                 out_of_memory=not fits)
    commands, args = _command(monkeypatch, ["--limit-mib", "100", "--max", "64", "--format",
                                            "json"], fits_to_16,
                              {"kind": "keras", "keras": "Keras 3", "weights_bytes": 0,
                               "optimizer_state_bytes": 0})
    assert commands.fit_limit_command(args) == 0
    data = json.loads(capsys.readouterr().out)
    plain, ours = data["methods"]
    assert data["reference"] == plain["method"] == "stock fit"
    assert {a["method"] for a in plain["attempts"]} == {"stock fit"}
    assert ours["method"] == "memory" and ours["size_ratio"] == 2.0


def test_weights_and_optimizer_state_over_the_limit_are_refused_before_any_try(monkeypatch):
    tried = []
    commands, args = _command(
        monkeypatch, ["--limit-mib", "100"], lambda *a, **k: tried.append(a),
        {"kind": "keras", "keras": "Keras 3", "weights_bytes": 60 * 2**20,
         "optimizer_state_bytes": 60 * 2**20})
    with pytest.raises(commands.CommandLineError,
                       match=r"weights \(60 MiB\) and its optimizer's state \(60 MiB\) "
                             r"alone take 120 MiB, more than the limit of 100 MiB"):
        commands.fit_limit_command(args)
    assert not tried


def test_nothing_fitting_is_a_failed_command(monkeypatch, caplog):
    def never(source, method, batch_size, *a, **k):
        return fit_limit.Attempt(method, batch_size, False, error="OOM", out_of_memory=True)
    commands, args = _command(monkeypatch, ["--limit-mib", "100", "--start", "4"], never,
                              {"kind": "step"})
    with caplog.at_level("ERROR"):
        assert commands.fit_limit_command(args) == 1
    assert "nothing fit under 100 MiB, not even batch 1" in caplog.text


def test_nothing_fitting_for_an_error_is_not_told_as_memory(monkeypatch, caplog):
    """Every try failing in the step (a model the made-up batch does not fit) is not the
    limit: the error says so, and what failed."""
    def failing(source, method, batch_size, *a, **k):
        return fit_limit.Attempt(method, batch_size, False, error="ValueError: the structure")
    commands, args = _command(monkeypatch, ["--limit-mib", "100", "--start", "4"], failing,
                              {"kind": "step"})
    with caplog.at_level("ERROR"):
        assert commands.fit_limit_command(args) == 1
    assert "no try ran out of memory: every one failed (batch 4: ValueError: the structure)" \
        in caplog.text and "not even" not in caplog.text


def test_tries_must_be_positive(capsys):
    from memsave_grads import cli  # pylint: disable=import-outside-toplevel
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(
            ["fit-limit", f"{MODELS}:residual_mlp", "--limit-mib", "64", "--tries", "0"])
    assert "--tries" in capsys.readouterr().err


def test_a_search_with_repeated_tries_stops_below_a_size_that_fits_only_sometimes():
    """A size that fits in one process and runs out in the next is not the answer."""
    flaky = {}

    def try_once(size):
        flaky[size] = flaky.get(size, 0) + 1
        fits = size <= 40 or (size <= 48 and flaky[size] % 2 == 1)   # 41-48: every other try
        return (fit_limit.Attempt("m", size, True, peak_bytes=size, step_seconds=1.0) if fits
                else fit_limit.Attempt("m", size, False, error="OOM", out_of_memory=True))

    once = fit_limit.search("m", try_once, 8, 4096)
    flaky.clear()
    every = fit_limit.search(
        "m", lambda size: fit_limit.attempt_repeatedly(lambda: try_once(size), 2), 8, 4096)
    assert once.largest.size > 40           # one lucky try counts
    assert 38 <= every.largest.size <= 40   # within 1/16 of the size that always fits
    assert every.largest.tries == 2


def test_a_bad_model_argument_says_what_it_may_be(tmp_path):
    for bad in ["nothing_here", str(tmp_path / "missing.py") + ":f", "a b:c"]:
        with pytest.raises(ValueError, match="expected a .keras"if ".py" not in bad else
                           "does not exist"):
            fit_limit.describe_source(bad)
    assert fit_limit.describe_source("my.module:build") == "function"


def _classifier():
    inputs = keras.Input((16,))
    h = inputs
    for _ in range(8):
        h = h + keras.layers.Dense(16, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(5)(h))
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_explain_model_plans_the_training_step_without_running_it():
    model = _classifier()
    before = [w.numpy().copy() for w in model.trainable_weights]
    report = mg.explain(model, checkpoints="memory", batch_size=64)
    assert report.forward_ops > 0 and report.predicted_peak_bytes < report.predicted_plain_peak_bytes
    assert all((w.numpy() == b).all() for w, b in zip(model.trainable_weights, before))
    x, y = mg.keras.synthetic_batch(model, 4)
    assert x.shape == (4, 16) and y.shape == (4,) and y.max() < 5
    model.train_on_batch(x, y)   # the made-up batch trains


def test_explain_model_with_a_dict_of_inputs():
    """keras_hub's task models take {"token_ids": ..., "padding_mask": ...}: the made-up batch
    is a dict too (a list was refused by Keras 3, so explain and fit-limit failed)."""
    ids = keras.Input((None,), dtype="int32", name="token_ids")
    mask = keras.Input((None,), dtype="int32", name="padding_mask")
    h = keras.layers.Embedding(50, 8)(ids) * keras.ops.expand_dims(
        keras.ops.cast(mask, "float32"), -1)
    h = h + keras.layers.Dense(8, activation="tanh")(h)
    model = keras.Model({"token_ids": ids, "padding_mask": mask}, keras.layers.Dense(50)(h))
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    report = mg.explain(model, batch_size=4, sequence_length=16)
    assert report.forward_ops > 0
    x, y = mg.keras.synthetic_batch(model, 4, 16)
    assert sorted(x) == ["padding_mask", "token_ids"] and x["token_ids"].shape == (4, 16)
    assert x["token_ids"].min() >= 1 and x["token_ids"].max() < 50 and y.shape == (4, 16)
    model.train_on_batch(x, y)


def test_explain_model_refuses_bad_input():
    model = _classifier()
    with pytest.raises(mg.InvalidTypeError, match="batch_size"):
        mg.explain(model, batch_size="64")
    with pytest.raises(mg.InvalidArgumentError, match="batch_size"):
        mg.explain(model, batch_size=0)
    with pytest.raises(mg.InvalidArgumentError, match="xs"):
        mg.explain(model, model.trainable_weights)
    with pytest.raises(mg.InvalidTypeError, match="release_gradients_early: expected True"):
        mg.explain(model, release_gradients_early="yes")
    loss = tf.constant(1.0)
    with pytest.raises(mg.InvalidArgumentError, match="release_gradients_early: applies to"):
        mg.explain(loss, [loss], release_gradients_early=True)
    # The sizes of a model's step, given where nothing uses them (they were ignored).
    for sizes in ({"batch_size": 5}, {"sequence_length": 8}, {"data": (tf.ones((2, 16)),) * 2}):
        name = next(iter(sizes))
        with pytest.raises(mg.InvalidArgumentError, match=f"{name}: sizes the training step "
                           "of a Keras model"):
            mg.explain(loss, [loss], **sizes)
    data = mg.keras.synthetic_batch(model, 4)
    for sizes in ({"batch_size": 16}, {"sequence_length": 8}):
        name = next(iter(sizes))
        with pytest.raises(mg.InvalidArgumentError,
                           match=f"{name}: the batch of data=\\(x, y\\) has its own shapes"):
            mg.explain(model, data=data, **sizes)
    assert mg.explain(model, data=data).forward_ops > 0


def _wide(optimizer):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((512,))
    h = inputs
    for _ in range(4):
        h = keras.layers.Dense(512, activation="tanh")(h)   # 1 MiB of weights each
    model = keras.Model(inputs, h)
    model.compile(optimizer, "mse", jit_compile=False)   # "auto" is XLA where a GPU is
    return model


def test_explain_model_holds_the_weight_gradients_where_the_step_does():
    """Where the optimizer needs every gradient at once (global_clipnorm), the step holds the
    4 MiB of weight gradients to the end of the backward pass, and the prediction counts them;
    where each update waits for its own gradient (the default step), they come and go."""
    weights_mib = 4
    held = mg.explain(_wide(keras.optimizers.SGD(global_clipnorm=1.0)), batch_size=2)
    ordered = mg.explain(_wide(keras.optimizers.SGD()), batch_size=2)
    early = mg.explain(_wide(keras.optimizers.SGD()), batch_size=2,
                       release_gradients_early=True)
    # What wrap_model(..., release_gradients_early=True) refuses, explain refuses too.
    with pytest.raises(mg.InvalidArgumentError, match="global_clipnorm"):
        mg.explain(_wide(keras.optimizers.SGD(global_clipnorm=1.0)), batch_size=2,
                   release_gradients_early=True)
    # Held: all four gradients at the last step. Otherwise: one gradient and its update's
    # copy-on-write copy at a time (2 MiB), beside activations of a few KiB.
    assert held.predicted_plain_peak_bytes >= weights_mib * measure.MIB
    for other in (ordered, early):
        assert other.predicted_plain_peak_bytes <= 2.25 * measure.MIB, other


MODELS = f"{__file__.rsplit('/', 1)[0]}/fit_limit_models.py"


def test_a_try_in_its_own_process_fits_or_runs_out_of_memory_under_the_cap():
    """Each try is a fresh process with the CPU BFC allocator capped: the one that fits reports
    a peak under the cap; one far too large is reported as out of memory, not as an error."""
    step = f"{MODELS}:tanh_chain_step"
    fits = fit_limit.attempt(step, "memory", 64, limit_mib=48, steps=1)
    assert fits.fits, fits
    assert 0 < fits.peak_bytes <= 48 * measure.MIB and fits.step_seconds > 0
    assert 0 < fits.step_peak_bytes < fits.peak_bytes  # the weights were in use before
    too_large = fit_limit.attempt(step, fit_limit.PLAIN, 8192, limit_mib=48, steps=1)
    assert not too_large.fits and too_large.out_of_memory, too_large


_REGIONS = """
import json, sys
import tensorflow as tf
from memsave_grads import measure
reserved = measure.reserve_cpu_heap(64 * measure.MIB) if sys.argv[1] == "reserve" else None
def make(mib):
    with tf.device("CPU:0"):
        return tf.raw_ops.Empty(shape=[mib * 2**18], dtype=tf.float32, init=True)
held = [make(mib) for mib in (1, 3, 7, 15, 31)]
del held
try:
    fits = make(40) is not None
except tf.errors.ResourceExhaustedError:
    fits = False
print(json.dumps({"reserved": reserved, "fits": fits}))
"""


@pytest.mark.parametrize("reserve", [False, True])
def test_a_capped_cpu_allocator_needs_its_limit_as_one_region(reserve):
    """Why ``--reserve-limit``: capped at 64 MiB, the CPU allocator grows a region per tensor
    (2, 4, 8, 16, 32 MiB), keeps them, and cannot place 40 MiB in 62 free MiB split among
    them; with the limit reserved as one region first (as on a GPU without memory growth) the
    same tensors are cut from it and 40 MiB fits."""
    import children  # pylint: disable=import-outside-toplevel
    result = children.run_json(_REGIONS, "reserve" if reserve else "grow",
                               env={fit_limit.CPU_LIMIT_ENV: "64"},
                               preamble=children.ALLOCATOR_PREAMBLE)
    assert result == {"reserved": True if reserve else None, "fits": reserve}


def test_a_try_reserves_the_limit_only_when_asked(monkeypatch):
    """``attempt(..., reserve_limit=True)`` asks the child to reserve; by default it does not
    (the README's fit-limit rows were measured with a growing allocator)."""
    from memsave_grads import _child as child  # pylint: disable=import-outside-toplevel
    requests = []

    def fake_run(module, request, env=None, timeout_s=None):
        requests.append(request)
        return child.ChildRun({"fits": True, "peak_bytes": 1, "step_seconds": 1.0}, 0, "")

    monkeypatch.setattr(child, "run", fake_run)
    fit_limit.attempt("m.py:f", "memory", 64, limit_mib=600)
    fit_limit.attempt("m.py:f", "memory", 64, limit_mib=600, reserve_limit=True)
    assert [r["reserve_limit"] for r in requests] == [False, True]


@pytest.mark.parametrize("limit_mib, reserved", [(4096, [4096 * 2**20]), (None, [])])
def test_the_child_reserves_its_cpu_limit_when_asked(monkeypatch, limit_mib, reserved):
    """The child's side: a capped try asked to reserve takes its limit, in bytes, before the
    step runs; the uncapped retry of a crash (no limit) reserves nothing (in this process,
    with the reservation recorded instead of made)."""
    calls = []
    monkeypatch.setattr(measure, "reserve_cpu_heap", calls.append)
    result = fit_limit._try_here({  # pylint: disable=protected-access
        "source": f"{MODELS}:tanh_chain_step", "method": fit_limit.PLAIN, "batch_size": 4,
        "sequence_length": None, "limit_mib": limit_mib, "steps": 1, "reserve_limit": True})
    assert result["fits"], result
    assert calls == reserved


@pytest.mark.parametrize("uncapped_fits", [True, False])
def test_a_crash_under_the_cap_is_memory_only_if_the_try_runs_without_it(monkeypatch,
                                                                          uncapped_fits):
    """TensorFlow's oneDNN kernels segfault where the capped allocator refuses them (Keras 3
    ResNet50 at batch 64 under 600 MiB): such a try is out of memory if it runs uncapped, a
    failure (which stops the search) if it crashes there too. The child's last stderr line is
    then TensorFlow's last log line, so the signal is reported instead."""
    from memsave_grads import _child as child  # pylint: disable=import-outside-toplevel
    calls = []

    def fake_run(module, request, env=None, timeout_s=None):
        calls.append((request["limit_mib"], env))
        if request["limit_mib"] is None and uncapped_fits:
            return child.ChildRun({"fits": True, "peak_bytes": 1, "step_seconds": 1.0}, 0, "")
        return child.ChildRun(None, -11, "E0000 cuda_platform.cc:52] failed call to cuInit\n")

    monkeypatch.setattr(child, "run", fake_run)
    outcome = fit_limit.attempt("m.py:f", "memory", 64, limit_mib=600)
    assert calls == [(600, {fit_limit.CPU_LIMIT_ENV: "600"}),
                     (None, {fit_limit.CPU_LIMIT_ENV: None})]
    assert not outcome.fits and outcome.out_of_memory == uncapped_fits
    assert "killed by SIGSEGV" in outcome.error and "cuInit" not in outcome.error.split("(")[0]


@pytest.mark.slow
def test_fit_limit_command_finds_a_larger_batch_with_memsave(tmp_path):
    """The whole command, as a user runs it: the table and the PNG; under a 32 MiB cap the
    "memory" plan trains a larger batch than tf.gradients (measured: 400-odd vs 1000-odd)."""
    png = tmp_path / "fit.png"
    proc = subprocess.run(
        [sys.executable, "-m", "memsave_grads", "fit-limit", f"{MODELS}:residual_mlp",
         "--limit-mib", "32",
         "--checkpoints", "memory", "--start", "128", "--max", "4096", "--steps", "1",
         "--plot", str(png), "--output", str(tmp_path / "fit.md")],
        capture_output=True, text=True, check=False, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines()
            if line.startswith("|") and "---" not in line}
    assert set(rows) >= {"tf.gradients", '"memory"'} or set(rows) >= {"tf.gradients", "memory"}, \
        proc.stdout
    sizes = {name: int(line.split("|")[2]) for name, line in rows.items()
             if name in ("tf.gradients", "memory", '"memory"')}
    plain, ours = sizes.pop("tf.gradients"), sizes.popitem()[1]
    assert ours >= 1.5 * plain, proc.stdout
    assert png.stat().st_size > 1000
    assert "tf.gradients" in (tmp_path / "fit.md").read_text()


@pytest.mark.parametrize("name,kwargs", [
    ("resnet50", {"image_size": 32}), ("resnet50_tf_keras", {"image_size": 32}),
    ("transformer_encoder", {"layers": 1, "sequence": 16}),
    ("gpt_decoder", {"layers": 1, "sequence": 16}), ("lstm", {"steps": 6, "units": 8}),
    ("efficientnet_b0", {"image_size": 32}), ("convnext_tiny", {"image_size": 32})])
def test_the_readme_models_build_and_plan(name, kwargs):
    """memsave_grads.bench.fit_limit_models (the README headline's models, named as a module of
    the installed package), smaller: each builds a compiled Keras model (3, or tf_keras) whose
    training step memsave_grads plans (traced, not run)."""
    source = f"memsave_grads.bench.fit_limit_models:{name}"
    model = fit_limit._load_function(source)(2, **kwargs)  # pylint: disable=protected-access
    report = mg.explain(model, batch_size=2)
    assert report.forward_ops > 10 and report.predicted_plain_peak_bytes > 0, report


def test_a_keras_failure_is_reported_by_its_cause():
    wrapped = ValueError("Exception encountered when calling Functional.call().\n\n"
                         "\x1b[1mThe custom_gradient decorator currently supports keywords "
                         "arguments only when eager execution is enabled.\x1b[0m\n\n"
                         "Arguments received by Functional.call():\n  \u2022 training=True")
    assert fit_limit._error_line(wrapped) == (  # pylint: disable=protected-access
        "The custom_gradient decorator currently supports keywords arguments only when eager "
        "execution is enabled. (in Functional.call())")
    assert fit_limit._error_line(RuntimeError("plain\nmore")) == "plain"  # pylint: disable=protected-access


def test_a_try_with_early_release_wraps_the_model_so(monkeypatch):
    """`--release-gradients-early` adds "<strategy> + early release": the try (here in this
    process) wraps the Keras model with release_gradients_early=True; a step callable is told
    that early release is for Keras models."""
    from memsave_grads import api  # pylint: disable=import-outside-toplevel
    from memsave_grads import keras as keras_lib  # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(api, "gradients_or_fallback", api.gradients_or_fallback)  # restored
    wrapped = []
    real_wrap = keras_lib.wrap_model
    monkeypatch.setattr(mg, "wrap_model", lambda model, **kw: wrapped.append(kw) or real_wrap(
        model, **kw))
    request = {"source": f"{MODELS}:residual_mlp", "batch_size": 8, "sequence_length": None,
               "limit_mib": 4096, "steps": 1, "method": "memory" + fit_limit.EARLY_RELEASE}
    result = fit_limit._try_here(request)  # pylint: disable=protected-access
    assert result["fits"], result
    assert wrapped == [{"checkpoints": "memory", "fallback": "warn",
                        "release_gradients_early": True}]
    step = dict(request, source=f"{MODELS}:tanh_chain_step")
    assert "Keras models only" in fit_limit._try_here(step)["error"]  # pylint: disable=protected-access



_SEQUENCE_MODELS = """
import keras


def _model(length):
    inputs = keras.Input((length, 4))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(
        keras.layers.Dense(8)(inputs))))
    model.compile(optimizer="sgd", loss="mse")
    return model


def sized(batch_size, sequence_length=16):
    return _model(sequence_length)


def fixed(batch_size, sequence_length=16):
    return _model(16)   # ignores sequence_length


def even(batch_size, sequence_length=16):
    if sequence_length % 2:
        raise ValueError("sequence_length: expected an even number")
    return _model(sequence_length)
"""


def test_a_builder_that_ignores_the_sequence_length_is_told(tmp_path):
    """--vary sequence over a builder that gives the same batch at every length would measure
    one model over and over (it reported a length it never tried)."""
    from memsave_grads import cli  # pylint: disable=import-outside-toplevel
    from memsave_grads.bench import commands  # pylint: disable=import-outside-toplevel
    source = tmp_path / "sequence_models.py"
    source.write_text(_SEQUENCE_MODELS)
    request = {"check": True, "batch_size": 2, "sequence_length": 8}
    check = fit_limit._check_here  # pylint: disable=protected-access
    assert check(dict(request, source=f"{source}:fixed"))["ignores_sequence_length"] is True
    assert check(dict(request, source=f"{source}:sized"))["ignores_sequence_length"] is False
    assert "ignores_sequence_length" not in check(dict(request, source=f"{source}:sized",
                                                        sequence_length=None))
    # A builder refusing the next length is not told apart, nor failed for it.
    assert "ignores_sequence_length" not in check(dict(request, source=f"{source}:even"))
    args = cli.build_parser().parse_args(
        ["fit-limit", f"{source}:fixed", "--vary", "sequence", "--start", "8", "--max", "64",
         "--limit-mib", "512"])
    with pytest.raises(commands.CommandLineError, match="gives the same batch shapes at lengths "
                       "8 and 9: its builder ignores sequence_length"):
        commands._check_fit_limit_model(args)  # pylint: disable=protected-access

_BAD_MODELS = '''
import keras


def _dense():
    inputs = keras.Input((8,))
    return keras.Model(inputs, keras.layers.Dense(2)(inputs))


def not_a_model(batch_size):
    return 42


def uncompiled(batch_size):
    return _dense()


def frozen(batch_size):
    model = _dense()
    model.trainable = False
    model.compile("sgd", "mse")
    return model


def broken(batch_size):
    raise RuntimeError("a bug in the user's builder, said in full " + "x" * 200)
'''


@pytest.mark.parametrize("name,match", [
    ("not_a_model", "InvalidTypeError: model: expected a Keras Model .* got builtins.int: 42"),
    ("uncompiled", "the model is not compiled .* Call model.compile"),
    ("frozen", "has no trainable weights .* Set trainable=True"),
    ("broken", "RuntimeError: a bug in the user's builder, said in full x{200}"),
    ("missing", "has no attribute 'missing'")])
def test_a_model_that_cannot_train_is_one_usage_error_before_any_try(name, match, tmp_path,
                                                                       monkeypatch, capsys):
    """fit-limit builds the model once (in a fresh process) before searching: a model that
    cannot train at all is one error, whole, exit status 2, not every method's row."""
    from memsave_grads import cli  # pylint: disable=import-outside-toplevel
    source = tmp_path / "user_models.py"
    source.write_text(_BAD_MODELS)
    monkeypatch.setattr(fit_limit, "attempt", lambda *a, **k: pytest.fail("a try was run"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit-limit", f"{source}:{name}", "--limit-mib", "64"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "fit-limit: error: argument MODEL: building" in err
    assert __import__("re").search(match, err), err


def test_explain_of_a_model_that_cannot_train_is_a_usage_error(tmp_path, capsys):
    from memsave_grads import cli  # pylint: disable=import-outside-toplevel
    source = tmp_path / "user_models.py"
    source.write_text(_BAD_MODELS)
    for name, match in [("frozen", "no trainable weights"), ("broken", "RuntimeError: a bug"),
                        ("uncompiled", "not compiled"), ("nowhere", "has no attribute")]:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["explain", "--model", f"{source}:{name}", "--batch", "4"])
        assert exit_info.value.code == 2
        assert match in capsys.readouterr().err


def test_explain_refuses_a_model_that_cannot_train():
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    with pytest.raises(mg.InvalidArgumentError, match="explain: the model is not compiled"):
        mg.explain(model, batch_size=4)
    model.trainable = False
    model.compile("sgd", "mse")
    with pytest.raises(mg.InvalidArgumentError, match="explain: .* has no trainable weights"):
        mg.explain(model, batch_size=4)


def test_h5_files_load_with_the_keras_that_can_train_them(tmp_path):
    """An .h5 tf_keras saved loads with tf_keras; one Keras 3 saved is refused with the remedy
    (Keras 3.15's legacy loader builds the optimizer for other variables: the first step fails
    with 'Unknown variable')."""
    tf_keras = pytest.importorskip("tf_keras")
    inputs = tf_keras.Input((8,))
    old = tf_keras.Model(inputs, tf_keras.layers.Dense(2)(inputs))
    old.compile("sgd", "mse")
    old.save(tmp_path / "old.h5")
    assert fit_limit.describe_source(str(tmp_path / "old.h5")) == "tf_keras h5"
    kind, model, (x, y) = fit_limit.build(str(tmp_path / "old.h5"), 4)
    assert kind == "keras" and x.shape == (4, 8)
    model.train_on_batch(x, y)
    inputs = keras.Input((8,))
    new = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    new.compile("sgd", "mse")
    new.save(tmp_path / "new.h5")
    with pytest.raises(ValueError, match=r"saved by Keras 3.* model.save\('model.keras'\)"):
        fit_limit.describe_source(str(tmp_path / "new.h5"))
    with pytest.raises(ValueError, match="does not exist"):
        fit_limit.describe_source(str(tmp_path / "missing.keras"))


@pytest.mark.parametrize("flags,match", [
    (["--plot", "fit.txt"], "--plot: expected a file name ending in an image format"),
    (["--start", "64", "--max", "8"], "--start: expected at most --max"),
])
def test_fit_limit_flags_that_contradict_are_usage_errors(flags, match, capsys):
    from memsave_grads import cli  # pylint: disable=import-outside-toplevel
    if "--plot" in flags:
        pytest.importorskip("matplotlib")   # without it, --plot is refused for that
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit-limit", f"{MODELS}:residual_mlp", "--limit-mib", "64", *flags])
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


def test_methods_the_model_cannot_have_are_refused_before_any_try(monkeypatch, capsys):
    """--keras-remat is Keras 3's, early release is for Keras models: asked for a training step
    function, the command says so instead of reporting a failed row."""
    from memsave_grads import cli  # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(fit_limit, "attempt", lambda *a, **k: pytest.fail("a try was run"))
    monkeypatch.setattr(fit_limit, "check", lambda *a, **k: {"kind": "step"})
    for flag in ("--keras-remat", "--release-gradients-early"):
        with pytest.raises(SystemExit):
            cli.main(["fit-limit", f"{MODELS}:tanh_chain_step", "--limit-mib", "64", flag])
        assert f"argument {flag}: " in capsys.readouterr().err
    monkeypatch.setattr(fit_limit, "check",
                        lambda *a, **k: {"kind": "keras", "keras": mg.keras.KERAS2})
    with pytest.raises(SystemExit):
        cli.main(["fit-limit", f"{MODELS}:residual_mlp", "--limit-mib", "64", "--keras-remat"])
    assert "keras.RematScope is Keras 3's" in capsys.readouterr().err


def test_the_table_says_per_position_where_the_sequence_varies():
    search = fit_limit.Search("tf.gradients", [fit_limit.Attempt(
        "tf.gradients", 64, True, peak_bytes=2**20, step_seconds=0.64)])
    table = fit_limit.table([search], "sequence length", 100)
    assert "ms per position" in table and "ms per sample" not in table
    assert "| 10.0 |" in table   # 640 ms over 64 positions


def test_explain_model_with_benchmark_models_is_a_usage_error(capsys):
    from memsave_grads import cli  # pylint: disable=import-outside-toplevel
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["explain", "--model", f"{MODELS}:residual_mlp", "--models", "unet"])
    assert exit_info.value.code == 2
    assert "argument --models: explains the benchmark networks" in capsys.readouterr().err


def test_the_largest_size_says_where_the_search_stopped_at_max():
    topped = fit_limit.Search("m", [fit_limit.Attempt("m", 8, True, peak_bytes=1,
                                                      step_seconds=1.0)])
    limited = fit_limit.Search("m", [*topped.attempts, fit_limit.Attempt(
        "m", 16, False, error="OOM", out_of_memory=True)])
    assert topped.largest_text == ">= 8" and limited.largest_text == "8"
    assert fit_limit.Search("m").largest_text == "-"


def test_keras_remat_failing_is_an_answer_not_the_command_s_failure(monkeypatch, capsys):
    """keras.RematScope fails inside fit on TensorFlow: its row says so, the exit status
    stays 0 (fake tries)."""
    from memsave_grads import cli  # pylint: disable=import-outside-toplevel

    def fake_attempt(source, method, batch_size, limit_mib, **kwargs):
        if method == fit_limit.KERAS_REMAT:
            return fit_limit.Attempt(method, batch_size, False, error="ValueError: keywords")
        return fit_limit.Attempt(method, batch_size, batch_size <= 16, peak_bytes=1,
                                 step_seconds=1.0, out_of_memory=batch_size > 16)

    monkeypatch.setattr(fit_limit, "attempt", fake_attempt)
    monkeypatch.setattr(fit_limit, "check",
                        lambda *a, **k: {"kind": "keras", "keras": mg.keras.KERAS3})
    assert cli.main(["fit-limit", f"{MODELS}:residual_mlp", "--limit-mib", "64",
                     "--start", "8", "--max", "32", "--keras-remat"]) == 0
    assert "ValueError: keywords" in capsys.readouterr().out


def test_a_check_the_machine_killed_does_not_stop_the_search(monkeypatch):
    """The build before the search runs without a cap: killed (the machine's own memory) or
    past its time, it says nothing about the model, and the search goes on."""
    from memsave_grads import _child as child  # pylint: disable=import-outside-toplevel
    for outcome in (child.ChildRun(None, -9, ""), child.ChildRun(None, None, "", True)):
        monkeypatch.setattr(child, "run", lambda *a, outcome=outcome, **k: outcome)
        assert fit_limit.check(f"{MODELS}:residual_mlp", 8) is None
    monkeypatch.setattr(child, "run", lambda *a, **k: child.ChildRun(None, 1, "boom\nlast"))
    with pytest.raises(ValueError, match="building .* failed: last"):
        fit_limit.check(f"{MODELS}:residual_mlp", 8)


def test_a_try_of_keras_remat_on_a_tf_keras_model_says_it_does_not_apply(tmp_path):
    """The row stays honest where no check ran before the search: RematScope leaves a tf_keras
    model as it is, so its try reports that instead of stock fit's numbers."""
    tf_keras = pytest.importorskip("tf_keras")
    inputs = tf_keras.Input((8,))
    model = tf_keras.Model(inputs, tf_keras.layers.Dense(2)(inputs))
    model.compile("sgd", "mse")
    model.save(tmp_path / "old.h5")
    result = fit_limit._try_here({  # pylint: disable=protected-access
        "source": str(tmp_path / "old.h5"), "method": fit_limit.KERAS_REMAT, "batch_size": 4,
        "limit_mib": None, "steps": 1})
    assert not result["fits"] and "Keras 3 models only" in result["error"]
