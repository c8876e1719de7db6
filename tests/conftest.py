"""Test setup: allocator statistics must be switched on before TensorFlow is imported.

TensorFlow itself is imported only by the fixtures that build graphs: the core's tests
(test_graph_model.py, test_memory_model.py, test_solvers.py...) run without it, and
tests/test_layering.py checks that they do.
"""

import os
import sys

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def assert_grads_close(actual, expected, rtol=1e-5, atol=0.0):
    """Elementwise rtol, with an absolute floor of rtol x the largest reference magnitude.

    Summing the same partials in another order changes float32 results by a few ulps of the
    *largest* term, so elements near zero need the floor. Where the exact gradient is zero by
    cancellation (``x - x``), the reference itself is rounding noise: ``atol`` covers that.
    """
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        if e is None:
            assert a is None, f"gradient {i}: expected None, got {a!r}"
            continue
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, f"gradient {i}: shape {a.shape} != {e.shape}"
        scale = float(np.max(np.abs(e))) if e.size else 0.0
        np.testing.assert_allclose(a, e, rtol=rtol, atol=max(rtol * scale, atol) + 1e-30,
                                   err_msg=f"gradient {i}")


@pytest.fixture(autouse=True)
def _rewrite_even_where_plain_would_do(request, monkeypatch):
    """Tests check the rewrite itself, mostly on small graphs, where the never-worse rule
    (docs/design.md, note "never worse") would hand the gradients to plain tf.gradients and a
    parity test would compare tf.gradients with itself. The rule stays on for tests marked
    ``never_worse``: the tests of the rule, and measured peaks of whole models."""
    if "tensorflow" not in sys.modules:
        # Only the core's TF-free tests get here (every module that builds graphs imports
        # TensorFlow at its top, before this runs): no rewrite to force, and importing the
        # selection would load TensorFlow into them.
        yield
        loaded_in_the_test = "tensorflow" in sys.modules
        assert not loaded_in_the_test, (
            "this test imported TensorFlow inside its body, after this fixture left the "
            "never-worse rule on: import tensorflow at the top of its module")
        return
    if request.node.get_closest_marker("never_worse") is None:
        from memsave_grads._tf import selection  # pylint: disable=import-outside-toplevel
        monkeypatch.setattr(selection, "NEVER_WORSE_RULE", False)
    # Warnings said once per process (ordering.warn_once: fallbacks, XLA's unordered
    # constructs, tape-wrapped loops): each test sees its own first one.
    from memsave_grads._tf import ordering  # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(ordering, "_warned", set())
    yield


@pytest.fixture
def spy(monkeypatch):
    """The ``checkpoints`` of every ``memsave_grads.gradients`` call (a patched tf.gradients and
    a routed tape included), as given; unpatches at the end if a test left the patch on."""
    import memsave_grads as mg  # pylint: disable=import-outside-toplevel
    from memsave_grads import api  # pylint: disable=import-outside-toplevel
    calls = []
    real = api.gradients
    # The package's names load on first use: bind mg.gradients to the real function before the
    # spy replaces the module attribute, as an eager import would have.
    assert mg.gradients is real

    def recording(*args, **kwargs):
        checkpoints = kwargs.get("checkpoints")
        # As the caller gave it: the Keras step passes it on parsed (_validate.check_checkpoints).
        calls.append(getattr(checkpoints, "given", checkpoints))
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "gradients", recording)
    yield calls
    if mg.is_patched():
        mg.unpatch()


@pytest.fixture
def graph():
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    g = tf.Graph()
    with g.as_default():
        yield g


@pytest.fixture
def session(graph):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    with tf.compat.v1.Session(graph=graph) as sess:
        yield sess
