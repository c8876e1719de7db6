"""A custom ``tf.function`` training step that calls memsave_grads.gradients.

The variables are created outside the function (as any TF 2 model's are); inside it,
``memsave_grads.gradients`` works on the traced graph like ``tf.gradients`` does, and the
update is a plain ``var.assign_sub(learning_rate * grad)`` (no Keras needed).

    python examples/tf_function_loop.py [--steps 20] [--depth 32] [--width 256] [--batch 128]
"""

import argparse

import numpy as np
import tensorflow as tf

import memsave_grads


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--learning_rate", type=float, default=0.001)
    args = parser.parse_args()

    # A fixed regression problem: learn y = sin(x @ v) from 16 input features.
    rng = np.random.default_rng(0)
    features = tf.constant(rng.normal(size=(args.batch, 16)), tf.float32)
    targets = tf.sin(tf.matmul(features, tf.constant(rng.normal(size=(16, 1)), tf.float32)))

    w_in = tf.Variable(tf.random.normal([16, args.width], stddev=0.25, seed=1), name="w_in")
    hidden = [tf.Variable(tf.random.normal([args.width, args.width],
                                           stddev=0.5 / np.sqrt(args.width), seed=2 + i),
                          name=f"w{i}")
              for i in range(args.depth)]
    w_out = tf.Variable(tf.zeros([args.width, 1]), name="w_out")
    variables = [w_in, *hidden, w_out]

    def loss_fn(x, y):
        h = tf.matmul(x, w_in)
        for w in hidden:
            h = h + tf.tanh(tf.matmul(h, w))
        return tf.reduce_mean(tf.square(tf.matmul(h, w_out) - y))

    @tf.function
    def train_step(x, y):
        loss = loss_fn(x, y)
        grads = memsave_grads.gradients(loss, variables, checkpoints="memory")
        for var, grad in zip(variables, grads):
            var.assign_sub(args.learning_rate * grad)
        return loss

    # Called without Grappler's gradient accumulators, as wrap_model's fit is (docs/design.md,
    # note "Grappler's gradient accumulators").
    with memsave_grads.without_grappler_scheduling():
        for step in range(1, args.steps + 1):
            loss = train_step(features, targets)
            print(f"step {step:3d}  loss {float(loss):.5f}")


if __name__ == "__main__":
    main()
