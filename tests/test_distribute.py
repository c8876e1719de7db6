"""memsave_grads under tf.distribute.MirroredStrategy (docs/distribute.md).

Two logical CPU devices must be configured before TensorFlow initialises its devices, which the
test session has long done, so the strategy runs in a subprocess (as the Keras fit test in
test_patch.py does) and reports back as JSON.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

MIRRORED = textwrap.dedent(r"""
    import json, os, re, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"   # the placer's log lines, read back below
    import numpy as np, tensorflow as tf
    tf.debugging.set_log_device_placement(True)
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import memsave_grads as mg
    from memsave_grads import errors
    from memsave_grads.optimize import minimize
    from tf_builders import residual_tanh_mlp   # tests/ is on PYTHONPATH (see mirrored())

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    WIDTH, DEPTH, GLOBAL_BATCH, STEPS = 32, 8, 16, 4
    rng = np.random.RandomState(0)
    init = [(rng.randn(WIDTH, WIDTH) / np.sqrt(WIDTH)).astype(np.float32) for _ in range(DEPTH)]
    data = (rng.randn(STEPS * GLOBAL_BATCH, WIDTH).astype(np.float32),
            rng.randn(STEPS * GLOBAL_BATCH, WIDTH).astype(np.float32))
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(GLOBAL_BATCH)

    def train(method):
        with strategy.scope():
            ws = [tf.Variable(w) for w in init]
            opt = tf.compat.v1.train.AdamOptimizer(0.01)

        def forward(x, y):
            h = residual_tanh_mlp(x, ws)
            per_example = tf.reduce_mean(tf.square(h - y), axis=1)
            return tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)

        def step(x, y):
            if method == "tape":
                with tf.GradientTape() as tape:
                    loss = forward(x, y)
                grads = tape.gradient(loss, ws)
            else:
                loss = forward(x, y)
                if method == "tf.gradients":
                    grads = tf.gradients(loss, ws)
                else:
                    grads = mg.gradients(loss, ws, checkpoints="memory")
            opt.apply_gradients(zip(grads, ws))   # sums the replicas' gradients
            return loss

        @tf.function
        def train_step(x, y):
            per_replica = strategy.run(step, args=(x, y))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        batches = list(strategy.experimental_distribute_dataset(dataset))
        losses = [float(train_step(x, y)) for x, y in batches]
        concrete = train_step.get_concrete_function(*batches[0])
        return losses, [w.numpy().tolist() for w in ws], concrete

    result = {}
    for method in ("tape", "tf.gradients", "memsave"):
        losses, values, concrete = train(method)
        result[method] = {"losses": losses, "values": values}

    # Where the traced graph puts each recomputed op. Boundaries (identity of a kept
    # tensor) are colocated with what they read; for a variable read that is the replica's
    # variable, whose handle is captured from outside the function.
    graph = concrete.graph
    captured_device = {internal.op.name: external.device
                       for external, internal in graph.captures}
    def static_device(op):
        if op.device:
            return op.device
        for group in op.colocation_groups():
            target = graph.get_operation_by_name(group.decode()[len("loc:@"):])
            if target.device:
                return target.device
            for t in target.inputs:
                if t.op.name in captured_device:
                    return captured_device[t.op.name]
        return ""
    result["recompute_ops"] = [(op.name, static_device(op), op.device)
                               for op in graph.get_operations() if "recompute" in op.name]

    # minimize() refuses to run under a strategy with our own error.
    with strategy.scope():
        v = tf.Variable(1.0)
    @tf.function
    def refused():
        def fn():
            try:
                minimize(v * v, tf.compat.v1.train.GradientDescentOptimizer(0.1), var_list=[v],
                         checkpoints=None)
            except errors.InvalidArgumentError as exc:
                return tf.constant(str(exc))
            return tf.constant("no error")
        return strategy.experimental_local_results(strategy.run(fn))[0]
    result["minimize_under_strategy"] = refused().numpy().decode()

    # Each replica's step compiled by XLA (jit_compile): the copies wait through stand-ins and
    # kept sums pass through conditionals (design note "memory under XLA"). XLA cannot read a
    # variable placed on another logical device, so the compiled function takes the values.
    with strategy.scope():
        jit_ws = [tf.Variable(rng.randn(256, 256).astype(np.float32) * 0.06) for _ in range(12)]
    jit_x = tf.constant(rng.randn(512, 256).astype(np.float32))

    def replica_gradients(x, values, ours):
        loss = tf.reduce_sum(tf.square(residual_tanh_mlp(x, values)))
        if ours:
            return mg.gradients(loss, values, checkpoints="memory", fallback="error")
        return tf.gradients(loss, values)

    jit_grads = {}
    for ours in (False, True):
        compiled = tf.function(lambda x, values, ours=ours: replica_gradients(x, values, ours),
                               jit_compile=True)
        @tf.function
        def summed(x):
            per_replica = strategy.run(
                lambda x: compiled(x, [w.read_value() for w in jit_ws]), args=(x,))
            return [strategy.reduce("SUM", g, axis=None) for g in per_replica]
        jit_grads[ours] = summed(jit_x)
    traced = compiled.get_concrete_function(jit_x, [w.read_value() for w in jit_ws]).graph
    result["jit"] = {
        "error": max(float(np.abs(a - b).max() / np.abs(b).max())
                     for a, b in zip(jit_grads[True], jit_grads[False])),
        "conditionals": sum(op.type in ("If", "StatelessIf") for op in traced.get_operations()),
        "stand_ins": sum("after_gradient" in op.name for op in traced.get_operations())}
    result["replicas"] = strategy.num_replicas_in_sync
    print("RESULT " + json.dumps(result), flush=True)
""")


@pytest.fixture(scope="module")
def mirrored():
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [tests_dir, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", MIRRORED], capture_output=True, text=True,
                          timeout=300, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT "):])
    # The placer's log: "<op name>: (<type>): <device>" for every op of the function it placed.
    placed = {}
    for line in (done.stdout + done.stderr).splitlines():
        parts = line.rsplit(": ", 2)
        if len(parts) == 3 and "recompute" in parts[0] and parts[1].startswith("("):
            placed[parts[0].split()[-1]] = parts[2].strip()
    result["placed"] = placed
    return result


def test_two_replicas(mirrored):
    assert mirrored["replicas"] == 2


@pytest.mark.parametrize("reference", ["tape", "tf.gradients"])
def test_same_losses_and_variables_as_plain_gradients(mirrored, reference):
    want, got = mirrored[reference], mirrored["memsave"]
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    assert want["losses"][-1] < want["losses"][0]
    for g, w in zip(got["values"], want["values"]):
        w = np.asarray(w)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


def _replica(op_name):
    return 1 if op_name.startswith("replica_1/") else 0


def test_recomputed_ops_stay_on_their_replica_device(mirrored):
    ops = mirrored["recompute_ops"]
    by_replica = {0: 0, 1: 0}
    for name, device, _ in ops:
        by_replica[_replica(name)] += 1
        assert device.endswith(f"CPU:{_replica(name)}"), (name, device)
    assert by_replica[0] == by_replica[1] > 0, by_replica
    # Most copies carry the device explicitly (they keep the original op's device); only the
    # boundaries of variable reads rely on colocation.
    explicit = sum(1 for _, _, attr in ops if attr)
    assert explicit >= len(ops) // 2, ops


def test_placer_puts_recomputed_ops_on_their_replica(mirrored):
    placed = mirrored["placed"]
    assert len(placed) >= len(mirrored["recompute_ops"]), sorted(placed)[:5]
    for name, device in placed.items():
        assert device.endswith(f"CPU:{_replica(name)}"), (name, device)


def test_minimize_is_refused_under_a_strategy(mirrored):
    assert "MirroredStrategy" in mirrored["minimize_under_strategy"]


def test_compiled_replica_steps_are_exact(mirrored):
    """Two replicas, each step compiled by XLA: the stand-ins and the conditionals of the XLA
    rewrite are built, and the summed gradients are tf.gradients'."""
    jit = mirrored["jit"]
    assert jit["conditionals"] > 0 and jit["stand_ins"] > 0, jit
    assert jit["error"] <= 1e-5, jit
