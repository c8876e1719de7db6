"""One process of a multi-worker job, started by tests/test_multi_worker.py (docs/distribute.md).

Roles:
  mwms TASK OUT      a MultiWorkerMirroredStrategy worker (TF_CONFIG from the environment): runs
                     the parity checks and the peak measurement, writes its results as JSON to OUT;
                     with MULTI_WORKER_LOGICAL_CPUS=2 it splits its CPU into two logical devices
                     first (for the placement part, MULTI_WORKER_PARTS=placement)
  server JOB TASK    a tf.distribute.Server of a ParameterServerStrategy cluster (CLUSTER_SPEC
                     from the environment, JSON); serves until it is killed
  ps_chief OUT       the ParameterServerStrategy coordinator: trains with GradientTape and with
                     memsave_grads on the cluster of CLUSTER_SPEC, writes JSON to OUT

Every worker runs the same sequence of collective steps: MultiWorkerMirroredStrategy requires the
workers to launch their all-reduces in the same order.
"""

import json
import os
import sys
import time
import traceback

# Allocator statistics on CPU need the BFC allocator, switched on before TensorFlow starts.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import memsave_grads as mg  # noqa: E402
from memsave_grads import api  # noqa: E402
from memsave_grads import measure  # noqa: E402
from tf_builders import residual_tanh_mlp  # noqa: E402  (this script runs from tests/)
from memsave_grads._tf import selection  # noqa: E402

NUM_WORKERS = 2


def residual_weights(depth, width, seed):
    rng = np.random.RandomState(seed)
    return [(rng.randn(width, width) * 0.5 / np.sqrt(width)).astype(np.float32)
            for _ in range(depth)]


def worker_batches(task, steps, batch_per_worker, width, seed):
    """Each worker's own data: different per worker, the same for every method."""
    rng = np.random.RandomState(seed + 1000 * (task + 1))
    return [(tf.constant(rng.randn(batch_per_worker, width).astype(np.float32)),
             tf.constant(rng.randn(batch_per_worker, width).astype(np.float32)))
            for _ in range(steps)]


def make_train_step(strategy, ws, optimizer, method, global_batch):
    """A tf.function training step of a residual MLP on raw variables, per replica."""
    def forward(x, y):
        h = residual_tanh_mlp(x, ws)
        per_example = tf.reduce_mean(tf.square(h - y), axis=1)
        return tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)

    def step(x, y):
        if method == "tape":
            with tf.GradientTape() as tape:
                loss = forward(x, y)
            grads = tape.gradient(loss, ws)
        else:
            loss = forward(x, y)
            grads = mg.gradients(loss, ws, checkpoints="memory")
        optimizer.apply_gradients(zip(grads, ws))   # all-reduce across workers, then update
        return loss

    @tf.function
    def train_step(x, y):
        per_replica = strategy.run(step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return train_step


def recompute_op_count(train_step, x, y):
    graph = train_step.get_concrete_function(x, y).graph
    return sum(1 for op in graph.get_operations() if "recompute" in op.name)


def custom_loop_parity(strategy, task):
    """(a) mg.gradients in strategy.run, v1 Adam and tf_keras Adam: losses and weights."""
    depth, width, batch, steps = 8, 32, 16, 4
    init = residual_weights(depth, width, seed=0)
    batches = worker_batches(task, steps, batch, width, seed=0)
    out = {}
    for opt_name in ("v1_adam", "tf_keras_adam"):
        for method in ("tape", "memsave"):
            with strategy.scope():
                ws = [tf.Variable(w) for w in init]
                if opt_name == "v1_adam":
                    optimizer = tf.compat.v1.train.AdamOptimizer(0.01)
                else:
                    import tf_keras  # pylint: disable=import-outside-toplevel
                    optimizer = tf_keras.optimizers.Adam(0.01)
            train_step = make_train_step(strategy, ws, optimizer, method,
                                         global_batch=batch * NUM_WORKERS)
            losses = [float(train_step(x, y)) for x, y in batches]
            out[f"{opt_name}/{method}"] = {
                "losses": losses,
                "weights": [w.numpy().tolist() for w in ws],
                "recompute_ops": recompute_op_count(train_step, *batches[0]),
            }
    return out


def keras_fit_parity(strategy, task, which):
    """(b) wrap_model under strategy.scope() with Keras fit: losses and weights."""
    if which == "tf_keras":
        import tf_keras as keras  # pylint: disable=import-outside-toplevel
    else:
        import keras  # pylint: disable=import-outside-toplevel
        keras.config.disable_traceback_filtering()
    depth, width, batch_per_worker, steps = 6, 32, 16, 4
    global_batch = batch_per_worker * NUM_WORKERS
    rng = np.random.RandomState(7)
    features = rng.randn(steps * global_batch, width).astype(np.float32)
    targets = rng.randn(steps * global_batch, 1).astype(np.float32)
    options = tf.data.Options()
    # Each worker takes its share of every global batch; the same split for both runs.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = tf.data.Dataset.from_tensor_slices((features, targets)).batch(global_batch)
    dataset = dataset.with_options(options)
    init = None
    out = {}
    for method in ("plain", "wrap_model"):
        keras.utils.set_random_seed(0)   # the same initial weights in every run of the test
        with strategy.scope():
            inputs = keras.Input(shape=(width,))
            h = inputs
            for _ in range(depth):
                h = h + keras.layers.Dense(width, activation="tanh")(h)
            outputs = keras.layers.Dense(1)(h)
            model = keras.Model(inputs, outputs)
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        if init is None:
            init = model.get_weights()
        model.set_weights(init)
        if method == "wrap_model":
            mg.wrap_model(model, checkpoints="memory", fallback="error")
        record = out.setdefault(method, {})
        with RecordRewrites() as rewrites:
            try:
                history = model.fit(dataset, epochs=1, verbose=0, shuffle=False,
                                    callbacks=[batch_losses_callback(keras, record)])
            except Exception:  # pylint: disable=broad-except
                if method == "plain":
                    # Keras itself cannot train under this strategy: nothing to compare with.
                    record["error"] = traceback.format_exc()[-3000:]
                    return out
                raise
        record["epoch_loss"] = [float(v) for v in history.history["loss"]]
        record["weights"] = [w.tolist() for w in model.get_weights()]
        record["gradient_calls"] = rewrites.calls
        record["recompute_ops"] = rewrites.recompute_ops
    return out


class RecordRewrites:
    """Counts the calls wrap_model's step makes to memsave_grads and the recomputed ops they
    add, so a parity check cannot pass by never reaching the rewrite."""

    def __enter__(self):
        self.calls, self.recompute_ops = 0, 0
        self.real = api.gradients_or_fallback

        def recording(*args, **kwargs):
            graph = tf.compat.v1.get_default_graph()
            before = sum(1 for op in graph.get_operations() if "recompute" in op.name)
            grads = self.real(*args, **kwargs)
            self.calls += 1
            self.recompute_ops += sum(
                1 for op in graph.get_operations() if "recompute" in op.name) - before
            return grads

        api.gradients_or_fallback = recording
        return self

    def __exit__(self, *exc):
        api.gradients_or_fallback = self.real


def batch_losses_callback(keras, record):
    """A callback recording each batch's loss, of the model's own Keras."""
    record["losses"] = []

    class BatchLosses(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            record["losses"].append(float(logs["loss"]))

    return BatchLosses()


def peak_memory(strategy, task):
    """(c) each worker's BFC peak over one training step, GradientTape vs memsave_grads."""
    depth, width, batch = 32, 256, 64
    init = residual_weights(depth, width, seed=3)
    (x, y), = worker_batches(task, 1, batch, width, seed=3)
    out = {"depth": depth, "width": width, "batch_per_worker": batch}
    # The never-worse rule stays on here, as for users: memsave_grads rewrites only where its
    # memory model predicts a saving.
    selection.NEVER_WORSE_RULE = True
    for method in ("tape", "memsave"):
        with strategy.scope():
            ws = [tf.Variable(w) for w in init]
            optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.01)
        train_step = make_train_step(strategy, ws, optimizer, method,
                                     global_batch=batch * NUM_WORKERS)
        train_step(x, y)   # trace and warm up: the measured step allocates only what it uses
        peaks = []
        for _ in range(3):
            peak, _ = measure.peak_bytes_of(lambda: float(train_step(x, y)), device="CPU:0")
            peaks.append(peak)
        start = time.perf_counter()
        for _ in range(3):
            float(train_step(x, y))
        out[method] = {"peak_bytes": peaks, "step_seconds": (time.perf_counter() - start) / 3,
                       "recompute_ops": recompute_op_count(train_step, x, y)}
    return out


def placement(strategy, task):
    """(d) Two logical CPUs per worker, the layers of each replica alternating between them
    (model parallelism inside a data-parallel replica): where every forward op, copy and gradient
    op ran, read from the partition graphs of the executed functions. The records have the shape
    tests/test_device_placement.py checks in a single process."""
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
    depth, width, batch = 8, 16, 4
    rng = np.random.RandomState(0)
    init = [(rng.randn(width, width) / np.sqrt(width)).astype(np.float32) for _ in range(depth)]
    weights, optimizers = {}, {}
    for which in ("ref", "ours"):
        with strategy.scope():
            weights[which] = [tf.Variable(w) for w in init]
            optimizers[which] = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    x = tf.constant(rng.randn(batch, width).astype(np.float32) + task)
    records = {}

    def describe(ops):
        return {op.name: {"type": op.type, "device": op.device,
                          "groups": [g.decode() for g in op.colocation_groups()],
                          "inputs": [t.op.name for t in op.inputs]} for op in ops}

    def replica_step(x, which):
        graph = tf.compat.v1.get_default_graph()
        ws = weights[which]
        h = x
        for i in range(depth):
            # Layer 0 on cpu:1, so that an op left without a device (placed on cpu:0) is caught.
            with tf.device(f"/cpu:{(i + 1) % 2}"), tf.name_scope(f"layer{i}"):
                h = h + tf.tanh(tf.matmul(h, ws[i]))
        loss = tf.reduce_sum(tf.square(h), name="loss")
        forward = list(graph.get_operations())
        if which == "ref":
            grads = tf.gradients(loss, ws)   # TF2: always colocated with the forward ops
        else:
            grads = mg.gradients(loss, ws, checkpoints="memory",
                                 colocate_gradients_with_ops=True)
        records[which] = {"forward": describe(forward),
                          "ops": describe(op for op in graph.get_operations()
                                          if op not in set(forward))}
        # All-reduced across the workers (onto the variables' device), then applied.
        optimizers[which].apply_gradients(zip(grads, ws))
        return loss

    # Two functions, so that no graph optimisation can merge our ops with tf.gradients' ones.
    steps = {which: tf.function(lambda x, which=which: strategy.run(replica_step,
                                                                    args=(x, which)))
             for which in ("ref", "ours")}
    # Grappler off: the partition graphs then hold the ops as built, under their names.
    options = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    values, placed = {}, {}
    try:
        for which, step in steps.items():
            context.context().enable_run_metadata()
            try:
                step(x)
                values[which] = [w.numpy().tolist() for w in weights[which]]
                metadata = context.context().export_run_metadata()
            finally:
                context.context().disable_run_metadata()
            placed[which] = {node.name: node.device for function in metadata.function_graphs
                             for part in function.partition_graphs for node in part.node}
    finally:
        tf.config.optimizer.set_experimental_options(options)

    def with_placement(ops, which):
        return {name: dict(op, placed=placed[which].get(name, "")) for name, op in ops.items()}

    return {"logical_devices": [d.name for d in tf.config.list_logical_devices("CPU")],
            "forward": with_placement(records["ours"]["forward"], "ours"),
            "ref_forward": with_placement(records["ref"]["forward"], "ref"),
            "ours": with_placement(records["ours"]["ops"], "ours"),
            "ref": with_placement(records["ref"]["ops"], "ref"),
            "our_values": values["ours"], "ref_values": values["ref"]}


def run_mwms(task, out_path):
    result = {"task": task}
    if os.environ.get("MULTI_WORKER_LOGICAL_CPUS"):
        cpu = tf.config.list_physical_devices("CPU")[0]
        count = int(os.environ["MULTI_WORKER_LOGICAL_CPUS"])
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    # Small parity models: the never-worse rule would hand them to plain tf.gradients, and the
    # parity checks would compare GradientTape with tf.gradients instead of with the rewrite.
    selection.NEVER_WORSE_RULE = False
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    result["num_replicas_in_sync"] = strategy.num_replicas_in_sync
    result["worker_devices"] = list(strategy.extended.worker_devices)
    # The peak first, in a fresh process: measured after custom_loop_parity in the same
    # process, the memsave step's peak came out at the GradientTape step's (21.5-22.0 MB
    # against 16.8 MB fresh; docs/distribute.md, "Multiple workers"), for a reason not found.
    parts = [("peak", lambda: peak_memory(strategy, task)),
             ("custom_loop", lambda: custom_loop_parity(strategy, task)),
             ("fit_tf_keras", lambda: keras_fit_parity(strategy, task, "tf_keras")),
             ("fit_keras3", lambda: keras_fit_parity(strategy, task, "keras3")),
             ("placement", lambda: placement(strategy, task))]
    # For running parts by hand, in the order given (MULTI_WORKER_PARTS=custom_loop,peak).
    only = os.environ.get("MULTI_WORKER_PARTS")
    if only:
        parts = [(name, dict(parts)[name]) for name in only.split(",")]
    else:
        parts = [(name, part) for name, part in parts if name != "placement"]
    for name, part in parts:
        selection.NEVER_WORSE_RULE = False
        start = time.perf_counter()
        try:
            result[name] = part()
        except Exception:  # pylint: disable=broad-except
            # Reported to the test, which fails with the traceback; the collectives of the
            # other worker would hang if this one stopped silently, so the test's timeout
            # ends both.
            result[name] = {"error": traceback.format_exc()}
        result[name + "_seconds"] = time.perf_counter() - start
        with open(out_path, "w", encoding="utf-8") as f:   # partial results survive a hang
            json.dump(result, f)
    result["done"] = True
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f)


def run_server(job, task):
    cluster = tf.train.ClusterSpec(json.loads(os.environ["CLUSTER_SPEC"]))
    server = tf.distribute.Server(cluster, job_name=job, task_index=task, protocol="grpc",
                                  start=True)
    server.join()


def run_ps_chief(out_path):
    import tf_keras  # pylint: disable=import-outside-toplevel
    selection.NEVER_WORSE_RULE = False   # a small model: see run_mwms
    cluster = tf.train.ClusterSpec(json.loads(os.environ["CLUSTER_SPEC"]))
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster, task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    depth, width, batch, steps = 8, 32, 16, 4
    init = residual_weights(depth, width, seed=0)
    batches = worker_batches(0, steps, batch, width, seed=0)
    result = {}
    for method in ("tape", "memsave"):
        with strategy.scope():
            ws = [tf.Variable(w) for w in init]
            optimizer = tf_keras.optimizers.Adam(0.01)

        def step(x, y, method=method, ws=ws, optimizer=optimizer):
            def forward():
                h = x
                for w in ws:
                    h = h + tf.tanh(tf.matmul(h, w))
                return tf.reduce_mean(tf.square(h - y))
            if method == "tape":
                with tf.GradientTape() as tape:
                    loss = forward()
                grads = tape.gradient(loss, ws)
            else:
                loss = forward()
                grads = mg.gradients(loss, ws, checkpoints="memory")
            optimizer.apply_gradients(zip(grads, ws))
            return loss

        @tf.function
        def train_step(x, y, step=step):
            return strategy.run(step, args=(x, y))

        losses = []
        for x, y in batches:
            # One step at a time, joined: with one worker the steps then run in order, as in
            # the synchronous reference.
            remote = coordinator.schedule(train_step, args=(x, y))
            coordinator.join()
            losses.append(float(remote.fetch()))
        result[method] = {"losses": losses, "weights": [w.numpy().tolist() for w in ws],
                          "recompute_ops": sum(
                              1 for op in train_step.get_concrete_function(*batches[0])
                              .graph.get_operations() if "recompute" in op.name)}
    result["done"] = True
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f)


def main(argv):
    role = argv[1]
    if role == "mwms":
        run_mwms(int(argv[2]), argv[3])
    elif role == "server":
        run_server(argv[2], int(argv[3]))
    elif role == "ps_chief":
        try:
            run_ps_chief(argv[2])
        except Exception:  # pylint: disable=broad-except
            with open(argv[2], "w", encoding="utf-8") as f:
                json.dump({"error": traceback.format_exc()}, f)
    else:
        raise SystemExit(f"unknown role {role!r}: expected mwms, server or ps_chief")


if __name__ == "__main__":
    main(sys.argv)
