"""Issue 36's GPU table in one call of a lent GPU machine (docs/benchmarks.md, "On a GPU").

There, after ``../shared/gpu/README.md``'s set-up (``. /tmp/gpu_env.sh``)::

    python3 scripts/gpu_table.py run SECONDS            # everything that fits in SECONDS
    python3 scripts/gpu_table.py run 600 --quick        # a rehearsal on this machine's CPU
    python3 scripts/gpu_table.py run 480 --xla-only     # only the jit_compile cells and Keras

Phase 1 measures peaks, several processes at once (a process's allocator peak is its own, so
parallel processes do not disturb it): the peer table's cells (``bench.xla``: the Transformer and
the conv ResNet, four methods, with and without ``jit_compile``), then Keras 3 ``train_on_batch``
stock against ``wrap_model`` (ResNet50 64x64 batch 256, Transformer encoder batch 128). Phase 2
runs alone, for times: the demo, each compilation's step times in turns, the variants below,
and the two Keras 3 steps' first steps (tracing and compiling) and step times, stock against
``wrap_model``.
Each result is one JSON line on stdout and in ``$OUT/results.jsonl`` (``$OUT`` or /tmp/out), as
it comes, so a run cut short keeps what it measured.

Every process takes its GPU memory as one region (a logical device, as fit-limit's tries do)
of at most ``REGION_MIB``, and less where the processes at once would not fit in the GPU's
memory together (a region is reserved whole at the first allocation). With
``TF_FORCE_GPU_ALLOW_GROWTH`` instead (removed from the environment here), the allocator grows
by regions that double, and XLA's one temporary buffer took a whole region: every
``jit_compile`` peak read as a power of two (256.0, 128.0, 64.0 MiB on 2026-11-28).

Variants (left out with ``--no-variants``; times and peaks under ``jit_compile``, against the
default): the rewrite makes each kept sum and incoming gradient a buffer that XLA reads as it is
(``ordering.materialized``, note "memory under XLA"). By default, for a GPU, through an
``XlaOptimizationBarrier`` each (which XLA's GPU compiler keeps until after scheduling, where its
CPU compiler removes it before fusion). ``conditional`` builds what the CPU gets, and what the
GPU got until 2026-11-28: a conditional each, whose predicate XLA's GPU runtime reads back to the
host, waiting for the stream, before it runs a branch (``ConditionalThunk``): 111 in the
Transformer's step, which ran 1.75x tf.gradients' time on an H200 where RematScope ran 1.12x.
``per_level`` passes a level's tensors through one conditional (its outputs' ``None`` gradients
are not kept: for measuring only), ``none`` through nothing. On the CPU (2026-11-28):
conditional and per_level both 44.0 / 62.8 MiB, none 56.1 / 78.8 (Transformer / conv ResNet).
On an H200 (2026-11-28, fourth session): barriers 30.0 / 52.1 MiB at 1.17x / 1.18x
tf.gradients' time, conditional 38.1 / 52.1 at 1.79x / 1.29x, per_level 52.0 / 52.1 at
1.61x / 1.27x, none 38.0 / 56.3 at 1.14x / 1.16x (docs/gpu.md).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import subprocess
import sys
import time

REGION_MIB = 12000
#: The share of the GPU's memory the processes at once may reserve together.
GPU_SHARE = 0.85
RESULT = "GPU_TABLE_RESULT "
VARIANTS = ("default", "conditional", "per_level", "none")


# --------------------------------------------------------------------------------------------
# The child: one cell in a fresh process
# --------------------------------------------------------------------------------------------

def _one_region(region_mib: int) -> None:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=region_mib)])


def _region_mib(workers: int) -> int:
    """``REGION_MIB``, or less where ``workers`` regions would not fit in the GPU together."""
    try:
        total = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                                "--format=csv,noheader,nounits"], capture_output=True,
                               text=True, check=True, timeout=30).stdout.split()[0]
        return min(REGION_MIB, int(GPU_SHARE * int(total) / max(1, workers)))
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return REGION_MIB


@contextlib.contextmanager
def _variant(name: str):
    """The rewrite's conditionals as ``name`` says, while the steps are traced."""
    from memsave_grads._tf import ordering, stitch  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import cond_v2  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    saved = stitch._materialized, ordering.materialized, ordering.barriers_kept
    if name == "none":
        stitch._materialized = lambda boundaries, active, arrival: boundaries
    elif name == "conditional":
        ordering.barriers_kept = lambda t: False
    elif name == "per_level":
        def grouped(tensors, zero):
            return list(cond_v2.cond_v2(tf.equal(zero, 0.0),
                                        lambda: [tf.identity(t) for t in tensors],
                                        lambda: [tf.identity(t) for t in tensors],
                                        name="materialized"))
        ordering.materialized = grouped
    try:
        yield
    finally:
        stitch._materialized, ordering.materialized, ordering.barriers_kept = saved


def _keras_times(request: dict) -> dict:
    """A Keras 3 model argument of fit-limit (``fit_limit.build``: the model and a synthetic
    batch), stock and under ``wrap_model`` (Keras' default ``jit_compile="auto"``): each first
    ``train_on_batch`` (tracing, compiling, running) in seconds, then their step times in
    turns."""
    import memsave_grads as mg  # pylint: disable=import-outside-toplevel
    from memsave_grads import fit_limit, measure  # pylint: disable=import-outside-toplevel
    (_, stock, (x, y)), (_, wrapped, _) = (fit_limit.build(request["source"], request["batch"])
                                           for _ in range(2))
    mg.wrap_model(wrapped)
    first = {}
    for name, model in (("stock", stock), ("wrap_model", wrapped)):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        first[name] = time.perf_counter() - start
    seconds = measure.interleaved_median_seconds(
        [lambda: stock.train_on_batch(x, y), lambda: wrapped.train_on_batch(x, y)],
        repeats=request["repeats"])
    return {"first_step_s": first, "step_ms": {"stock": seconds[0] * 1e3,
                                               "wrap_model": seconds[1] * 1e3},
            "jit_compile": [str(stock.jit_compile), str(wrapped.jit_compile)]}


def _cell(request: dict) -> dict:
    _one_region(request["region_mib"])
    if request["measure"] == "keras_times":
        return _keras_times(request)
    from memsave_grads.bench import xla  # pylint: disable=import-outside-toplevel
    from memsave_grads import measure  # pylint: disable=import-outside-toplevel
    spec = request["spec"]
    if request["measure"] == "peak":
        with _variant(request.get("variant", "default")):
            return xla._measure_here({  # pylint: disable=protected-access
                "function": spec["function"], "kwargs": spec["kwargs"],
                "methods": [request["method"]], "jit_compile": request["jit"],
                "measure": "peak"})
    model = getattr(xla, spec["function"])(**spec["kwargs"])
    steps, labels = [], []
    for method, variant in request["entries"]:
        step = xla._training_step(model, method, request["jit"], 1e-4)  # noqa  # protected
        with _variant(variant):
            step()  # traced under the variant
        steps.append(step)
        labels.append(f"{method} [{variant}]")
    seconds = measure.interleaved_median_seconds(steps, repeats=request["repeats"])
    return {"ms": {label: s * 1e3 for label, s in zip(labels, seconds)}}


# --------------------------------------------------------------------------------------------
# The parent
# --------------------------------------------------------------------------------------------

class Run:
    def __init__(self, seconds: float, quick: bool, workers: int = 1):
        self.start = time.time()
        self.region_mib = _region_mib(workers)
        self.deadline = self.start + seconds
        self.quick = quick
        self.out = os.environ.get("OUT") or "/tmp/out"
        os.makedirs(self.out, exist_ok=True)
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
        os.environ.pop("TF_FORCE_GPU_ALLOW_GROWTH", None)  # one region a process: see above
        # The driver compiles TensorFlow's kernels for the GPU on first use (about a minute):
        # a cache large enough keeps them for the next processes; XLA's autotuning likewise.
        os.environ.setdefault("CUDA_CACHE_MAXSIZE", str(4 << 30))
        os.environ.setdefault("CUDA_CACHE_PATH", "/tmp/cudacache")
        os.environ.setdefault("XLA_FLAGS", "--xla_gpu_per_fusion_autotune_cache_dir=/tmp/xlaat")

    def left(self) -> float:
        return self.deadline - time.time()

    def emit(self, record: dict) -> None:
        record["t_s"] = round(time.time() - self.start, 1)
        line = json.dumps(record, default=str)
        print(line, flush=True)
        with open(os.path.join(self.out, "results.jsonl"), "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def child(self, request: dict) -> dict:
        request = dict(request, region_mib=self.region_mib)
        try:
            proc = subprocess.run([sys.executable, __file__, "cell", json.dumps(request)],
                                  capture_output=True, text=True, check=False,
                                  timeout=max(10.0, self.left()))
        except subprocess.TimeoutExpired:
            return {"failed": "ran past the deadline"}
        for line in reversed(proc.stdout.splitlines()):
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
        return {"failed": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}

    def specs(self):
        from memsave_grads.bench import models  # pylint: disable=import-outside-toplevel
        if self.quick:
            return [("Transformer (small)", "transformer",
                     {"layers_count": 2, "batch": 2, "sequence": 16}),
                    ("conv ResNet (small)", "conv_resnet", {"blocks": 2, "batch": 2, "image": 8})]
        chosen = {s.function: s for s in models.xla_models()}
        return [(chosen[f].name, f, chosen[f].kwargs) for f in ("transformer", "conv_resnet")]

    def peak(self, name, function, kwargs, method, jit, variant="default") -> None:
        t = time.time()
        result = self.child({"measure": "peak", "method": method, "jit": jit, "variant": variant,
                             "spec": {"function": function, "kwargs": kwargs}})
        peak = result.get("peak_bytes")
        self.emit({"cell": "xla_peak", "model": name, "method": method, "jit": jit,
                   "variant": variant, "peak_mib": None if peak is None else peak / 2**20,
                   "err": result.get("max_rel_error"), "failed": result.get("failed"),
                   "wall_s": round(time.time() - t, 1)})

    def times(self, name, function, kwargs, jit, entries) -> None:
        t = time.time()
        result = self.child({"measure": "time", "jit": jit, "entries": entries, "repeats": 5,
                             "spec": {"function": function, "kwargs": kwargs}})
        self.emit({"cell": "xla_time", "model": name, "jit": jit, **result,
                   "wall_s": round(time.time() - t, 1)})

    def keras(self, source, method, batch) -> None:
        from memsave_grads import fit_limit  # pylint: disable=import-outside-toplevel
        t = time.time()
        a = fit_limit.attempt(source, method, batch, self.region_mib, steps=3,
                              timeout_s=max(30.0, self.left() - 30))
        mib = lambda b: None if b is None else b / 2**20  # noqa: E731
        self.emit({"cell": "keras_peak", "model": f"{source.split(':')[1]} b{batch}",
                   "method": method, "fits": a.fits, "peak_mib": mib(a.peak_bytes),
                   "step_peak_mib": mib(a.step_peak_bytes), "error": a.error,
                   "wall_s": round(time.time() - t, 1)})

    def keras_times(self, source, batch) -> None:
        t = time.time()
        result = self.child({"measure": "keras_times", "source": source, "batch": batch,
                             "repeats": 3 if self.quick else 10})
        self.emit({"cell": "keras_time", "model": f"{source.split(':')[1]} b{batch}", **result,
                   "wall_s": round(time.time() - t, 1)})

    def shell(self, name, command, timeout) -> None:
        t = time.time()
        try:
            p = subprocess.run(command, shell=True, capture_output=True, text=True,
                               timeout=max(10.0, timeout), check=False)
            self.emit({"cell": name, "rc": p.returncode, "stdout": p.stdout[-4000:],
                       "stderr": p.stderr[-800:], "wall_s": round(time.time() - t, 1)})
        except subprocess.TimeoutExpired:
            self.emit({"cell": name, "timed_out": True, "wall_s": round(time.time() - t, 1)})

    def main(self, workers: int, variants: bool, xla_only: bool = False) -> None:
        from memsave_grads.bench import xla  # pylint: disable=import-outside-toplevel
        from memsave_grads import fit_limit  # pylint: disable=import-outside-toplevel
        self.shell("device", "nvidia-smi -L; python3 -c \"import tensorflow as tf; print("
                   "tf.__version__, tf.config.list_physical_devices('GPU'))\" 2>&1 | tail -1",
                   120)
        specs = self.specs()
        models = "memsave_grads.bench.fit_limit_models:"
        keras = [(models + "resnet50", 8 if self.quick else 256),
                 (models + "transformer_encoder", 4 if self.quick else 128)]
        self.emit({"cell": "regions", "mib": self.region_mib, "workers": workers})
        pool = cf.ThreadPoolExecutor(max_workers=workers)
        jobs = [pool.submit(self.keras, source, method, batch)
                for source, batch in keras for method in (fit_limit.PLAIN, "memory")]
        jobs += [pool.submit(self.peak, *spec, method, jit)
                 for jit in ((True,) if xla_only else (True, False))
                 for spec in specs for method in xla.METHODS]
        if variants:
            jobs += [pool.submit(self.peak, *spec, xla.MEMORY, True, variant)
                     for spec in specs for variant in VARIANTS[1:]]
        done, pending = cf.wait(jobs, timeout=0.6 * self.left())
        self.emit({"cell": "peaks", "done": len(done), "pending": len(pending)})
        pool.shutdown(wait=not pending, cancel_futures=True)
        if pending:  # the times need the GPU alone: what still runs would disturb them
            self.emit({"cell": "end", "left_s": round(self.left(), 1)})
            return
        quick = " --depth 8 --width 64 --batch 8" if self.quick else ""
        self.shell("demo", f"{sys.executable} -m memsave_grads demo --repeats 5{quick}",
                   min(150.0, self.left() - 20))
        for jit in ((True,) if xla_only else (True, False)):
            for spec in specs:
                entries = [[m, "default"] for m in xla.METHODS]
                if variants and jit:
                    entries += [[xla.MEMORY, v] for v in VARIANTS[1:]]
                if self.left() > 60:
                    self.times(*spec, jit, entries)
        for source, batch in keras:
            if self.left() > 90:
                self.keras_times(source, batch)
        self.emit({"cell": "end", "left_s": round(self.left(), 1)})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the whole table within SECONDS")
    run.add_argument("seconds", type=float)
    run.add_argument("--quick", action="store_true", help="small models: a CPU rehearsal")
    run.add_argument("--workers", type=int, default=8, help="peak processes at once")
    run.add_argument("--no-variants", dest="variants", action="store_false",
                     help="leave out the variants of the materialized buffers")
    run.add_argument("--xla-only", action="store_true",
                     help="leave out the peer table's cells without jit_compile")
    cell = sub.add_parser("cell", help="(internal) one cell, in this process")
    cell.add_argument("request")
    args = parser.parse_args(argv)
    if args.command == "cell":
        print(RESULT + json.dumps(_cell(json.loads(args.request))), flush=True)
        return
    Run(args.seconds, args.quick, args.workers).main(args.workers, args.variants,
                                                   args.xla_only)
    sys.stdout.flush()
    os._exit(0)  # pylint: disable=protected-access  # what still runs ends with the command


if __name__ == "__main__":
    main()
