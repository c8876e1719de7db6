"""Measure peak memory of one step with the allocator's own statistics.

On CPU this needs the BFC allocator, which keeps statistics; it is enabled by the environment
variable ``TF_CPU_ALLOCATOR_USE_BFC=true`` *before TensorFlow is imported* (the allocator reads
it once, when TensorFlow starts). :func:`enable_cpu_allocator_stats` sets it;
:func:`peak_bytes_of` measures a call.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Sequence

from memsave_grads import errors

CPU_BFC_ENV = "TF_CPU_ALLOCATOR_USE_BFC"


class AllocatorStatsUnavailableError(errors.MemsaveGradsError, RuntimeError):
    """The allocator keeps no statistics (TensorFlow imported before the BFC switch was set)."""


def enable_cpu_allocator_stats() -> None:
    """Turn on the CPU BFC allocator. Must run before ``import tensorflow``."""
    if "tensorflow" in sys.modules and os.environ.get(CPU_BFC_ENV) != "true":
        raise AllocatorStatsUnavailableError(
            f"TensorFlow is already imported; set {CPU_BFC_ENV}=true in the environment (or call "
            "enable_cpu_allocator_stats()) before importing TensorFlow.")
    os.environ[CPU_BFC_ENV] = "true"


def default_device() -> str:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def peak_bytes_of(step: Callable[[], object], device: str | None = None) -> tuple[int, object]:
    """Run ``step()`` once; return (peak bytes above the memory in use before it, its result)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    device = device or default_device()
    tf.config.experimental.reset_memory_stats(device)
    before = memory_info(device)["current"]
    result = step()
    peak = memory_info(device)["peak"]
    if peak == 0 and before == 0:
        raise AllocatorStatsUnavailableError(
            f"{device} reports no allocations: on CPU set {CPU_BFC_ENV}=true before importing "
            "TensorFlow.")
    return peak - before, result


def memory_info(device: str) -> dict:
    """``tf.config.experimental.get_memory_info(device)``, or our error with the remedy where
    the allocator keeps no statistics: TensorFlow reports that with zeros on some builds and
    with ``ValueError("Allocator stats not available ...")`` on others (2.21's CPU wheel)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    try:
        return tf.config.experimental.get_memory_info(device)
    except ValueError as e:
        raise _no_statistics(device) from e


def _no_statistics(device: str) -> AllocatorStatsUnavailableError:
    return AllocatorStatsUnavailableError(
        f"{device}'s allocator keeps no statistics, so no step can be measured. On CPU set "
        f"{CPU_BFC_ENV}=true in the environment before TensorFlow is imported "
        "(memsave_grads.measure.enable_cpu_allocator_stats()).")


def check_allocator_stats(device: str | None = None) -> None:
    """Raise :class:`AllocatorStatsUnavailableError` (with the remedy) before a measurement
    is started on a device whose allocator keeps no statistics."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    device = device or default_device()
    probe = tf.zeros([1024])  # something in use, so that a keeping allocator reports it
    if not memory_info(device)["current"]:
        raise _no_statistics(device)
    del probe


#: Measured runs of each step after its warm-up run; the largest peak counts (the executor's
#: order moves a step's peak by up to 10%, and a budget is a bound).
DEFAULT_RUNS = 2


def step_peak_bytes(run: Callable[[], object], runs: int = DEFAULT_RUNS) -> int:
    """The largest peak of ``runs`` calls of ``run`` (see :func:`peak_bytes_of`), after one
    warm-up call: one-time allocations (kernel caches, constants) are not the step's, and the
    executor's order moves a step's peak by up to 10%."""
    run()
    return max(peak_bytes_of(run)[0] for _ in range(runs))


def reserve_cpu_heap(size_bytes: int = 4 << 30) -> bool:
    """Make the CPU BFC allocator's next region one of ``size_bytes`` (virtual memory: it is
    allocated and freed at once, nothing is written), or as much of it as a capped allocator
    still grants (``TF_CPU_BFC_MEM_LIMIT_IN_MB``); True where a region was reserved. Call it
    once, first, in a process that measures XLA steps or trains under a cap.

    Why: the BFC allocator grows by regions that double in size, a tensor cannot span two
    regions, and it does not split a free chunk that is less than twice a request. XLA asks
    for a step's temporaries as one buffer, so without this its peak is rounded up to the
    region it lands in (measured: 16.0 MiB for two programs whose temporaries differ by 3x).
    Under a cap, a large tensor can run out with much of the limit free in smaller regions
    (Keras 3 ResNet50 under 600 MiB: docs/benchmarks.md, "one region"). Carved out of one
    large region, every allocation is split to its own size, as on a GPU without memory
    growth, where TensorFlow takes its whole limit as one region.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    # A capped allocator may already hold a small first region: ask for a little less.
    for spare_bytes in (0, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB):
        if size_bytes <= spare_bytes:
            break
        try:
            with tf.device("CPU:0"):
                reserved = tf.raw_ops.Empty(shape=[(size_bytes - spare_bytes) // 4],
                                            dtype=tf.float32, init=False)
            del reserved
            return True
        except tf.errors.ResourceExhaustedError:
            continue
    return False


def median_seconds(step: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """The median wall time of ``repeats`` calls of ``step``, after ``warmup`` calls."""
    return interleaved_median_seconds([step], repeats=repeats, warmup=warmup)[0]


def interleaved_median_seconds(steps: Sequence[Callable[[], object]], repeats: int = 5,
                               warmup: int = 1) -> list[float]:
    """The median wall time of each of ``steps``, timed in turns: every round runs each step
    once, so a machine that slows down or speeds up during the measurement (other processes,
    frequency scaling) weighs on every step alike, and their ratios stay put. Timed one after
    the other instead, two runs of the same step on a 2-core machine differed by up to 15%."""
    for step in steps:
        for _ in range(warmup):
            step()
    times: list[list[float]] = [[] for _ in steps]
    for round_ in range(repeats):
        # Rotate who goes first: a step that follows a large one may find caches cold.
        for k in range(len(steps)):
            i = (round_ + k) % len(steps)
            start = time.perf_counter()
            steps[i]()
            times[i].append(time.perf_counter() - start)
    return [sorted(t)[len(t) // 2] for t in times]


MIB = 1024 * 1024


def profile_op_seconds(session, fetches, feed_dict=None, runs: int = 3) -> dict[str, float]:
    """Measured seconds per op name of ``session.run(fetches)``: the median over ``runs`` traced
    runs (after one untraced warm-up run).

    Pass the result as ``memsave_grads.Budget(..., op_seconds=...)`` to plan with measured
    recompute costs instead of FLOPs from static shapes (``budgets.calibrated_costs``). Profile
    the plain ``tf.gradients`` training step, so every forward op appears once. Ops that graph
    optimisation fused or renamed keep their FLOP estimate, scaled to seconds.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from memsave_grads import _validate  # pylint: disable=import-outside-toplevel
    if not callable(getattr(session, "run", None)):
        raise errors.InvalidTypeError(
            f"profile_op_seconds: session: expected a tf.compat.v1.Session (the run is traced "
            f"op by op), got {type(session).__name__}: {session!r:.80}.")
    _validate.check_count(runs, "profile_op_seconds: runs")
    session.run(fetches, feed_dict=feed_dict)
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        metadata = tf.compat.v1.RunMetadata()
        session.run(fetches, feed_dict=feed_dict, options=options, run_metadata=metadata)
        for device in metadata.step_stats.dev_stats:
            for node in device.node_stats:
                name = node.node_name.split(":")[0]
                samples.setdefault(name, []).append(
                    (node.op_end_rel_micros - node.op_start_rel_micros) * 1e-6)
    return {name: sorted(v)[len(v) // 2] for name, v in samples.items()}
