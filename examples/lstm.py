"""An LSTM over 1000 time steps, trained with and without ``memsave_grads.recompute``.

The step function (one LSTM cell with dropout) runs in a ``tf.while_loop`` inside a
``tf.function``; gradients come from ``tf.GradientTape``. Without recompute, the loop's gradient
stores every gate activation of every step; with ``recompute(cell)`` it stores the step's inputs
(x_t, h, c), the dropout mask and the outputs, and runs the cell again in the backward loop.
Prints the peak memory of one training step (CPU BFC allocator) and the median step time.

    python examples/lstm.py [--steps 1000] [--batch 32] [--units 256] [--repeats 3]
"""

import argparse
import os

# Allocator statistics on CPU: before TensorFlow (which memsave_grads imports) is imported.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import memsave_grads  # noqa: E402
from memsave_grads import measure  # noqa: E402


def make_train_step(steps, batch, features, units, use_recompute, learning_rate=0.01):
    rng = np.random.RandomState(0)
    inputs = tf.constant(rng.randn(steps, batch, features).astype(np.float32))
    targets = tf.constant(rng.randn(batch, units).astype(np.float32))
    kernel = tf.Variable((rng.randn(features + units, 4 * units) / np.sqrt(features + units))
                         .astype(np.float32))
    bias = tf.Variable(np.zeros(4 * units, np.float32))
    variables = [kernel, bias]

    def cell(x_t, h, c):
        z = tf.matmul(tf.concat([x_t, h], axis=1), kernel) + bias
        i, f, g, o = tf.split(z, 4, axis=1)
        c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
        h = tf.nn.dropout(tf.sigmoid(o) * tf.tanh(c), rate=0.1)
        return h, c

    step_fn = memsave_grads.recompute(cell) if use_recompute else cell

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            def body(t, h, c):
                h, c = step_fn(inputs[t], h, c)
                return t + 1, h, c

            zeros = tf.zeros([batch, units])
            _, h, _ = tf.while_loop(lambda t, h, c: t < steps, body, [0, zeros, zeros])
            loss = tf.reduce_mean(tf.square(h - targets))
        grads = tape.gradient(loss, variables)
        for var, grad in zip(variables, grads):
            var.assign_sub(learning_rate * grad)
        return loss

    return train_step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--units", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    rows = []
    for use_recompute in (False, True):
        train_step = make_train_step(args.steps, args.batch, args.features, args.units,
                                     use_recompute)
        train_step()  # trace and warm up
        peak_bytes, loss = measure.peak_bytes_of(train_step)
        seconds = measure.median_seconds(train_step, repeats=args.repeats, warmup=0)
        rows.append(("recompute(cell)" if use_recompute else "plain cell", peak_bytes, seconds,
                     float(loss)))

    base_peak, base_seconds = rows[0][1], rows[0][2]
    print(f"LSTM, T={args.steps}, batch {args.batch}, {args.features} features, "
          f"{args.units} units, GradientTape in tf.function, CPU")
    print(f"{'method':<18}{'peak MiB':>10}{'vs plain':>10}{'step s':>9}{'time ratio':>12}")
    for name, peak_bytes, seconds, _ in rows:
        print(f"{name:<18}{peak_bytes / measure.MIB:>10.1f}{base_peak / peak_bytes:>9.2f}x"
              f"{seconds:>9.3f}{seconds / base_seconds:>11.2f}x")


if __name__ == "__main__":
    main()
