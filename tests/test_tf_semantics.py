"""TensorFlow-semantics parity (issue 14): a patched ``tf.gradients`` behaves as TensorFlow's.

Every scenario of ``tf_semantics_cases.py`` (one per behaviour TensorFlow's own gradient tests
check) runs under ``memsave_grads.patch(checkpoints=...)`` with ``"memory"``, ``"speed"`` and
the every-op pattern ``["*"]``, in TF2 (``tf.Graph`` + Session, and ``tf.function``), v1
(``disable_v2_behavior``) and, for the scenarios with control flow, v1 with control flow v2,
and is compared with unpatched ``tf.gradients``. The modes change global TensorFlow state, so each runs in its own process;
one test per (scenario, mode, container, strategy) reads its result, and the counts (rewrote,
fell back, failed) are printed at the end of the module and written to ``summary.txt`` in the
module's temporary folder. ``python tests/tf_semantics_cases.py`` prints the same table.

The default suite runs a third of the sweep (``cases.representative_runs``): every scenario in
every mode and container, one strategy each, rotated so that every (mode, container) meets
every strategy. The rest is marked ``slow``; the whole sweep is
``python -m pytest -m "slow or not slow" tests/test_tf_semantics.py``.
"""

import pytest
import tensorflow as tf

import tf_semantics_cases as cases

#: Wall-clock limit for the three mode processes together (they run concurrently).
MODES_TIMEOUT_S = 600

RUN_IDS = cases.planned_runs()
REPRESENTATIVE_RUN_IDS = frozenset(cases.representative_runs())


def _mode_of(run: str) -> str:
    return run.split("-")[1]


class _Results:
    """Records by run id and each mode process's (exit code, output tail); a short repr keeps
    failure reports readable."""

    def __init__(self, records: dict, status: dict):
        self.records = records
        self.status = status

    def __repr__(self):
        return f"<{len(self.records)} parity records>"


def _selection(session) -> tuple[list, tuple]:
    """(run ids, modes) the selected tests need: the runs ``-k`` and ``-m`` left, and the
    default suite's runs where the rewrite count is selected (each mode process costs seconds
    of TensorFlow start-up alone)."""
    runs = {item.callspec.params["run"] for item in session.items
            if item.module.__name__ == __name__ and hasattr(item, "callspec")
            and "run" in item.callspec.params}
    if any(item.name == "test_every_mode_and_strategy_really_rewrites"
           for item in session.items if item.module.__name__ == __name__):
        runs |= REPRESENTATIVE_RUN_IDS
    return (sorted(runs),
            tuple(mode for mode in cases.MODES if any(_mode_of(r) == mode for r in runs)))


@pytest.fixture(scope="module")
def semantics_results(tmp_path_factory, request):
    out_dir = tmp_path_factory.mktemp("tf_semantics")
    runs, modes = _selection(request.session)
    records, status = cases.collect(str(out_dir),
                                    cases.launch_modes(str(out_dir), modes=modes, runs=runs),
                                    MODES_TIMEOUT_S)
    summary = cases.summary_table(records)
    (out_dir / "summary.txt").write_text(summary + "\n\n" + cases.failures_text(records) + "\n")
    yield _Results(records, status)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # the counts are the suite's report
            reporter.write_sep("-", f"tf.gradients semantics parity (details: {out_dir})")
            reporter.write_line(summary)


@pytest.mark.parametrize("run", [run if run in REPRESENTATIVE_RUN_IDS
                                 else pytest.param(run, marks=pytest.mark.slow)
                                 for run in RUN_IDS])
def test_matches_tf_gradients(semantics_results, run):
    record = semantics_results.records.get(run)
    if record is None:
        code, output = semantics_results.status[_mode_of(run)]
        pytest.fail(f"{run}: no result; the {_mode_of(run)} process ended with {code}:\n"
                    f"{output[-2000:]}")
    scenario = cases.SCENARIOS[record["scenario"]]
    assert not record["problems"], (
        f"{run} ({scenario.mirrors}), routing {record['routing']}:\n  "
        + "\n  ".join(record["problems"]))


def test_the_default_share_covers_each_pair():
    """The default suite's runs (``cases.representative_runs``) leave out no scenario, (mode,
    container) or strategy: every scenario in each mode and container it runs in, every
    (mode, container) under every strategy, and every strategy on every scenario that runs in
    three containers or more."""
    planned = [r.split("-") for r in RUN_IDS]
    chosen = [r.split("-") for r in REPRESENTATIVE_RUN_IDS]
    assert REPRESENTATIVE_RUN_IDS < set(RUN_IDS)
    assert {(s, m, c) for s, m, c, _ in chosen} == {(s, m, c) for s, m, c, _ in planned}
    assert len(chosen) == len({(s, m, c) for s, m, c, _ in planned})   # one strategy each
    assert {(m, c, k) for _, m, c, k in chosen} == {(m, c, k) for _, m, c, k in planned}
    for sc in cases.SCENARIOS.values():
        if len(sc.runs()) >= len(cases.STRATEGIES):
            assert {k for s, _, _, k in chosen if s == sc.name} == set(cases.STRATEGIES), sc.name


def test_every_mode_and_strategy_really_rewrites(semantics_results):
    """The suite is only evidence if the patched calls rewrote graphs: in every (mode,
    container, strategy) most runs copied forward ops for recomputation (the default suite's
    runs, and every run the selection added)."""
    groups = {}
    for r in semantics_results.records.values():
        groups.setdefault((r["mode"], r["container"], r["strategy"]), []).append(r)
    expected = {(mode, container, strategy) for s in cases.SCENARIOS.values()
                for mode, container in s.runs() for strategy in cases.STRATEGIES}
    assert set(groups) == expected
    for key, group in groups.items():
        recomputed = sum(r["recompute_ops"] > 0 for r in group)
        assert recomputed >= len(group) // 2, (key, recomputed, len(group))


# --- the harness itself: a difference must be reported (fast, in this process) -----------


def _outcome(grads, events=None):
    return cases.Outcome(grads=grads, events=events or [{"outcome": "rewrote"}])


def test_harness_reports_each_kind_of_difference():
    sc = cases.Scenario("probe", lambda env: None, "harness self-test")
    with tf.Graph().as_default():
        x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
        table = tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
        y = tf.reduce_sum(tf.gather(table, [0, 2]) * x)
        reference = _outcome(tf.gradients(y, [x, table]))
        dense = _outcome([reference.grads[0], tf.convert_to_tensor(reference.grads[1])])
        missing = _outcome([None, reference.grads[1]])
        fell_back = _outcome(reference.grads, [{"outcome": "fell_back",
                                                "error": "NoCheckpointsFoundError"}])
        ref_values = [[[1.0, 0.0], [0.0, 2.0]], None]
        ok = cases.compare(sc, "tf2", reference, reference, ref_values, ref_values, None, None)
        wrong_values = [[[1.0, 0.0], [0.0, 2.5]], None]
        assert ok == []
        assert "values differ" in cases.compare(sc, "tf2", reference, reference, ref_values,
                                                 wrong_values, None, None)[0]
        assert "IndexedSlices" in cases.compare(sc, "tf2", reference, dense, ref_values,
                                                 ref_values, None, None)[0]
        assert "None" in cases.compare(sc, "tf2", reference, missing, ref_values, ref_values,
                                        None, None)[0]
        assert "fell back" in cases.compare(sc, "tf2", reference, fell_back, ref_values,
                                             ref_values, None, None)[0]
        tf_error = {"type": "TypeError", "mro": ["TypeError", "Exception"],
                    "message": "Gradients of complex tensors must set grad_ys", "where": ""}
        raised = cases.Outcome(error=tf_error)
        quoted = cases.Outcome(error={
            "type": "InvalidTypeError", "mro": ["InvalidTypeError", "TypeError"],
            "message": "grad_ys[0]: ... TensorFlow's message: " + tf_error["message"],
            "where": ""})
        unquoted = cases.Outcome(error=dict(quoted.error, message="grad_ys[0]: complex"))
        for ours in (quoted, unquoted):
            ours.events = [{"outcome": "raised"}]
        assert cases.compare(sc, "tf2", raised, quoted, None, None, None, None) == []
        assert "does not say it" in cases.compare(sc, "tf2", raised, unquoted, None, None,
                                                   None, None)[0]
        v1_cf = cases.Scenario("probe", lambda env: None, "self-test", control_flow=True)
        tf1_fallback = _outcome(reference.grads, [{"outcome": "fell_back",
                                                   "error": "UnsupportedGraphError"}])
        assert cases.compare(v1_cf, "v1", reference, tf1_fallback, ref_values, ref_values,
                              None, None) == []
        assert cases.compare(v1_cf, "v1_cfv2", reference, tf1_fallback, ref_values,
                              ref_values, None, None) != []
