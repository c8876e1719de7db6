"""The keras_hub benchmark (``memsave-grads benchmark --hub``): which architectures a
``--models`` list names, its table, its place among the benchmark's tables, and (slow) one real
cell per compilation on a tiny GPT-2."""

import json

import pytest
import tensorflow as tf  # noqa: F401  # pylint: disable=unused-import  # before conftest's fixture

from memsave_grads import cli
from memsave_grads.bench import hub


def _result(arch, method, jit, peak_mib, seconds=None, failed="", error=None):
    return hub.Result(arch, method, jit, None if peak_mib is None else int(peak_mib * 2**20),
                      seconds, failed, error)


def test_models_select_architectures_as_it_selects_the_other_models():
    assert [a.key for a in hub.select(["gpt2", "MOE"])] == ["gpt2", "qwen3_moe", "qwen_moe"]
    assert [a.key for a in hub.select(["experts"])] == ["qwen3_moe", "gpt_oss", "mixtral",
                                                        "qwen_moe"]
    assert [a.key for a in hub.select(["encoderdecoder"])] == ["t5"]
    assert hub.select([]) == list(hub.ARCHITECTURES)
    assert hub.select(["resnet"]) == []


def test_models_accepts_architecture_names_for_the_benchmark_only():
    assert cli.build_parser().parse_args(["benchmark", "--models", "llama,resnet"]).models == [
        "llama", "resnet"]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["explain", "--models", "llama"])


def test_table_gives_each_compilation_s_saving_and_time_and_says_what_failed():
    results = [[_result("gpt2", "stock", False, 200, 1.0),
                _result("gpt2", "memory", False, 50, 1.2, error=2.5e-7),
                _result("gpt2", "stock", True, 160, 2.0),
                _result("gpt2", "memory", True, None, failed="OOM when allocating")]]
    row = hub.table(results).splitlines()[2]
    assert row == ("| GPT-2 | 200 | 50.0 | 4.00x | 1.20x | 2.5e-07 | 160 | - "
                   "| OOM when allocating | - | - |")


def test_the_gradient_error_floors_gradients_that_are_zero_by_cancellation():
    np = pytest.importorskip("numpy")
    reference = [np.array([1.0, -2.0]), np.array([1e-10, -1e-10])]
    # A key bias's gradient: 1e-10 either way, nothing against the largest gradient (2.0).
    assert hub._max_rel_error([reference[0], np.array([-1e-10, 1e-10])], reference) < 1e-6
    # A real error still reads as one, relative to its own variable's scale.
    assert hub._max_rel_error([np.array([1.0, -1.9]), reference[1]], reference) == (
        pytest.approx(0.05))
    assert hub._max_rel_error([np.array([1.0, -2.0]), np.array([0.01, 0])], reference) == (
        pytest.approx(5.0))
    # A NaN gradient is an error, not a value max() passes over.
    assert hub._max_rel_error([np.array([np.nan, -2.0]), reference[1]], reference) == np.inf


def test_a_wrapped_result_without_its_gradient_check_or_above_tolerance_is_wrong():
    assert not hub.gradients_wrong(_result("gpt2", "stock", True, 100))
    assert hub.gradients_wrong(_result("gpt2", "memory", True, 40))
    assert hub.gradients_wrong(_result("gpt2", "memory", True, 40, error=1e-3))
    assert not hub.gradients_wrong(_result("gpt2", "memory", True, 40, error=1e-6))


def test_hub_only_runs_the_keras_hub_table_alone(monkeypatch, capsys):
    pytest.importorskip("keras_hub")
    from memsave_grads.bench import commands  # pylint: disable=import-outside-toplevel
    asked = []

    def fake_measure_all(architectures, repeats):
        asked.append([a.key for a in architectures])
        return [[_result(a.key, m, jit, 100 if m == "stock" else 40, 1.0,
                         error=None if m == "stock" else 1e-13)
                 for jit in (False, True) for m, _ in hub.METHODS] for a in architectures]

    def not_this(args):
        raise AssertionError("only the keras_hub table was asked for")

    monkeypatch.setattr(hub, "measure_all", fake_measure_all)
    monkeypatch.setattr(commands, "_graph_benchmark", not_this)
    monkeypatch.setattr(commands, "_xla_benchmark", not_this)
    args = cli.build_parser().parse_args(["benchmark", "--hub", "only", "--models", "llama,t5",
                                          "--format", "json"])
    assert commands.benchmark(args) == 0
    assert asked == [["llama", "t5"]]
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= {"hub"} and "graph" not in data and "xla" not in data
    assert [r["peak_bytes"] for r in data["hub"][0]] == [100 * 2**20, 40 * 2**20] * 2


@pytest.mark.slow
def test_a_tiny_gpt2_saves_with_and_without_xla():
    pytest.importorskip("keras_hub")
    shape = hub.Shape(layers=4, hidden=128, heads=2, intermediate=512, batch=8, sequence=128)
    for jit in (False, True):
        stock, ours = (hub.measure(hub.architecture("gpt2"), m, jit, shape)
                       for m in ("stock", "memory"))
        assert not stock.failed and not ours.failed, (stock.failed, ours.failed)
        assert ours.peak_bytes < 0.6 * stock.peak_bytes, (jit, stock, ours)


@pytest.mark.slow
def test_a_tiny_gpt2_s_wrapped_fit_step_has_the_stock_gradients_under_xla():
    pytest.importorskip("keras_hub")
    shape = hub.Shape(layers=2, hidden=64, heads=2, intermediate=128, batch=4, sequence=32)
    error = hub.gradient_error(hub.architecture("gpt2"), True, shape)
    assert error is not None and error <= hub.GRADIENT_TOLERANCE, error
