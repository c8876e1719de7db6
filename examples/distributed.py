"""Data-parallel training with tf.distribute.MirroredStrategy and memsave_grads.

Each replica computes its gradients with ``memsave_grads.gradients`` inside ``strategy.run``
(in a ``tf.function``); the Keras 2 optimizer sums them across replicas. On a CPU-only machine
the two replicas are two logical CPU devices. The same model is trained twice, with
``tf.GradientTape`` and with memsave_grads, and the per-step losses are printed side by side.

    pip install -e ".[keras]"
    python examples/distributed.py [--steps 10] [--depth 16] [--width 256] [--batch 64]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()

    # Logical devices must be configured before TensorFlow initialises its devices.
    if not tf.config.list_physical_devices("GPU"):
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas)
    import tf_keras  # pylint: disable=import-outside-toplevel

    import memsave_grads  # pylint: disable=import-outside-toplevel

    strategy = tf.distribute.MirroredStrategy()
    print(f"{strategy.num_replicas_in_sync} replicas: "
          f"{[d.split('/')[-1] for d in strategy.extended.worker_devices]}")

    rng = np.random.default_rng(0)
    features = rng.normal(size=(args.steps * args.batch, 32)).astype(np.float32)
    targets = np.sin(features @ rng.normal(size=(32, 1))).astype(np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((features, targets)).batch(args.batch)

    def train(method):
        with strategy.scope():
            tf_keras.utils.set_random_seed(0)
            inputs = tf_keras.Input(shape=(32,))
            h = tf_keras.layers.Dense(args.width, activation="tanh")(inputs)
            for i in range(args.depth):
                small = tf_keras.initializers.RandomNormal(stddev=0.5 / np.sqrt(args.width),
                                                           seed=i)
                h = h + tf_keras.layers.Dense(args.width, activation="tanh",
                                              kernel_initializer=small)(h)
            outputs = tf_keras.layers.Dense(1, kernel_initializer="zeros")(h)
            model = tf_keras.Model(inputs, outputs)
            optimizer = tf_keras.optimizers.Adam(1e-3)

        def step(x, y):
            def loss_fn():
                per_example = tf.reduce_mean(tf.square(model(x, training=True) - y), axis=1)
                return tf.nn.compute_average_loss(per_example, global_batch_size=args.batch)

            variables = model.trainable_variables
            if method == "memsave_grads":
                loss = loss_fn()
                grads = memsave_grads.gradients(loss, variables, checkpoints="memory")
            else:
                with tf.GradientTape() as tape:
                    loss = loss_fn()
                grads = tape.gradient(loss, variables)
            optimizer.apply_gradients(zip(grads, variables))  # all-reduces across replicas
            return loss

        @tf.function
        def train_step(x, y):
            per_replica = strategy.run(step, args=(x, y))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        batches = list(strategy.experimental_distribute_dataset(dataset))
        losses = [float(train_step(x, y)) for x, y in batches]
        graph = train_step.get_concrete_function(*batches[0]).graph
        recomputed = [op for op in graph.get_operations() if "recompute" in op.name]
        return losses, model.get_weights(), recomputed

    tape_losses, tape_weights, _ = train("GradientTape")
    ours_losses, ours_weights, recomputed = train("memsave_grads")
    print(f"{'step':>4}  {'GradientTape':>14}  {'memsave_grads':>14}")
    for i, (a, b) in enumerate(zip(tape_losses, ours_losses), 1):
        print(f"{i:4d}  {a:14.6f}  {b:14.6f}")
    worst = max(float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
                for a, b in zip(ours_weights, tape_weights))
    print(f"largest relative weight difference after {args.steps} steps: {worst:.2e}")
    devices = sorted({op.device.split("/")[-1] for op in recomputed if op.device})
    print(f"{len(recomputed)} recomputed ops in the traced step, on devices {devices}")


if __name__ == "__main__":
    main()
