"""Model-scale checks (slow): `python3 -m pytest -m slow`.

They run the benchmark's models and assert what the benchmark table reports: equal gradients
and a real saving of measured peak memory.
"""

import pytest

from memsave_grads.bench import harness
from memsave_grads.bench import models

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("spec", [models.residual_mlp(depth=128, width=512, batch=256),
                                  models.conv_resnet()], ids=lambda s: s.name)
def test_memory_strategy_at_model_scale(spec):
    reference, ours = harness.measure_model(spec, [harness.REFERENCE, harness.MEMORY], repeats=1)
    assert ours.skipped is None and ours.failed is None, (ours.skipped, ours.failed)
    assert ours.max_rel_error <= 1e-4
    assert reference.peak_bytes >= 2.5 * ours.peak_bytes, (reference.peak_bytes, ours.peak_bytes)
