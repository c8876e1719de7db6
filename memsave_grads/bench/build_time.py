"""What planning and the rewrite cost: gradient construction time against graph size.

For each graph (a family at several sizes) and each method, the time to build the gradients
in a fresh ``tf.Graph``: plain ``tf.gradients``, and ``memsave_grads.gradients`` with each
strategy (planning, the never-worse decision and the rewrite). The methods are built in turns
(one of each per round, ``rounds`` rounds) and the best of each is kept, in *CPU seconds of
this process* (``time.process_time``): on a shared machine the wall time of a build moves with
the other processes' load, its CPU time much less, and the turns spread what is left over every
method alike. The graph is built again for every measurement (building it is not timed).
Every build is a first build: the plans kept across retraces (design note "planning cost") are
dropped before each, so planning is always in the time (a step traced again costs less: its
plan is reused). Each build starts after a full garbage collection (not timed), so that it pays
for the collections its own allocations trigger and not for one the earlier builds left due.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from typing import Callable, Sequence

import tensorflow as tf

from memsave_grads import api
from memsave_grads._tf import selection
from memsave_grads.bench import graphs
from memsave_grads import _tables as tables
from memsave_grads.patching import original_gradients

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    """A graph of the table: ``build()`` makes (loss, variables) in the current graph."""

    family: str
    size: int
    build: Callable[[], graphs.BuiltModel]


def residual_mlp(depth: int) -> BuildSpec:
    """``depth`` blocks ``h + tanh(h @ W)``; small tensors (construction does not depend on
    them)."""
    return BuildSpec("residual MLP (blocks)", depth,
                     lambda: graphs.mlp(depth=depth, width=32, batch=8, residual=True))


def transformer(layers_count: int) -> BuildSpec:
    """The benchmark's tf_keras Transformer encoder, at a small width."""
    def build():
        from memsave_grads.bench import keras_graphs  # pylint: disable=import-outside-toplevel
        return keras_graphs.transformer(layers_count=layers_count, batch=2, sequence=16,
                                        d_model=32, heads=4)
    return BuildSpec("Transformer (layers)", layers_count, build)


def conv_resnet(blocks: int) -> BuildSpec:
    """The raw-op conv ResNet with batch norm, at a small size."""
    return BuildSpec("conv ResNet (blocks)", blocks,
                     lambda: graphs.conv_resnet(blocks=blocks, batch=2, image=8,
                                                channels=(8, 16)))


#: The graphs of ``memsave-grads build-time``: up to about 50 000 ops.
FAMILIES: dict[str, Callable[[int], BuildSpec]] = {
    "residual": residual_mlp, "transformer": transformer, "convnet": conv_resnet}
DEFAULT_SIZES = {"residual": (250, 1000, 3000), "transformer": (6, 24, 48),
                 "convnet": (16, 64, 128)}


@dataclasses.dataclass
class BuildResult:
    spec: BuildSpec
    graph_ops: int
    tf_gradients_ops: int
    seconds: dict  # method -> best CPU seconds
    failed: dict = dataclasses.field(default_factory=dict)  # method -> error line


def _build_once(spec: BuildSpec, checkpoints) -> tuple[float, int, int]:
    """(CPU seconds of the gradients call, graph ops before it, ops the call added)."""
    graph = tf.Graph()
    with graph.as_default():
        loss, variables = spec.build()
        before = len(graph.get_operations())
        selection.forget_plans()   # the rebuilt graph would find its plan kept otherwise
        # A full collection now, untimed: otherwise the one the earlier builds' garbage
        # triggers (0.2-0.5 s in this process, half a 250-block build) lands on whichever
        # build runs next. Each build then pays for the collections its own allocations
        # trigger, and no others.
        gc.collect()
        start = time.process_time()
        if checkpoints is None:
            original_gradients(loss, list(variables))
        else:
            api.gradients(loss, list(variables), checkpoints=checkpoints)
        return time.process_time() - start, before, len(graph.get_operations()) - before


def measure(spec: BuildSpec, methods: Sequence, rounds: int = 3) -> BuildResult:
    """``methods`` (None: plain tf.gradients, else a ``checkpoints=`` value) built in turns,
    ``rounds`` times; the best CPU time of each."""
    best: dict = {}
    failed: dict = {}
    graph_ops = tf_gradients_ops = 0
    for round_ in range(rounds):
        for k in range(len(methods)):
            method = methods[(round_ + k) % len(methods)]
            label = _label(method)
            if label in failed:
                continue
            try:
                seconds, graph_ops, added = _build_once(spec, method)
            except Exception as e:  # pylint: disable=broad-except  # the row says so
                failed[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
                _LOG.exception("%s %d, %s failed", spec.family, spec.size, label)
                continue
            if method is None:
                tf_gradients_ops = added
            best[label] = min(best.get(label, float("inf")), seconds)
    _LOG.info("%s %d: %s", spec.family, spec.size,
                 {m: f"{s:.2f} s" for m, s in best.items()})
    return BuildResult(spec, graph_ops, tf_gradients_ops, best, failed)


def as_data(result: BuildResult) -> dict:
    """One graph's row for ``--format json``: CPU seconds by method, not ratios."""
    return {"family": result.spec.family, "size": result.spec.size,
            "graph_ops": result.graph_ops, "tf_gradients_ops": result.tf_gradients_ops,
            "cpu_seconds": dict(result.seconds), "failed": dict(result.failed)}


def _label(method) -> str:
    return "tf.gradients" if method is None else str(method)


def table(results: Sequence[BuildResult], methods: Sequence) -> str:
    """One row per graph: its size, tf.gradients' build, and each method's ratio to it."""
    labels = [_label(m) for m in methods]
    header = ["graph", "size", "graph ops", "tf.gradients ops", "tf.gradients CPU s"]
    header += [f"{label} (ratio)" for label in labels[1:]]
    rows = []
    for r in results:
        plain = r.seconds.get(labels[0])
        cells = [r.spec.family, str(r.spec.size), str(r.graph_ops), str(r.tf_gradients_ops),
                 "-" if plain is None else tables.number(plain)]
        for label in labels[1:]:
            if label in r.failed:
                cells.append(f"failed: {r.failed[label][:40]}")
            elif label in r.seconds and plain:
                cells.append(f"{tables.number(r.seconds[label])} ({r.seconds[label] / plain:.2f}x)")
            else:
                cells.append("-")
        rows.append(cells)
    return tables.markdown_table(header, "lrrrr" + "r" * (len(labels) - 1), rows)


TABLE_NOTES = (
    "CPU seconds of the process to build the gradients in a fresh graph (the model's own "
    "construction not timed, each build after a full garbage collection), best of several "
    "rounds with the methods built in turns; ratio: "
    "against tf.gradients on the same graph. graph ops: ops of the model before the gradients "
    "(variable initialisers included); tf.gradients ops: the ops tf.gradients adds. "
    "memsave_grads' time is planning, the never-worse decision and the rewrite.")
