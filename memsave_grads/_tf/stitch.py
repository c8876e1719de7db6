"""Backpropagate segment by segment and add up the partials.

The forward region is cut at the *kept* ops (checkpoints, stateful ops, intermediate ``xs``).
Each kept op owns a *segment*: itself plus the region ops above it that are not kept. The
segments feeding ``ys`` directly form the *top* segment, which is not copied: its activations
are the last ones computed and backprop starts with them, so recomputing them would only cost
time.

Order (design note "levels" in docs/design.md): a kept op's *level* is one more than the
deepest level of any segment that reads it (the top segment has level 0). Every partial for a
kept tensor comes from a lower level, so when its level comes its gradient is complete. Each
level is one ``tf.gradients`` call over the union of its segments. Copies read fresh identity
*boundaries* of the kept tensors and ``xs`` (note "boundaries"); those, and
the inputs of original ops, are the call's sources and ``stop_gradients``: backprop stops there
and the partial w.r.t. each is read off.
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

import tensorflow as tf
from absl import logging

from memsave_grads._tf import rewrite
from memsave_grads._tf import graph as tf_graph
from memsave_grads import errors


def zeros_like(x: tf.Tensor) -> tf.Tensor:
    """What ``tf.gradients(..., unconnected_gradients='zero')`` returns for ``x``."""
    if x.dtype == tf.resource:
        from tensorflow.python.ops import resource_variable_ops  # pylint: disable=import-outside-toplevel
        from tensorflow.python.ops import default_gradient  # pylint: disable=import-outside-toplevel
        return tf.zeros(resource_variable_ops.variable_shape(x),
                        dtype=default_gradient.get_zeros_dtype(x))
    return tf.zeros_like(x)


def _densify(g, t: tf.Tensor) -> tf.Tensor:
    if isinstance(g, tf.IndexedSlices):
        if g.dense_shape is None:
            raise errors.SparseGradientError(
                f"The gradient of {t.name!r} adds a sparse partial (IndexedSlices) to a dense one, "
                f"but the sparse partial has no dense_shape, so it cannot be densified. Give the "
                f"tensor a known shape, or keep the gather/embedding output as a checkpoint so the "
                f"sparse partial reaches the variable unmixed.")
        return tf.convert_to_tensor(g)
    return g


def aggregate(partials: Sequence, t: tf.Tensor):
    """Sum the partials of one tensor: dense stays dense, sparse stays sparse (concatenated),
    and only a mix of both is densified (as tf.gradients does)."""
    partials = [g for g in partials if g is not None]
    if not partials:
        return None
    if len(partials) == 1:
        return partials[0]
    if all(isinstance(g, tf.IndexedSlices) for g in partials):
        indices = [g.indices for g in partials]
        if len({i.dtype for i in indices}) > 1:
            indices = [tf.cast(i, tf.int64) for i in indices]
        return tf.IndexedSlices(tf.concat([g.values for g in partials], axis=0),
                                tf.concat(indices, axis=0), partials[0].dense_shape)
    return _add_per_device([_densify(g, t) for g in partials])


def _add_per_device(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """``add_n`` as tf.gradients does it (``_MultiDeviceAddN``): one sum per device, each
    colocated with its first summand, then the sum of those; so a summed gradient stays on
    the device of the forward op that produced its first partial."""
    by_device = collections.defaultdict(list)
    for t in tensors:
        by_device[t.device or ""].append(t)
    sums = []
    for device in sorted(by_device):
        with tf_graph.colocated_with(by_device[device][0].op):
            sums.append(tf.add_n(by_device[device]))
    return sums[0] if len(sums) == 1 else tf.add_n(sums)


def _gradient_ops(g) -> list[tf.Operation]:
    if isinstance(g, tf.IndexedSlices):
        return [g.values.op, g.indices.op]
    return [g.op]


class _Backprop:
    """State of one rewritten gradient computation (a single use, then discarded)."""

    def __init__(self, region: Sequence[tf.Operation], kept: Iterable[tf.Operation],
                 xs: Sequence[tf.Tensor]):
        self.region_set = set(region)
        self.kept = set(kept)
        self.x_refs = {x.ref() for x in xs}
        self.partials: dict = collections.defaultdict(list)
        self.totals: dict = {}

    def ends_segment(self, t: tf.Tensor) -> bool:
        """Kept tensors and xs: where a segment walk stops and partials are collected."""
        return (t.op in self.region_set and t.op in self.kept) or t.ref() in self.x_refs

    def segment(self, seeds: Iterable[tf.Operation]) -> list[tf.Operation]:
        """``seeds`` plus the region ops above them, up to (not into) kept ops and ``xs``."""
        seen, stack = set(), list(seeds)
        while stack:
            op = stack.pop()
            if op in seen:
                continue
            seen.add(op)
            stack.extend(t.op for t in op.inputs
                         if t.op in self.region_set and not self.ends_segment(t)
                         and t.op not in seen)
        return sorted(seen, key=lambda op: op._id)  # pylint: disable=protected-access

    def sources(self, segment_ops: Iterable[tf.Operation]) -> list[tf.Tensor]:
        seen, out = set(), []
        for op in segment_ops:
            for t in op.inputs:
                if self.ends_segment(t) and t.ref() not in seen:
                    seen.add(t.ref())
                    out.append(t)
        return out

    def total(self, t: tf.Tensor):
        """The complete gradient of ``t`` (call only once every partial has arrived)."""
        key = t.ref()
        if key not in self.totals:
            self.totals[key] = aggregate(self.partials.get(key, ()), t)
        return self.totals[key]

    def is_external_x(self, t: tf.Tensor) -> bool:
        return t.ref() in self.x_refs and t.op not in self.region_set

    def run(self, targets, target_grads, sources, user_stops, tf_kwargs,
            readers=None) -> None:
        """One tf.gradients call; its results become partials of ``sources``.

        ``readers[i]`` is the tensor the differentiated ops actually read for ``sources[i]``:
        a boundary for copied segments, the source itself for original ops. All of them are
        stop_gradients, so backprop ends there and the partial is read off.
        """
        if not targets or not sources:
            return
        readers = list(sources) if readers is None else readers
        grads = tf_graph.gradients_stopped_at(
            targets, readers, target_grads, list(readers) + list(user_stops), **tf_kwargs)
        for t, g in zip(sources, grads):
            if g is not None:
                self.partials[t.ref()].append(g)


def backprop(ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor], grad_ys: Sequence,
             region: Sequence[tf.Operation], kept: Iterable[tf.Operation],
             user_stops: Sequence[tf.Tensor], tf_kwargs: dict, unconnected_zero: bool,
             scope_prefix: str, nested: dict | None = None) -> list:
    """Gradients of ``ys`` w.r.t. ``xs`` with every non-top segment recomputed.

    ``nested`` (multi-level plans, design note "multi-level"): for a kept op, ``(sub_kept,
    sub_nested)``: ops of its segment kept while the segment is replayed, and their own nested
    plans. Such a level recurses into this function over its copies.
    """
    state = _Backprop(region, kept, xs)
    nested = nested or {}

    # Level 0: the top segment, through the original ops.
    top_targets, top_grads, top_seeds, extra_sources = [], [], [], []
    for y, gy in zip(ys, grad_ys):
        if state.ends_segment(y):
            extra_sources.append(y)
        elif y.op not in state.region_set:
            continue  # y does not depend on xs
        else:
            top_seeds.append(y.op)
        top_targets.append(y)
        top_grads.append(gy)
    top = state.segment(top_seeds)
    sources = state.sources(top)
    known = {t.ref() for t in sources}
    for t in extra_sources:  # a y that is itself kept or an x: its gradient is its grad_y
        if t.ref() not in known:
            known.add(t.ref())
            sources.append(t)
    state.run(top_targets, top_grads, sources, user_stops, tf_kwargs)

    # Levels: deepest segment reading a kept op, +1. Kept ops in reverse topological order.
    level = {op: 1 for op in state.kept if op in state.region_set}
    segments: dict[tf.Operation, list[tf.Operation]] = {}
    for op in sorted(level, key=lambda o: o._id, reverse=True):  # pylint: disable=protected-access
        replayable = tf_graph.is_replayable(op)
        segments[op] = state.segment([op]) if replayable else [op]
        for t in state.sources(segments[op]):
            if t.op in level and t.op is not op:
                level[t.op] = max(level[t.op], level[op] + 1)

    # Original (uncopied) ops that read only external xs, such as variable reads, feed nothing
    # but xs: one call at the very end does them all (design note "levels").
    deferred = [op for op in level if not tf_graph.is_replayable(op)
                and all(state.is_external_x(t) for t in state.sources([op]))]
    by_level = collections.defaultdict(list)
    for op, lvl in level.items():
        by_level[lvl].append(op)
    deferred_set = set(deferred)
    levels = [(lvl, [op for op in by_level[lvl] if op not in deferred_set])
              for lvl in sorted(by_level)] + [("final", deferred)]

    for lvl, group in levels:
        group = sorted(group, key=lambda o: o._id)  # pylint: disable=protected-access
        active = []
        for op in group:
            ds = [state.total(t) for t in op.outputs]
            if any(d is not None for d in ds):
                active.append((op, ds))
        if not active:
            continue
        replayed = [op for op, _ in active if tf_graph.is_replayable(op)]
        to_copy = sorted({s for op in replayed for s in segments[op]},
                         key=lambda o: o._id)  # pylint: disable=protected-access
        scope = f"{scope_prefix}/recompute_level{lvl}"
        # Copies read fresh identity boundaries, not the kept tensors themselves: tf.gradients
        # walks everything downstream of its sources, and the originals have the whole rest of
        # the graph downstream. Identities, not StopGradient, so that a later derivative of
        # these gradients still reaches the checkpoints (design note "boundaries").
        copied_sources = state.sources(to_copy)
        boundaries = {}
        with tf.name_scope(f"{scope}/boundary"):
            for t in copied_sources:
                with t.graph.colocate_with(t.op):
                    boundaries[t.ref()] = tf.identity(t)
        control = [c for _, ds in active for d in ds if d is not None for c in _gradient_ops(d)]
        copies = rewrite.copy_ops(to_copy, scope, control, replacements=boundaries)
        targets, target_grads = [], []
        for op, ds in active:
            produced = copies.get(op, op)
            for t, d in zip(produced.outputs, ds):
                if d is not None:
                    targets.append(t)
                    target_grads.append(d)
        original_sources = state.sources([op for op, _ in active if op not in copies])
        sources = copied_sources + original_sources
        readers = [boundaries[t.ref()] for t in copied_sources] + original_sources
        if any(op in nested for op in replayed):
            _nested_level(state, nested, replayed, copies, active, copied_sources, boundaries,
                          original_sources, user_stops, tf_kwargs, scope)
        else:
            state.run(targets, target_grads, sources, user_stops, tf_kwargs, readers=readers)
        logging.vlog(1, "memsave_grads: level %s: %d kept ops, %d ops recomputed",
                     lvl, len(active), len(to_copy))

    results = []
    for x in xs:
        g = state.total(x)
        if g is None and unconnected_zero:
            g = zeros_like(x)
        results.append(g)
    return results


def _translate(nested: dict, copies: dict) -> dict:
    """A nested plan of original ops, in terms of their copies."""
    return {copies[k]: (frozenset(copies[s] for s in sub if s in copies),
                        _translate(children, copies))
            for k, (sub, children) in nested.items() if k in copies}


def _nested_level(state: _Backprop, nested: dict, replayed, copies: dict, active,
                  copied_sources, boundaries: dict, original_sources, user_stops, tf_kwargs,
                  scope: str) -> None:
    """A level whose segments have their own checkpoints (design note "multi-level").

    The level's copies are a region of their own: ys = the copied kept outputs, grad_ys = their
    gradients, xs = the boundaries, kept = the copies of the sub-kept ops. ``backprop`` on it
    keeps only those while the copies run forward (their roots wait for the level's gradients,
    note "scheduling") and copies each sub-segment once more, later, recursively.
    """
    active_copies = {copies[op] for op in replayed}
    sub_kept, sub_nested = set(), {}
    for op in replayed:
        if op in nested:
            sub, children = nested[op]
            sub_kept |= {copies[s] for s in sub if s in copies} - active_copies
            sub_nested.update(_translate(children, copies))
    targets, target_grads, original_targets, original_grads = [], [], [], []
    for op, ds in active:
        produced = copies.get(op)
        for i, d in enumerate(ds):
            if d is None:
                continue
            if produced is not None:
                targets.append(produced.outputs[i])
                target_grads.append(d)
            else:
                original_targets.append(op.outputs[i])
                original_grads.append(d)
    readers = [boundaries[t.ref()] for t in copied_sources]
    region = sorted(copies.values(), key=lambda o: o._id)  # pylint: disable=protected-access
    grads = backprop(targets, readers, target_grads, region, sub_kept, user_stops, tf_kwargs,
                     unconnected_zero=False, scope_prefix=f"{scope}/nested",
                     nested={k: v for k, v in sub_nested.items() if k in sub_kept})
    for t, g in zip(copied_sources, grads):
        if g is not None:
            state.partials[t.ref()].append(g)
    state.run(original_targets, original_grads, original_sources, user_stops, tf_kwargs)


def nested_ops(children, region: Sequence[tf.Operation]) -> dict:
    """``multilevel.NestedPlan`` children (node indices of ``region``) as ``backprop``'s
    ``nested`` argument (ops)."""
    return {region[k]: (frozenset(region[s] for s in child.kept),
                        nested_ops(child.children, region))
            for k, child in (children or {}).items()}
