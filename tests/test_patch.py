"""patch()/unpatch(): every route to tf.gradients goes through memsave_grads, and back."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import memsave_grads as mg


def _deep_loss():
    x = tf.constant(np.random.RandomState(0).randn(4, 8).astype(np.float32))
    w = tf.Variable(np.random.RandomState(1).randn(8, 8).astype(np.float32) / 3)
    h = x
    for _ in range(6):
        h = tf.tanh(tf.matmul(h, w))
    return w, tf.reduce_sum(h * h)


def test_routes_tf_gradients_and_compat_v1(graph, spy):
    w, loss = _deep_loss()
    with mg.patch("memory"):
        assert mg.is_patched()
        tf.gradients(loss, w)
        tf.compat.v1.gradients(loss, w)
    assert spy == ["memory", "memory"]
    assert not mg.is_patched()
    assert tf.gradients.__module__ != "memsave_grads.patching"


def test_unpatch_restores_every_name_exactly(graph):
    import sys as _sys
    from memsave_grads._tf import graph as tf_graph
    originals = (tf_graph.ORIGINAL_GRADIENTS, tf_graph.ORIGINAL_GRADIENTS_V2)
    holders = {(name, attr, value) for name, mod in list(_sys.modules.items())
               if mod is not None and not name.startswith("memsave_grads")
               for attr, value in list(getattr(mod, "__dict__", {}).items())
               if any(value is o for o in originals)}
    state = mg.patch("speed")
    assert len(state.replaced) >= len(holders) >= 4
    for module, attr, original in state.replaced:
        assert getattr(module, attr) is not original
    assert tf.gradients is not originals[1] and tf.compat.v1.gradients is not originals[0]
    mg.unpatch()
    for name, attr, value in holders:
        assert getattr(_sys.modules[name], attr) is value
    assert tf.gradients is originals[1] and tf.compat.v1.gradients is originals[0]


def test_v1_optimizer_minimize_is_routed_and_correct(graph, session, spy):
    w, loss = _deep_loss()
    reference = tf.gradients(loss, w)[0]
    with mg.patch("memory"):
        opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        grads_and_vars = opt.compute_gradients(loss, var_list=[w])
        train = opt.minimize(loss, var_list=[w])
    assert spy == ["memory", "memory"]
    assert any("_memsave" in op.name for op in graph.get_operations())
    session.run(tf.compat.v1.global_variables_initializer())
    got, want = session.run([grads_and_vars[0][0], reference])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    session.run(train)


def test_patched_call_never_recurses(graph, spy):
    w, loss = _deep_loss()
    with mg.patch("memory"):
        # mg.gradients is not the spied module attribute; its inner tf.gradients calls must
        # reach the original function, not the patched one (which the spy would record).
        grads = mg.gradients(loss, w, checkpoints="speed")
    assert spy == []
    assert grads[0] is not None


def test_patch_twice_and_unpatch_without_patch():
    with mg.patch("memory"):
        with pytest.raises(mg.PatchStateError, match="already patched"):
            mg.patch("speed")
    with pytest.raises(mg.PatchStateError, match="not patched") as info:
        mg.unpatch()
    assert isinstance(info.value, RuntimeError)


def test_an_ended_patch_refuses_to_be_entered_again():
    """It would enter without patching (tf.gradients as it was, silently)."""
    ended = mg.patch("memory")
    mg.unpatch()
    with pytest.raises(mg.PatchStateError, match="has ended .* does not patch. Call "
                       "memsave_grads.patch"):
        with ended:
            pass
    with mg.patch("memory") as live:  # entered once, as patch() made it
        assert mg.is_patched()
    assert not mg.is_patched()
    with pytest.raises(mg.PatchStateError, match="has ended"):
        with live:
            pass


def test_patch_rejects_unknown_strategy_and_fallback():
    with pytest.raises(mg.UnknownStrategyError):
        mg.patch("fastest")
    with pytest.raises(mg.InvalidArgumentError, match="fallback"):
        mg.patch("memory", fallback="ignore")
    assert not mg.is_patched()


def test_fallback_warns_and_uses_tf_gradients(graph, spy):
    x = tf.constant([1.0, 2.0])
    y = tf.reduce_sum(x)  # nothing to keep
    with mg.patch("memory"):
        grad = tf.gradients(y, x)[0]
    assert spy == ["memory"] and grad is not None
    with mg.patch("memory", fallback="error"):
        with pytest.raises(mg.NoCheckpointsFoundError):
            tf.gradients(y, x)


KERAS_FIT = textwrap.dedent("""
    import os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import numpy as np, tensorflow as tf, tf_keras
    import memsave_grads as mg
    from memsave_grads import api
    calls = []
    real = api.gradients
    api.gradients = lambda *a, **k: calls.append(k.get("checkpoints")) or real(*a, **k)
    def run(patched):
        g = tf.Graph()
        with g.as_default():
            tf_keras.utils.set_random_seed(0)
            model = tf_keras.Sequential(
                [tf_keras.layers.Dense(32, activation="tanh", input_shape=(16,))]
                + [tf_keras.layers.Dense(32, activation="tanh") for _ in range(6)]
                + [tf_keras.layers.Dense(1)])
            model.compile(optimizer=tf_keras.optimizers.legacy.SGD(0.05), loss="mse")
            rng = np.random.RandomState(0)
            x, y = rng.randn(64, 16).astype("float32"), rng.randn(64, 1).astype("float32")
            if patched:
                with mg.patch("memory"):
                    hist = model.fit(x, y, epochs=3, batch_size=16, verbose=0, shuffle=False)
                recomputed = sum("_memsave" in op.name for op in g.get_operations())
            else:
                hist = model.fit(x, y, epochs=3, batch_size=16, verbose=0, shuffle=False)
                recomputed = 0
            return hist.history["loss"], recomputed
    plain, _ = run(False)
    ours, recomputed = run(True)
    print("CALLS", len(calls), "RECOMPUTED", recomputed)
    np.testing.assert_allclose(ours, plain, rtol=1e-5)
    assert calls and recomputed > 0
    print("KERAS_OK", plain, ours)
""")


def test_keras2_fit_in_a_v1_graph_is_routed():
    pytest.importorskip("tf_keras")
    done = subprocess.run([sys.executable, "-c", KERAS_FIT], capture_output=True, text=True,
                          timeout=300)
    assert "KERAS_OK" in done.stdout, done.stdout + done.stderr[-3000:]


IMPORT_CHANGES_NOTHING = textwrap.dedent("""
    import sys
    import tensorflow as tf
    before = (tf.gradients, tf.compat.v1.gradients, sys.getrecursionlimit(),
              tf.compat.v1.train.Optimizer.compute_gradients)
    import memsave_grads
    after = (tf.gradients, tf.compat.v1.gradients, sys.getrecursionlimit(),
             tf.compat.v1.train.Optimizer.compute_gradients)
    assert all(a is b or a == b for a, b in zip(before, after)), (before, after)
    assert not memsave_grads.is_patched()
    print("unchanged")
""")


def test_importing_changes_nothing():
    result = subprocess.run([sys.executable, "-c", IMPORT_CHANGES_NOTHING], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and "unchanged" in result.stdout, result.stderr[-2000:]
