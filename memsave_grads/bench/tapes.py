"""Benchmark: ``tf.GradientTape`` training, unrouted and routed (design note "tape routing").

Three programs as TF2 users write them, each cell measured in a fresh process
(:mod:`memsave_grads._child`, allocator peaks from :mod:`memsave_grads.measure`):

- a ``tf.function`` training loop with ``tf.GradientTape`` and a Keras 3 SGD on a residual MLP
  (``h = h + Dense(width, gelu)(h)``): as written, under ``memsave_grads.patch()``, and with
  ``memsave_grads.GradientTape``;
- a Keras 3 model whose own ``train_step`` takes a ``tf.GradientTape`` gradient, trained with
  ``fit``: stock, and under ``memsave_grads.wrap_model``;
- a Keras 3 ``LSTM`` (a ``tf.while_loop``) trained in a ``tf.function`` loop under a
  *persistent* tape, which TensorFlow answers by wrapping the loop in a function call
  (docs/usage.md, "Tapes that TensorFlow wraps"): as written, under ``patch()`` (the loop's
  reads hoisted, nothing recomputed inside the call), and with a non-persistent tape instead,
  as written and under ``patch()``. Its sizes are fixed (:data:`LSTM_SHAPE`).

Each trains 3 steps from the same initial weights; the table gives the largest step peak after
the first (which traces and builds the optimizer), the ratio to the unrouted peak, and the
largest difference of the losses and of the final weights from the unrouted run's.

Run: ``python -m memsave_grads.bench.tapes [--blocks 32 --width 512 --batch 2048]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Sequence

from memsave_grads import _child as child

MIB = 2 ** 20
STEPS = 3

#: (program, way) cells, the unrouted way of each program first.
CELLS = (("tape loop", "tf.GradientTape"), ("tape loop", "patch()"),
         ("tape loop", "memsave_grads.GradientTape"),
         ("own train_step", "stock fit"), ("own train_step", "wrap_model"),
         *(("LSTM under a persistent tape", way) for way in (
             "tf.GradientTape", "patch()", "one non-persistent tape",
             "patch(), one non-persistent tape")))

#: The LSTM program's (time steps, features, units, batch).
LSTM_SHAPE = (200, 64, 256, 32)


def _model(keras, blocks: int, width: int, own_step: bool, activation: str = "gelu"):
    """The residual MLP, with small initial weights so that 32 blocks train without blowing up;
    with ``own_step``, a ``keras.Model`` subclass whose ``train_step`` uses a tape."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    class OwnStep(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"objective": loss}

    keras.utils.set_random_seed(0)
    small = keras.initializers.RandomNormal(stddev=0.1 / width ** 0.5)
    inputs = keras.Input((width,))
    h = inputs
    for _ in range(blocks):
        h = keras.layers.Add()([h, keras.layers.Dense(width, activation=activation,
                                                     kernel_initializer=small)(h)])
    outputs = keras.layers.Dense(1, kernel_initializer=small)(h)
    return (OwnStep if own_step else keras.Model)(inputs, outputs)


def _data(width: int, batch: int):
    import numpy as np  # pylint: disable=import-outside-toplevel
    rng = np.random.RandomState(0)
    return (rng.randn(STEPS * batch, width).astype("float32"),
            rng.randn(STEPS * batch, 1).astype("float32"))


def _lstm_model_and_data(keras):
    import numpy as np  # pylint: disable=import-outside-toplevel
    steps, features, units, batch = LSTM_SHAPE
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((steps, features)), keras.layers.LSTM(units),
                              keras.layers.Dense(1)])
    rng = np.random.RandomState(0)
    return model, batch, (rng.randn(STEPS * batch, steps, features).astype("float32"),
                          rng.randn(STEPS * batch, 1).astype("float32"))


def _measure_here(request: dict) -> dict:
    """In the child: train one cell, return its step peaks and losses, save its weights."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import keras  # pylint: disable=import-outside-toplevel
    import memsave_grads as mg  # pylint: disable=import-outside-toplevel
    from memsave_grads import measure  # pylint: disable=import-outside-toplevel

    program, way = request["program"], request["way"]
    blocks, width, batch = request["blocks"], request["width"], request["batch"]
    if program == "LSTM under a persistent tape":
        model, batch, (x, y) = _lstm_model_and_data(keras)
    else:
        x, y = _data(width, batch)
        model = _model(keras, blocks, width, own_step=program == "own train_step",
                       activation=request.get("activation", "gelu"))
    optimizer = keras.optimizers.SGD(0.01)
    peaks, losses = [], []
    measure.check_allocator_stats()
    if program in ("tape loop", "LSTM under a persistent tape"):
        tape_class = tf.GradientTape
        if way == "memsave_grads.GradientTape":
            tape_class = lambda: mg.GradientTape(checkpoints="memory")  # noqa: E731
        elif program == "LSTM under a persistent tape" and "non-persistent" not in way:
            tape_class = lambda: tf.GradientTape(persistent=True)  # noqa: E731

        @tf.function
        def step(xb, yb):
            with tape_class() as tape:
                loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        patch = mg.patch("memory") if way.startswith("patch()") else None
        for i in range(STEPS):
            xb, yb = tf.constant(x[i * batch:(i + 1) * batch]), tf.constant(y[i * batch:(i + 1)
                                                                              * batch])
            peak, loss = measure.peak_bytes_of(lambda: step(xb, yb))
            peaks.append(peak)
            losses.append(float(loss))
        if patch is not None:
            patch.__exit__(None, None, None)
    else:
        model.compile(optimizer=optimizer, loss="mse")
        if way == "wrap_model":
            mg.wrap_model(model, "memory")

        class Peaks(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch_index, logs=None):
                tf.config.experimental.reset_memory_stats("CPU:0")
                self.before = tf.config.experimental.get_memory_info("CPU:0")["current"]

            def on_train_batch_end(self, batch_index, logs=None):
                info = tf.config.experimental.get_memory_info("CPU:0")
                peaks.append(info["peak"] - self.before)
                losses.append(float(logs["objective"]))

        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=[Peaks()])
    np.savez(request["weights_file"], *model.get_weights())
    return {"peaks": peaks, "losses": losses}


def measure_cell(program: str, way: str, blocks: int, width: int, batch: int,
                 weights_file: str, activation: str = "gelu") -> dict:
    """One cell in a fresh process; ``{"failed": reason}`` where it did not finish."""
    outcome = child.run("memsave_grads.bench.tapes", {
        "program": program, "way": way, "blocks": blocks, "width": width, "batch": batch,
        "weights_file": weights_file, "activation": activation})
    if outcome.returncode != 0 or outcome.result is None:
        return {"failed": outcome.last_error_line()}
    return outcome.result


def _max_rel_diff(got, want) -> float:
    import numpy as np  # pylint: disable=import-outside-toplevel
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def table(blocks: int, width: int, batch: int, activation: str = "gelu",
          programs: Sequence[str] | None = None) -> str:
    """Measure every cell (of ``programs``, default all) and return the markdown table."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    rows = ["| program | way | step peak MiB | vs unrouted | max loss diff | max weight diff |",
            "|---|---|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as folder:
        reference: dict = {}
        for program, way in CELLS:
            if programs is not None and program not in programs:
                continue
            weights_file = os.path.join(folder, f"{len(reference)}_{way.split()[0]}.npz")
            result = measure_cell(program, way, blocks, width, batch, weights_file, activation)
            if "failed" in result:
                rows.append(f"| {program} | {way} | failed: {result['failed'][:80]} | | | |")
                continue
            peak = max(result["peaks"][1:])
            weights = list(np.load(weights_file).values())
            base = reference.setdefault(program, (peak, result["losses"], weights))
            ratio = f"{base[0] / peak:.2f}x" if base[0] is not peak else "1x"
            loss_diff = _max_rel_diff(result["losses"], base[1])
            weight_diff = max(_max_rel_diff(g, w) for g, w in zip(weights, base[2]))
            rows.append(f"| {program} | {way} | {peak / MIB:.1f} | {ratio} | {loss_diff:.1e} "
                        f"| {weight_diff:.1e} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--activation", default="gelu", help="of each block's Dense layer")
    parser.add_argument("--programs", default=None,
                        help="comma-separated programs to measure (default: all): "
                             + ", ".join(dict.fromkeys(p for p, _ in CELLS)))
    args = parser.parse_args(argv)
    programs = None if args.programs is None else [p.strip() for p in args.programs.split(",")]
    known = dict.fromkeys(p for p, _ in CELLS)
    unknown = [p for p in programs or () if p not in known]
    if unknown:
        parser.error(f"--programs: unknown program(s) {unknown}; expected some of "
                     f"{list(known)}, comma-separated")
    print(f"Residual MLP, {args.blocks} blocks h = h + Dense({args.width}, {args.activation})(h), "
          f"batch "
          f"{args.batch}, Keras 3 SGD(0.01), {STEPS} steps; peaks of steps 2-{STEPS} above what "
          "was in use before each step; each row a fresh process. Diffs: max |a - b| / max |b| "
          "against the unrouted row of the program. The LSTM program: Keras 3 LSTM(%d) over %d "
          "steps of %d features, batch %d, whatever the MLP's sizes.\n"
          % (LSTM_SHAPE[2], LSTM_SHAPE[0], LSTM_SHAPE[1], LSTM_SHAPE[3]))
    print(table(args.blocks, args.width, args.batch, args.activation, programs))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        child.serve(_measure_here)
    else:
        sys.exit(main())
