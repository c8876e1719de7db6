"""Peak memory of one training step with early per-variable updates (``minimize``).

A wide MLP whose weights dominate memory (default: 6 layers of 2048 x 2048, 16 MiB each,
batch 8). Each variant trains the same network; the table gives the CPU BFC allocator peak of
one step above the memory in use before it (variables and optimizer slots are resident), the
range over ``--runs`` steps, and the median step time. Prints a markdown table (docs/minimize.md).

    python examples/early_release.py [--width 2048] [--depth 6] [--batch 8] [--runs 5]
"""

import argparse
import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # before TensorFlow is imported
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import memsave_grads as mg  # noqa: E402
from memsave_grads import measure  # noqa: E402
from memsave_grads.optimize import minimize  # noqa: E402

V1_OPTIMIZERS = {
    "GradientDescent": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.01),
    "Momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.01, momentum=0.9),
    "Adam": lambda: tf.compat.v1.train.AdamOptimizer(1e-3),
}

V1_VARIANTS = {
    "optimizer.minimize (GATE_OP, default)": lambda loss, ws, opt: opt.minimize(loss),
    "optimizer.minimize (GATE_GRAPH)":
        lambda loss, ws, opt: opt.minimize(loss, gate_gradients=opt.GATE_GRAPH),
    "mg.gradients('memory') + apply_gradients":
        lambda loss, ws, opt: opt.apply_gradients(
            zip(mg.gradients(loss, ws, checkpoints="memory"), ws)),
    "minimize(checkpoints=None)":
        lambda loss, ws, opt: minimize(loss, opt, var_list=ws, checkpoints=None),
    "minimize(checkpoints='memory')":
        lambda loss, ws, opt: minimize(loss, opt, var_list=ws, checkpoints="memory"),
}


def _init(args):
    rng = np.random.RandomState(0)
    x = rng.randn(args.batch, args.width).astype(np.float32)
    ws = [(rng.randn(args.width, args.width) / np.sqrt(args.width)).astype(np.float32)
          for _ in range(args.depth)]
    return x, ws


def _forward(x, ws):
    h = x
    for w in ws:
        h = tf.nn.relu(tf.matmul(h, w))
    return tf.reduce_mean(tf.square(h))


def _measure(step, runs):
    step()  # the first step also copies each weight off its initializer's constant
    peaks = [measure.peak_bytes_of(step)[0] / measure.MIB for _ in range(runs)]
    return min(peaks), max(peaks), measure.median_seconds(step, repeats=runs) * 1e3


def v1_rows(args):
    x0, w0 = _init(args)
    for opt_name, make_opt in V1_OPTIMIZERS.items():
        for variant, build in V1_VARIANTS.items():
            graph = tf.Graph()
            with graph.as_default():
                ws = [tf.compat.v1.get_variable(f"w{i}", initializer=w, use_resource=True)
                      for i, w in enumerate(w0)]
                train = build(_forward(tf.constant(x0), ws), ws, make_opt())
                with tf.compat.v1.Session(graph=graph) as sess:
                    sess.run(tf.compat.v1.global_variables_initializer())
                    yield ("v1 graph", opt_name, variant,
                           *_measure(lambda: sess.run(train), args.runs))


def keras_rows(args):
    try:
        import tf_keras  # pylint: disable=import-outside-toplevel
    except ImportError:
        return
    optimizers = {
        "tf_keras legacy Adam": lambda: tf_keras.optimizers.legacy.Adam(1e-3),
        "tf_keras Adam": lambda: tf_keras.optimizers.Adam(1e-3),
        "tf_keras SGD(momentum=0.9)": lambda: tf_keras.optimizers.SGD(0.01, momentum=0.9),
    }
    x0, w0 = _init(args)
    x = tf.constant(x0)
    for opt_name, make_opt in optimizers.items():
        for variant in ("GradientTape + apply_gradients", "minimize(checkpoints='memory')"):
            ws = [tf.Variable(w) for w in w0]
            opt = make_opt()

            @tf.function
            def step(ws=ws, opt=opt, variant=variant):
                if variant.startswith("minimize"):
                    minimize(_forward(x, ws), opt, var_list=ws, checkpoints="memory")
                else:
                    with tf.GradientTape() as tape:
                        loss = _forward(x, ws)
                    opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
                return tf.constant(0)

            yield ("tf.function", opt_name, variant,
                   *_measure(lambda: step().numpy(), args.runs))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    grad_mib = args.width * args.width * 4 / measure.MIB
    print(f"{args.depth} layers {args.width}x{args.width} (one weight gradient = "
          f"{grad_mib:.0f} MiB), batch {args.batch}, TensorFlow {tf.__version__}\n")
    print("| mode | optimizer | step | peak MiB (min-max) | x gradient | median step ms |")
    print("|---|---|---|---:|---:|---:|")
    for rows in (v1_rows(args), keras_rows(args)):
        for mode, opt_name, variant, low, high, ms in rows:
            peak = f"{low:.1f}" if high - low < 0.5 else f"{low:.1f}-{high:.1f}"
            print(f"| {mode} | {opt_name} | {variant} | {peak} | {high / grad_mib:.1f} | "
                  f"{ms:.0f} |", flush=True)


if __name__ == "__main__":
    main()
