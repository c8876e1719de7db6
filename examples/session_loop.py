"""Train a deep residual MLP in a tf.compat.v1 Session with memsave_grads.gradients.

The only change from a plain TF 1 training loop is the line that computes the gradients:
``memsave_grads.gradients(loss, variables, checkpoints="memory")`` instead of
``tf.gradients(loss, variables)``. Only about sqrt(depth) activations are kept for the backward
pass; the rest are recomputed.

    python examples/session_loop.py [--steps 20] [--depth 32] [--width 256] [--batch 128]
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
    features = rng.normal(size=(args.batch, 16)).astype(np.float32)
    targets = np.sin(features @ rng.normal(size=(16, 1))).astype(np.float32)

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [args.batch, 16], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [args.batch, 1], name="y")
        w_in = tf.Variable(tf.random.normal([16, args.width], stddev=0.25, seed=1), name="w_in")
        h = tf.matmul(x, w_in)
        variables = [w_in]
        for i in range(args.depth):
            w = tf.Variable(tf.random.normal([args.width, args.width],
                                             stddev=0.5 / np.sqrt(args.width), seed=2 + i),
                            name=f"w{i}")
            variables.append(w)
            h = h + tf.tanh(tf.matmul(h, w))
        w_out = tf.Variable(tf.zeros([args.width, 1]), name="w_out")
        variables.append(w_out)
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w_out) - y))

        grads = memsave_grads.gradients(loss, variables, checkpoints="memory")
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(args.learning_rate)
        train_op = optimizer.apply_gradients(zip(grads, variables))
        init = tf.compat.v1.global_variables_initializer()

    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        feed = {x: features, y: targets}
        for step in range(1, args.steps + 1):
            _, value = session.run([train_op, loss], feed_dict=feed)
            print(f"step {step:3d}  loss {value:.5f}")


if __name__ == "__main__":
    main()
