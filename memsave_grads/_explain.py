"""``explain()``: what a ``checkpoints=`` choice would keep and recompute, and the predicted peak.

It runs the same selection as :func:`memsave_grads.gradients` and stops before the rewrite, so
it adds nothing to the graph. The predicted peaks come from the static memory model
(:mod:`memsave_grads.core.memory_model`): compare them with each other, and with a measurement
(``python -m memsave_grads benchmark`` prints both), not with a byte-exact expectation.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from memsave_grads._tf import graph as tf_graph
from memsave_grads._tf import selection
from memsave_grads import _validate
from memsave_grads import api
from memsave_grads import errors
from memsave_grads.core import budgets
from memsave_grads.core import memory_model
from memsave_grads.core import schedule as schedule_lib
from memsave_grads.keras import checks as keras_checks
from memsave_grads.keras import flavour as keras_flavour
from memsave_grads.keras import tracing as keras_tracing

@dataclasses.dataclass(frozen=True)
class LevelReport:
    """One backward level: kept tensors whose gradients are complete, recomputed together.

    ``depth``: 1 for a level replayed once from kept tensors; d > 1 where the level's segments
    have checkpoints of their own (a nested plan), replayed again d - 1 levels further down.
    """

    level: int
    kept_ops: int
    recomputed_ops: int
    recomputed_bytes: int
    depth: int = 1


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """A readable account of a plan; ``str(report)`` prints it.

    Attributes:
      checkpoints: the checkpoints argument as given.
      forward_ops: ops between xs and ys.
      checkpoint_names: outputs the strategy chose to keep, in topological order.
      kept_anyway: ops kept whatever the strategy (stateful ops, variable reads, intermediate xs)
        or added so that no op is recomputed twice (design note "single owner").
      kept_bytes: bytes of all kept outputs (variable reads count 0: they alias the variable).
      top_segment_ops: ops above the last checkpoints, run once and not recomputed.
      levels: the recomputed segments, grouped as the backward pass visits them.
      predicted_peak_bytes: the static memory model's peak with this plan.
      predicted_plain_peak_bytes: the same for plain ``tf.gradients``.
      unknown_dimensions: whether some shape had unknown dimensions that no assumed batch size
        stands for (counted as 1, so the byte figures are per unit of each unknown dimension,
        typically per example).
      recompute_flops: floating-point operations of the recomputed ops (static shapes).
      forward_flops: the same for the whole forward region (run once by any method).
      budget_bytes: the budget the plan was solved for, when ``checkpoints`` is a budget.
      planner / plan_reason: who made the plan (``core.plan.Plan.planner``) and why it chose
        it, where the planner says.
      rewrite: whether ``gradients()`` runs this plan; False where it keeps plain
        ``tf.gradients``' schedule instead (design note "never worse").
      schedule_reason: why, in one sentence.
      scratch_bytes: the largest scratch of one backward step's gradient kernels (convolution
        im2col buffers), which the never-worse rule adds to both predicted peaks.
      decided_plan_peak_bytes / decided_plain_peak_bytes: the two peaks the rule compared
        (None where it needed none).
      assumed_batch_size: the examples an unknown batch dimension counted as
        (:func:`memsave_grads.assume_batch_size`), or None.
      recomputed_loops: ``(name, iterations replayed together)`` of each loop whose body the
        plan recomputes inside (design note "control flow and calls").
      replayed_stateful_ops: conds and calls with variable reads or random draws that the
        plan replays from the state they output (names).
    """

    checkpoints: object
    forward_ops: int
    checkpoint_names: tuple
    kept_anyway: int
    kept_bytes: int
    top_segment_ops: int
    levels: tuple
    predicted_peak_bytes: int
    predicted_plain_peak_bytes: int
    unknown_dimensions: bool
    recompute_flops: float = 0.0
    forward_flops: float = 0.0
    budget_bytes: int | None = None
    rewrite: bool = True
    planner: str = ""
    plan_reason: str = ""
    schedule_reason: str = ""
    scratch_bytes: int = 0
    decided_plan_peak_bytes: int | None = None
    decided_plain_peak_bytes: int | None = None
    assumed_batch_size: int | None = None
    recomputed_loops: tuple = ()
    replayed_stateful_ops: tuple = ()

    @property
    def recompute_fraction(self) -> float:
        """Recomputed FLOPs over the forward pass's (0.3: 30% of a forward pass again)."""
        return self.recompute_flops / self.forward_flops if self.forward_flops else 0.0

    def as_dict(self) -> dict:
        """The report as plain data (numbers in bytes and FLOPs, names as strings), for JSON:
        every attribute, ``checkpoints`` as its ``repr`` where it is not a string, and the
        derived ``recompute_fraction``."""
        # Not dataclasses.asdict, which deep-copies: checkpoints may hold graph tensors.
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if not isinstance(self.checkpoints, str):
            data["checkpoints"] = repr(self.checkpoints)
        data["checkpoint_names"] = list(self.checkpoint_names)
        data["levels"] = [dataclasses.asdict(level) for level in self.levels]
        data["recompute_fraction"] = self.recompute_fraction
        return data

    @property
    def predicted_saving(self) -> float:
        """Predicted tf.gradients peak over this plan's (2.0: half the memory)."""
        return self.predicted_plain_peak_bytes / max(1, self.predicted_peak_bytes)

    def __str__(self) -> str:
        largest = max(self.levels, key=lambda lv: lv.recomputed_bytes, default=None)
        recomputed = sum(lv.recomputed_ops for lv in self.levels)
        lines = [
            f"memsave_grads plan for checkpoints={self.checkpoints!r}",
            f"  forward ops between xs and ys: {self.forward_ops}",
            f"  checkpoints chosen: {len(self.checkpoint_names)}"
            + (f" ({_names(self.checkpoint_names)})" if self.checkpoint_names else ""),
            f"  kept as well: {self.kept_anyway} ops (stateful ops, variable reads, xs, and "
            "ops two segments would share)",
            f"  kept activations: {_size(self.kept_bytes)}",
            f"  top segment (not recomputed): {self.top_segment_ops} ops",
            f"  recomputed: {_count(recomputed, 'op')} in "
            f"{_count(len(self.levels), 'backward level')}"
            + (f"; largest level {_count(largest.recomputed_ops, 'op')}, "
               f"{_size(largest.recomputed_bytes)} of outputs (not all alive at once)"
               if largest else ""),
            f"  recomputed FLOPs: {self.recompute_flops:.3g} ({self.recompute_fraction:.0%} of the "
            "forward pass)",
            f"  predicted peak: {_size(self.predicted_peak_bytes)} vs tf.gradients "
            f"{_size(self.predicted_plain_peak_bytes)} ({_saving(self.predicted_saving)})"
            + (f"; budget {_size(self.budget_bytes)}" if self.budget_bytes is not None else ""),
        ]
        if self.plan_reason:
            lines.insert(1, f"  planner: {self.planner} ({self.plan_reason})")
        if self.recomputed_loops:
            lines.append(
                f"  loops recomputed inside: {len(self.recomputed_loops)} ("
                + ", ".join(f"{name}: {k} iteration{'s' if k > 1 else ''} at a time"
                            for name, k in self.recomputed_loops[:3])
                + (", ..." if len(self.recomputed_loops) > 3 else "") + ")")
        if self.replayed_stateful_ops:
            lines.append(
                f"  conds and calls with variable reads or random draws replayed from their "
                f"state: {len(self.replayed_stateful_ops)} "
                f"({_names(self.replayed_stateful_ops, limit=3)})")
        nested = [lv for lv in self.levels if lv.depth > 1]
        if nested:
            lines.append(
                f"  nested: {len(nested)} of the levels replay their segments from checkpoints "
                f"of their own, up to {max(lv.depth for lv in nested)} recomputation levels deep")
        if self.scratch_bytes and self.decided_plan_peak_bytes is not None:
            lines.append(
                f"  with the gradient kernels' scratch (up to {_size(self.scratch_bytes)} at one "
                f"backward step): {_size(self.decided_plan_peak_bytes)} vs tf.gradients "
                f"{_size(self.decided_plain_peak_bytes)}")
        if self.schedule_reason:
            lines.append(("  schedule: this plan: " if self.rewrite else
                          "  schedule: plain tf.gradients, not this plan: ")
                         + self.schedule_reason)
        if self.assumed_batch_size is not None:
            lines.append(f"  (an unknown batch dimension counts as {self.assumed_batch_size} "
                         "examples)")
        if self.unknown_dimensions:
            lines.append("  (shapes with unknown dimensions: sizes count each unknown "
                         "dimension as 1, e.g. per example)")
        return "\n".join(lines)


def _depth(model, sched, kept_nodes) -> int:
    """Recomputation depth of a level (1 unless its segments have sub-plans)."""
    nested = sched.nested(model, kept_nodes)
    if nested is None:
        return 1
    return 1 + max((_depth(model, nested, lv.nodes) for lv in nested.levels), default=0)


def _size(nbytes: int) -> str:
    return budgets.format_bytes(nbytes, "report")


def _count(n: int, noun: str) -> str:
    """``1 op``, ``2 ops``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _saving(ratio: float) -> str:
    """How a peak compares with tf.gradients': ``2.09x less``, ``the same``, ``1.10x more``."""
    if round(ratio, 2) == 1.0:
        return "the same"
    return f"{ratio:.2f}x less" if ratio > 1 else f"{1 / ratio:.2f}x more"


def _names(names, limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... {len(names) - limit} more" if len(names) > limit else "")


#: The batch ``explain(model)`` traces where neither ``batch_size`` nor ``data`` is given.
EXPLAINED_BATCH_SIZE = 32


@tf.autograph.experimental.do_not_convert
def explain(ys, xs: api.Sources | None = None, checkpoints: api.Checkpoints = "memory", *,
            grad_ys=None, batch_size: int | None = None, sequence_length: int | None = None,
            data=None, release_gradients_early: bool = False,
            **tf_gradients_kwargs) -> PlanReport:
    """What ``gradients(ys, xs, checkpoints=checkpoints)`` would keep, recompute, and peak at.

    Takes the arguments of :func:`memsave_grads.gradients`, raises the same errors, and adds
    no op to the graph. ``grad_ys`` does not change the plan; it is needed only where
    ``gradients()`` needs it (a complex y has no default initial gradient).

    ``ys`` may also be a compiled Keras model (``xs`` then left out): the plan of one training
    step of it, as ``wrap_model(model, checkpoints)`` would make it, for a batch of
    ``batch_size`` examples (default 32; shapes from the model's inputs, outputs and loss; an
    unknown sequence dimension is ``sequence_length``), or of the arrays ``data=(x, y)``, whose
    shapes are the batch's (so not with ``batch_size`` or ``sequence_length``). Nothing runs.
    The size arguments apply to a model only: a loss tensor has its shapes.
    The weight gradients count as the step holds them: all alive until the optimizer applies
    them, or one at a time with ``release_gradients_early=True`` (as
    ``wrap_model(model, release_gradients_early=True)``, which a wrapped model also tells).

    Example::

        print(memsave_grads.explain(loss, model.trainable_variables, checkpoints="memory"))
        print(memsave_grads.explain(keras_model, checkpoints="memory", batch_size=64))
    """
    if keras_flavour.is_keras_model(ys):
        if xs is not None or tf_gradients_kwargs or grad_ys is not None:
            options = sorted(tf_gradients_kwargs) + (["grad_ys"] if grad_ys is not None else [])
            raise errors.InvalidArgumentError(
                "xs: explain(model) explains the gradients of the model's loss with respect to "
                f"its trainable weights; got xs={xs!r:.60} and options {options}. Leave them "
                "out (or pass the loss tensor and the variables instead of the model).")
        if data is not None:
            given = {name: value for name, value in (("batch_size", batch_size),
                                                     ("sequence_length", sequence_length))
                     if value is not None}
            if given:
                name, value = next(iter(given.items()))
                raise errors.InvalidArgumentError(
                    f"{name}: the batch of data=(x, y) has its own shapes; got {name}={value!r} "
                    f"with data. Leave {name} out, or leave data out for a made-up batch of "
                    f"that {name}.")
        elif batch_size is None:
            batch_size = EXPLAINED_BATCH_SIZE
        if batch_size is not None:
            _validate.check_batch_size(batch_size)
        _validate.check_bool(release_gradients_early, "release_gradients_early")
        keras_checks.check_trainable(ys, keras_flavour.flavour_of(ys), "explain")
        return keras_tracing.trace_training_step(
            ys, lambda loss, weights: explain(loss, weights, checkpoints),
            batch_size=batch_size, sequence_length=sequence_length, data=data,
            release_gradients_early=release_gradients_early)
    for name, value in (("batch_size", batch_size), ("sequence_length", sequence_length),
                        ("data", data)):
        if value is not None:
            raise errors.InvalidArgumentError(
                f"{name}: sizes the training step of a Keras model passed as ys; a loss "
                f"tensor's shapes are its graph's. Got {name}={value!r:.60} with ys={ys!r:.80}. "
                "Leave it out, or build the loss for the batch you mean.")
    if release_gradients_early:
        raise errors.InvalidArgumentError(
            "release_gradients_early: applies to explain(model), the plan of a Keras model's "
            "training step; the gradients of a loss tensor are planned as used up at once. "
            "Leave it out, or pass the model.")
    if xs is None:
        raise errors.InvalidArgumentError(
            "xs: expected the tensors or variables to differentiate with respect to (or a "
            f"Keras model as the first argument), got None with ys={ys!r:.80}.")
    prepared = api.prepare(ys, xs, grad_ys, checkpoints, tf_gradients_kwargs)
    ctx = prepared.selection
    model = ctx.model
    plan = prepared.plan
    decision = selection.decide_schedule(ctx, prepared.checkpoints, plan)
    sched = schedule_lib.of_plan(model, plan)
    top = set(sched.top)
    levels = [LevelReport(level.number, len(level.nodes), len(nodes),
                          sum(model.size_bytes[v] for v in nodes),
                          _depth(model, sched, level.nodes))
              for level in sched.levels
              for nodes in [sched.recomputed_by(level.nodes)]]
    chosen = sorted(plan.chosen or ())
    kept = plan.kept
    # The model's costs are FLOPs, whatever the planner's own cost measure; a node replayed at
    # depth d counts d times.
    peak, recompute_flops = memory_model.plan_peak_and_cost(model, plan)
    # A loop recomputed inside runs its body once more (its own FLOPs, not in the plan's).
    recompute_flops += sum(model.cost_of(v) for v, op in enumerate(ctx.region)
                           if op in ctx.recomputed_loops)
    return PlanReport(
        checkpoints=checkpoints,
        forward_ops=len(ctx.region),
        checkpoint_names=tuple(t.name for i in chosen for t in ctx.region[i].outputs),
        kept_anyway=len(kept) - len(chosen),
        kept_bytes=sum(model.size_bytes[v] for v in kept),
        top_segment_ops=len(sched.top),
        levels=tuple(lv for lv in levels if lv.recomputed_ops),
        predicted_peak_bytes=peak,
        predicted_plain_peak_bytes=memory_model.plain_peak_bytes(ctx.plain_model),
        unknown_dimensions=ctx.unknown_dimensions,
        recompute_flops=recompute_flops,
        forward_flops=model.forward_cost(),
        budget_bytes=plan.budget_bytes,
        rewrite=decision.rewrite,
        planner=plan.planner,
        plan_reason=plan.reason,
        schedule_reason=decision.reason,
        scratch_bytes=decision.scratch_bytes,
        decided_plan_peak_bytes=decision.plan_peak_bytes,
        decided_plain_peak_bytes=decision.plain_peak_bytes,
        assumed_batch_size=ctx.assumed_batch_size,
        recomputed_loops=tuple((op.name, p.unroll) for op, p in ctx.recomputed_loops.items()),
        # Stateful ops that are not kept anyway are the replayable-by-exposure ones.
        replayed_stateful_ops=tuple(
            op.name for v, op in enumerate(ctx.region) if v not in top
            and op not in ctx.must_keep and not tf_graph.is_replayable(op)),
    )


@tf.autograph.experimental.do_not_convert
def predicted_plain_peak_bytes(ys, xs, **tf_gradients_kwargs) -> int:
    """The static memory model's peak for plain ``tf.gradients(ys, xs)`` (adds no op)."""
    prepared = api.prepare(ys, xs, None, [], tf_gradients_kwargs, select=False)
    return memory_model.plain_peak_bytes(prepared.selection.model)
