"""Measure peak memory of one step with the allocator's own statistics.

On CPU this needs the BFC allocator, which keeps statistics; it is enabled by the environment
variable ``TF_CPU_ALLOCATOR_USE_BFC=true`` *before TensorFlow is imported* (docs/design.md,
fact 5). :func:`enable_cpu_allocator_stats` sets it; :func:`peak_bytes_of` measures a call.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

CPU_BFC_ENV = "TF_CPU_ALLOCATOR_USE_BFC"


class AllocatorStatsUnavailableError(RuntimeError):
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
    before = tf.config.experimental.get_memory_info(device)["current"]
    result = step()
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    if peak == 0 and before == 0:
        raise AllocatorStatsUnavailableError(
            f"{device} reports no allocations: on CPU set {CPU_BFC_ENV}=true before importing "
            "TensorFlow.")
    return peak - before, result


def median_seconds(step: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


MIB = 1024 * 1024
