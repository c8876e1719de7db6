"""Tape routing inside ``tf.distribute.MirroredStrategy().run`` (design note "tape routing").

Each replica's step runs in a thread of its own, with a tape set of its own; the routed tapes
must give each replica the unrouted tape's gradients, so that training ends with the same
losses and weights. Two logical CPU devices must exist before TensorFlow initialises its
devices, so the strategy runs in a subprocess (as in tests/test_distribute.py).
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

MIRRORED_TAPES = textwrap.dedent(r"""
    import functools, json
    import numpy as np, tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import memsave_grads as mg
    from memsave_grads import api
    from memsave_grads._tf import selection
    from tf_builders import residual_tanh_mlp   # tests/ is on PYTHONPATH

    selection.NEVER_WORSE_RULE = False   # small graphs: rewrite anyway (tests/conftest.py)
    calls = []
    real = api.gradients
    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    api.gradients = counting

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    WIDTH, DEPTH, GLOBAL_BATCH, STEPS = 16, 6, 16, 3
    rng = np.random.RandomState(0)
    init = [(rng.randn(WIDTH, WIDTH) / np.sqrt(WIDTH)).astype(np.float32) for _ in range(DEPTH)]
    data = (rng.randn(STEPS * GLOBAL_BATCH, WIDTH).astype(np.float32),
            rng.randn(STEPS * GLOBAL_BATCH, WIDTH).astype(np.float32))
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(GLOBAL_BATCH)

    def train(way):
        with strategy.scope():
            ws = [tf.Variable(w) for w in init]
            opt = tf.compat.v1.train.GradientDescentOptimizer(0.05)
        Tape = (functools.partial(mg.GradientTape, checkpoints="memory", fallback="error")
                if way == "GradientTape" else tf.GradientTape)

        def step(x, y):
            with Tape() as tape:
                tape.watch(x)
                h = residual_tanh_mlp(x, ws)
                per_example = tf.reduce_mean(tf.square(h - y), axis=1)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, ws + [x])
            opt.apply_gradients(zip(grads[:-1], ws))   # sums the replicas' gradients
            return loss + 0.0 * tf.reduce_sum(grads[-1])

        @tf.function
        def train_step(x, y):
            per_replica = strategy.run(step, args=(x, y))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        batches = list(strategy.experimental_distribute_dataset(dataset))
        if way == "patch":
            with mg.patch("memory", fallback="error"):
                train_step.get_concrete_function(*batches[0])
        elif way == "route_tapes":
            with mg.route_tapes("memory", fallback="error"):
                train_step.get_concrete_function(*batches[0])
        losses = [float(train_step(x, y)) for x, y in batches]
        return {"losses": losses, "values": [w.numpy().tolist() for w in ws]}

    result = {}
    for way in ("tape", "patch", "route_tapes", "GradientTape"):
        calls.clear()
        result[way] = train(way)
        result[way]["routed"] = len(calls)
    result["replicas"] = strategy.num_replicas_in_sync
    print("RESULT " + json.dumps(result), flush=True)
""")


@pytest.fixture(scope="module")
def mirrored_tapes():
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [tests_dir, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", MIRRORED_TAPES], capture_output=True,
                          text=True, timeout=300, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.parametrize("way", ["patch", "route_tapes", "GradientTape"])
def test_replicas_train_as_with_the_unrouted_tape(mirrored_tapes, way):
    assert mirrored_tapes["replicas"] == 2
    want, got = mirrored_tapes["tape"], mirrored_tapes[way]
    assert want["routed"] == 0
    assert got["routed"] == 2, "each replica's tape goes through memsave_grads once"
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    for g, w in zip(got["values"], want["values"]):
        w = np.asarray(w)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * np.abs(w).max())
