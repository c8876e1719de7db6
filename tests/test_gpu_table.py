"""``scripts/gpu_table.py``, the one-call GPU measurement (docs/gpu.md): its variants change
what they say they change, so that a lent GPU's few minutes are not spent on a script that no
longer reaches the rewrite. Graphs are built, not run."""

import importlib.util
import pathlib

import pytest
import tensorflow as tf

from memsave_grads.bench import xla as bench_xla

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu_table.py"


@pytest.fixture(scope="module")
def gpu_table():
    spec = importlib.util.spec_from_file_location("gpu_table", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _op_types_of_memory_step(gpu_table, variant):
    model = bench_xla.transformer(layers_count=2, batch=2, sequence=8, d_model=16)
    with gpu_table._variant(variant):  # pylint: disable=protected-access
        step = tf.function(lambda: bench_xla._loss_and_grads(  # pylint: disable=protected-access
            model, bench_xla.MEMORY)[1], jit_compile=True)
        graph = step.get_concrete_function().graph
    return [op.type for op in graph.get_operations()]


def _counts(gpu_table, variant):
    types = _op_types_of_memory_step(gpu_table, variant)
    return sum(t in ("If", "StatelessIf") for t in types), types.count("XlaOptimizationBarrier")


def test_the_variants_build_what_they_name(gpu_table, monkeypatch):
    # As on a GPU, where the default builds barriers and ``conditional`` what the CPU gets.
    from memsave_grads._tf import ordering  # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(ordering, "barriers_kept", lambda t: True)
    counts = {variant: _counts(gpu_table, variant) for variant in gpu_table.VARIANTS}
    conditionals, barriers = counts["conditional"][0], counts["default"][1]
    # Fewer barriers than conditionals: a conditional's gradient is one more conditional.
    assert counts["default"][0] == 0 and 0 < barriers < conditionals, counts
    assert conditionals > counts["per_level"][0] > 0, counts
    assert counts["conditional"][1] == counts["per_level"][1] == 0, counts
    assert counts["none"] == (0, 0), counts
    # The variant is undone on leaving: the default builds its barriers again.
    assert _counts(gpu_table, "default") == (0, barriers)
