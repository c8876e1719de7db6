"""Train a Keras model with ``model.fit``, with and without ``memsave_grads.keras.wrap_model``.

Builds the same residual MLP twice (``h = h + tanh(Dense(h))`` blocks, identical initial
weights), trains both on the same data (shuffle=False) and prints the loss per epoch of each;
then measures one training step (``model.train_on_batch``) of each: the CPU BFC allocator's
peak and the median time.

    python examples/keras_fit.py [--keras 2|3] [--depth 32] [--width 512] [--batch 512]
                                 [--epochs 3] [--steps_per_epoch 4] [--optimizer adam|sgd]

``--keras 2`` uses tf_keras (``pip install tf-keras``), ``--keras 3`` uses ``keras`` (TensorFlow
2.21's ``tf.keras``). On CPU, the peak needs TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow is
imported; this script sets it.
"""

import os

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # allocator statistics on CPU (before TF)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402

import numpy as np  # noqa: E402

from memsave_grads import measure  # noqa: E402
from memsave_grads.keras import wrap_model  # noqa: E402


def import_keras(version: str):
    if version == "2":
        import tf_keras  # pylint: disable=import-outside-toplevel
        return tf_keras
    import keras  # pylint: disable=import-outside-toplevel
    return keras


def residual_mlp(keras, depth: int, width: int, inputs: int):
    x = keras.Input((inputs,))
    h = keras.layers.Dense(width, name="stem")(x)
    for i in range(depth):
        update = keras.layers.Dense(
            width, activation="tanh", name=f"block{i}",
            kernel_initializer=keras.initializers.VarianceScaling(0.1, seed=i))(h)
        h = keras.layers.Add(name=f"add{i}")([h, update])
    return keras.Model(x, keras.layers.Dense(1, name="head")(h), name="resmlp")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keras", choices=["2", "3"], default="2")
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps_per_epoch", type=int, default=4)
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    parser.add_argument("--checkpoints", default="memory")
    args = parser.parse_args()
    keras = import_keras(args.keras)

    rng = np.random.default_rng(0)
    rows = args.batch * args.steps_per_epoch
    x = rng.normal(size=(rows, args.width)).astype(np.float32)
    y = np.sin(x @ rng.normal(size=(args.width, 1)) / np.sqrt(args.width)).astype(np.float32)

    learning_rate = 1e-4 if args.optimizer == "adam" else 1e-3
    keras.utils.set_random_seed(0)
    initial = residual_mlp(keras, args.depth, args.width, args.width).get_weights()

    def build(wrapped: bool):
        model = residual_mlp(keras, args.depth, args.width, args.width)
        model.set_weights(initial)
        optimizer = (keras.optimizers.Adam(learning_rate) if args.optimizer == "adam"
                     else keras.optimizers.SGD(learning_rate))
        model.compile(optimizer=optimizer, loss="mse")
        return wrap_model(model, checkpoints=args.checkpoints) if wrapped else model

    print(f"Keras {args.keras} ({keras.__name__} {keras.__version__}): residual MLP, "
          f"{args.depth} blocks of width {args.width}, batch {args.batch}, {args.optimizer}")
    histories, weights = {}, {}
    for name, wrapped in (("model.fit", False), ("wrap_model + fit", True)):
        model = build(wrapped)
        history = model.fit(x, y, epochs=args.epochs, batch_size=args.batch, shuffle=False,
                            verbose=0)
        histories[name] = history.history["loss"]
        weights[name] = model.get_weights()
    print(f"{'epoch':>5}  {'model.fit loss':>16}  {'wrapped loss':>16}")
    for epoch, (plain, ours) in enumerate(zip(*histories.values()), start=1):
        print(f"{epoch:5d}  {plain:16.6f}  {ours:16.6f}")
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(*weights.values()))
    print(f"final weights: largest absolute difference {worst:.2e} (learning rate "
          f"{learning_rate:g}; float32 sums in another order, see docs/keras.md)")

    batch_x, batch_y = x[:args.batch], y[:args.batch]
    results = {}
    for name, wrapped in (("model.fit", False), ("wrap_model + fit", True)):
        step = build(wrapped).train_on_batch
        step(batch_x, batch_y)  # trace; the first run allocates kernels' scratch
        peak, _ = measure.peak_bytes_of(lambda: step(batch_x, batch_y))
        seconds = measure.median_seconds(lambda: step(batch_x, batch_y),
                                        repeats=5, warmup=1)
        results[name] = (peak / measure.MIB, seconds)
    print("\none train_on_batch step (CPU BFC allocator peak above what was in use before):")
    print(f"{'':18}{'peak MiB':>10}  {'median ms':>10}")
    for name, (peak_mib, seconds) in results.items():
        print(f"{name:18}{peak_mib:10.1f}  {seconds * 1e3:10.0f}")
    (plain_peak, plain_s), (ours_peak, ours_s) = results.values()
    print(f"wrap_model: {plain_peak / ours_peak:.2f}x less peak memory, "
          f"{ours_s / plain_s:.2f}x the step time")


if __name__ == "__main__":
    main()
