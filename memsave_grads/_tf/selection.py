"""Turn a ``checkpoints=`` argument into a plan (``core.plan.Plan``), and decide whether to run it.

Strategies are looked up in :data:`STRATEGIES`; each takes a :class:`SelectionContext` and
returns ops, or (the planners) a whole plan; :func:`make_plan` closes either into the plan the
rewrite runs. The argument's form was checked by ``_validate`` already; what needs the graph
(a tensor of another graph, a pattern that matches nothing) is checked here, still before any
op is added, so a bad argument never leaves a half-rewritten graph behind. Then the never-worse
rule (:func:`decide_schedule`) compares the plan's predicted peak with plain tf.gradients'.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Callable, Iterable, Sequence

import tensorflow as tf

from memsave_grads._tf import function_ops
from memsave_grads._tf import graph as tf_graph
from memsave_grads._tf import ordering
from memsave_grads.core import budgets
from memsave_grads.core import fast_replay
from memsave_grads import errors
from memsave_grads.core.checkpoints import ParsedCheckpoints
from memsave_grads.core import graph as graph_lib
from memsave_grads.core import op_types
from memsave_grads.core import memory_model
from memsave_grads.core import plan as plan_lib
from memsave_grads.core import policies
from memsave_grads.core import solvers
from memsave_grads.core.solvers import problem as problem_lib

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

COLLECTION_NAME = "checkpoints"


@dataclasses.dataclass
class SelectionContext:
    """What a strategy may look at: the region between xs and ys and its TF-free model."""

    graph: tf.Graph
    region: list[tf.Operation]
    xs: list[tf.Tensor]
    ys: list[tf.Tensor]
    must_keep: set[tf.Operation]
    #: The gradients of xs stay alive until an optimizer applies them all (ForwardGraph).
    gradients_held: bool = False
    #: Loops of the region whose bodies the plan recomputes inside, with how (``loops.chosen``:
    #: op -> ``loops.LoopPlan``): the model counts what they store so; the rewrite replaces
    #: their bodies before it runs.
    recomputed_loops: dict = dataclasses.field(default_factory=dict)
    _model: graph_lib.ForwardGraph | None = None
    _plain_model: graph_lib.ForwardGraph | None = None
    _workspace: list[int] | None = None
    _needs_gradient: set | None = None
    _unknown_dimensions: bool | None = None
    _node_sets: tuple | None = None

    @property
    def model(self) -> graph_lib.ForwardGraph:
        if self._model is None:
            model = tf_graph.to_forward_graph(
                self.region, self.xs, self.ys, self.gradients_held,
                function_facts=function_ops.gradient_facts)
            self._plain_model = model
            exposed = [_exposed_bytes(op) if op not in self.must_keep else 0
                       for op in self.region]
            if any(exposed):
                model = dataclasses.replace(model, exposed_bytes=tuple(exposed))
            if self.recomputed_loops:
                model = dataclasses.replace(model, internal_saved_bytes=tuple(
                    self.recomputed_loops[op].saved_bytes if op in self.recomputed_loops
                    else model.internal_saved(i) for i, op in enumerate(self.region)))
            self._model = model
        return self._model

    @property
    def plain_model(self) -> graph_lib.ForwardGraph:
        """The model of plain tf.gradients: :attr:`model`, the loops' bodies as they are."""
        if self._plain_model is None:
            _ = self.model
        return self._plain_model

    @property
    def unknown_dimensions(self) -> bool:
        """Some forward output's size is partly guessed: an unknown dimension that no assumed
        batch size stands for counts as 1 (tf_graph.has_unsized_dimensions)."""
        if self._unknown_dimensions is None:
            sizes = self.model.size_bytes
            self._unknown_dimensions = any(
                tf_graph.has_unsized_dimensions(op.outputs[0].shape)
                for i, op in enumerate(self.region) if sizes[i] and op.outputs)
        return self._unknown_dimensions

    @property
    def assumed_batch_size(self) -> int | None:
        """The examples an unknown batch dimension of this region counts as
        (tf_graph.assumed_batch_size), or None: none assumed, or every shape is known."""
        examples = tf_graph.current_assumed_batch_size()
        if examples is None:
            return None
        return examples if any(op.outputs and op.outputs[0].shape.rank
                               and None in op.outputs[0].shape.as_list()
                               for op in self.region) else None

    @property
    def workspace_bytes(self) -> list[int] | None:
        """Scratch bytes each region op's gradient kernels allocate (memory_model.
        conv2d_gradient_workspace_bytes), or None where sizes are per unknown dimension: the
        scratch does not grow with the batch, so it cannot be added to sizes per example."""
        if self._workspace is None:
            self._workspace = [] if self.unknown_dimensions else [
                _conv2d_workspace_bytes(op, self._differentiable) for op in self.region]
        return self._workspace or None

    def _differentiable(self, t: tf.Tensor) -> bool:
        """Whether the backward pass differentiates ``t`` (it is an x or computed from one)."""
        if self._needs_gradient is None:
            self._needs_gradient = ({t.ref() for t in self.xs}
                                    | {out.ref() for op in self.region for out in op.outputs})
        return t.ref() in self._needs_gradient

    def node_sets(self) -> tuple[list[int], list[int], list[int]]:
        """(candidates, must_keep, not_replayed) as node indices of :attr:`model` (fresh lists
        of one computation: a planner, the plan cache and the never-worse rule each ask)."""
        if self._node_sets is None:
            self._node_sets = self._index_node_sets()
        return tuple(list(nodes) for nodes in self._node_sets)

    def _index_node_sets(self) -> tuple[list[int], list[int], list[int]]:
        index = {op: i for i, op in enumerate(self.region)}
        excluded = {index[op] for op in self.endpoint_ops if op in index}
        candidates = [i for i in range(len(self.region)) if i not in excluded]
        must_keep = [index[op] for op in self.must_keep if op in index]
        # A loop recomputed inside is differentiated where it ran: a copy would not carry the
        # recomputation's gradient, which refers to the loop's own body (design note "control
        # flow and calls").
        custom = tf_graph.recomputing_custom_gradients(self.region)
        not_replayed = [i for i in must_keep if not tf_graph.is_replayable(self.region[i])
                        or self.region[i] in self.recomputed_loops
                        or self.region[i] in custom]
        return candidates, must_keep, not_replayed

    @property
    def endpoint_ops(self) -> set[tf.Operation]:
        """Ops producing xs or ys: never chosen by a strategy (they are kept or seeded anyway)."""
        return {t.op for t in self.xs} | {t.op for t in self.ys}


def _exposed_bytes(op: tf.Operation) -> int:
    """Bytes a stateful cond or call outputs in addition where a plan replays it
    (``function_ops.exposure_plan``, ``function_ops.exposure_bytes``); 0 for other ops."""
    if not function_ops.is_function_op(op) or tf_graph.is_replayable(op):
        return 0
    bodies = function_ops.exposure_plan(op)
    if not bodies:
        return 0
    return function_ops.exposure_bytes(op, bodies, ordering.xla_in_effect(op.graph))


#: Convolutions oneDNN runs (other dtypes, such as float64 and float16, fall back to Eigen).
ONEDNN_CONV_DTYPES = frozenset({tf.float32, tf.bfloat16})


def _conv2d_workspace_bytes(op: tf.Operation, differentiable: Callable[[tf.Tensor], bool]) -> int:
    """Scratch of ``op``'s gradient kernels when it is a 2-D convolution with static shapes
    run by TensorFlow's Eigen CPU kernels, else 0 (memory_model.conv2d_gradient_workspace_bytes;
    the oneDNN kernels allocate none: tf_graph.onednn_in_effect). On a GPU, cuDNN's own
    workspaces are not modelled; this estimate stands in for them."""
    if op.type != "Conv2D" or (tf_graph.onednn_in_effect()
                               and op.outputs[0].dtype in ONEDNN_CONV_DTYPES):
        return 0
    image, kernel = op.inputs[0], op.inputs[1]
    output_shape, kernel_shape = op.outputs[0].shape, kernel.shape
    if (tf_graph.has_unsized_dimensions(output_shape) or output_shape.rank != 4
            or not kernel_shape.is_fully_defined()):
        return 0
    channels_first = op.get_attr("data_format") == b"NCHW"
    height, width = (output_shape[2:4] if channels_first else output_shape[1:3]).as_list()
    if height is None or width is None:  # the assumed batch stood in for a spatial dimension
        return 0
    rows, cols, in_channels, out_channels = kernel_shape.as_list()
    return memory_model.conv2d_gradient_workspace_bytes(
        output_pixels=height * width, window_pixels=rows * cols, in_channels=in_channels,
        out_channels=out_channels, itemsize=op.outputs[0].dtype.size,
        filter_gradient=differentiable(kernel), input_gradient=differentiable(image))


def _no_checkpoints(strategy: str, why: str, remedy: str) -> errors.NoCheckpointsFoundError:
    return errors.NoCheckpointsFoundError(
        f"checkpoints={strategy!r}: {why}. {remedy}")


def select_collection(ctx: SelectionContext) -> set[tf.Operation]:
    """Tensors the user added to the graph collection ``"checkpoints"`` (off-path ones ignored)."""
    collected = [t for t in ctx.graph.get_collection(COLLECTION_NAME) if isinstance(t, tf.Tensor)]
    region_set = set(ctx.region)
    chosen = {t.op for t in collected if t.op in region_set} - ctx.endpoint_ops
    if not chosen:
        raise _no_checkpoints(
            "collection", f"the graph collection {COLLECTION_NAME!r} holds {len(collected)} "
            f"tensor(s), none of them between xs and ys",
            f"Add forward tensors with tf.compat.v1.add_to_collection({COLLECTION_NAME!r}, t), "
            "or pass checkpoints='memory' to choose them automatically.")
    return chosen


def select_speed(ctx: SelectionContext) -> set[tf.Operation]:
    """Outputs of expensive ops (matmul, convolution, einsum), chosen by op type."""
    chosen = {op for op in ctx.region if tf_graph.is_expensive(op)}
    chosen -= ctx.endpoint_ops
    if not chosen:
        raise _no_checkpoints(
            "speed", "the forward graph between xs and ys has no matmul/convolution/einsum op",
            "Use checkpoints='memory', or pass a list of tensors to keep.")
    return chosen


def select_memory(ctx: SelectionContext) -> plan_lib.Plan:
    """Cuts where the live frontier is small, placed to minimise the predicted peak, then the
    plan that recomputes least at that peak (solvers.memory_plan); works through skip
    connections of any DAG."""
    candidates, must_keep, not_replayed = ctx.node_sets()
    plan = solvers.memory_plan(ctx.model, must_keep, candidates, not_replayed)
    if plan is None and ctx.recomputed_loops:
        # Nothing to cut, but the loops recompute inside (design note "control flow and
        # calls"): the plan keeps what is kept anyway.
        return keep_ops(ctx, (), "memory").replace(
            reason="no position to cut; the loops' bodies are recomputed inside")
    if plan is None:
        raise _no_checkpoints(
            "memory", f"no cut of the {len(ctx.region)} forward ops between xs and ys "
            "keeps only tensors that may be checkpoints (the graph is a single op, or ys are "
            "read by other forward ops)",
            "Pass checkpoints='speed', or a list of tensors to keep, or use tf.gradients.")
    return plan


def select_budget(ctx: SelectionContext, budget: budgets.Budget) -> plan_lib.Plan:
    """The plan that recomputes least while its predicted peak fits ``budget`` (solvers)."""
    if budget.bytes is not None and ctx.unknown_dimensions:
        raise errors.InvalidArgumentError(
            f"checkpoints: {budget.describe()} is in bytes, but the forward graph has tensors "
            "with unknown dimensions (such as a None batch size), so their sizes are unknown. "
            "Say the batch it runs (with memsave_grads.assume_batch_size(256): ...), give the "
            "inputs a static shape, or pass a fraction: Budget(fraction=0.5) or 'budget:50%'.")
    model = ctx.model
    if budget.op_seconds:
        model = dataclasses.replace(model, costs=budgets.calibrated_costs(
            model.names, model.costs, budget.op_seconds))
    candidates, must_keep, not_replayed = ctx.node_sets()
    # A fraction is of plain tf.gradients' peak, the loops' bodies as they are.
    plain_bytes = fast_replay.plain_peak_bytes(ctx.plain_model)
    problem = problem_lib.BudgetProblem(
        graph=model, budget_bytes=budget.resolve_bytes(plain_bytes),
        must_keep=frozenset(must_keep), candidates=frozenset(candidates),
        not_replayed=frozenset(not_replayed), plain_peak_bytes=plain_bytes)
    return solvers.solve(problem, budget.solver)


#: Each strategy returns the ops to keep, or (planners) a whole plan.
STRATEGIES: dict[str, Callable[[SelectionContext], set[tf.Operation] | plan_lib.Plan]] = {
    "collection": select_collection,
    "speed": select_speed,
    "memory": select_memory,
}


def _describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def select_explicit(ctx: SelectionContext, items: Sequence) -> set[tf.Operation]:
    """A list of tensors and/or name patterns (see policies.matches_tensor for the rule).

    ``items`` has the form ``_validate.check_checkpoints`` accepts (graph tensors and
    well-formed patterns, at least one); here each is checked against the graph: a tensor of
    ys' graph, between xs and ys; a pattern that matches some op there.
    """
    region_set = set(ctx.region)
    x_refs = {t.ref() for t in ctx.xs}
    y_refs = {t.ref() for t in ctx.ys}
    chosen: set[tf.Operation] = set()
    for position, item in enumerate(items):
        where = f"checkpoints[{position}]"
        if isinstance(item, str):
            matched = {op for op in ctx.region
                       if any(policies.matches_tensor(item, op.name, t.value_index)
                              for t in op.outputs)} - ctx.endpoint_ops
            if not matched:
                raise errors.CheckpointNotOnPathError(
                    f"{where}: the name pattern {item!r} matches no forward op between xs and ys. "
                    f"Check the names with [op.name for op in graph.get_operations()] (in a "
                    f"Keras step: a layer's name, then the op's type, as in '*block3*/Tanh'; "
                    f"docs/keras.md), or use a tensor instead of a pattern where you call "
                    f"gradients yourself.")
            chosen |= matched
            continue
        if item.graph is not ctx.graph:
            raise errors.InvalidArgumentError(
                f"{where}: the tensor {item.name!r} belongs to another graph than ys. Pass "
                "checkpoints from the graph (or tf.function) that computes ys.")
        if item.ref() in y_refs or item.ref() in x_refs:
            which = "ys" if item.ref() in y_refs else "xs"
            raise errors.InvalidArgumentError(
                f"{where}: the tensor {item.name!r} is one of {which}; a checkpoint must lie "
                f"strictly between xs and ys. Remove it from checkpoints.")
        if not (item.dtype.is_floating or item.dtype.is_complex):
            raise errors.InvalidArgumentError(
                f"{where}: the tensor {item.name!r} has dtype {item.dtype.name}; only floating "
                "point activations carry gradients, so keeping it saves nothing. Remove it.")
        if item.op not in region_set:
            raise errors.CheckpointNotOnPathError(
                f"{where}: the tensor {item.name!r} is not on any path from xs to ys, so keeping "
                "it cannot save memory. Choose a tensor that depends on xs and that ys depend on.")
        chosen.add(item.op)
    return chosen


def select(ctx: SelectionContext, checkpoints: ParsedCheckpoints) -> set[tf.Operation]:
    """Dispatch on the kind of ``checkpoints``: a budget, a strategy name, or a list of
    tensors/patterns, as ``_validate.check_checkpoints`` (the one owner of those checks and
    their messages) parsed it before any graph was read."""
    if checkpoints.budget is not None:
        return select_budget(ctx, checkpoints.budget)
    if checkpoints.strategy is not None:
        return STRATEGIES[checkpoints.strategy](ctx)
    return select_explicit(ctx, checkpoints.items)


#: The planners' plans by everything they depend on (:func:`_plan_key`), so that a step
#: traced again (Keras traces its training step once per input signature, and again after
#: ``compile``, a calibration or ``train_on_batch`` of another size) is not planned again
#: (design note "planning cost"). A few, most recent kept.
_PLANS: collections.OrderedDict = collections.OrderedDict()
PLAN_CACHE_SIZE = 16


def forget_plans() -> None:
    """Drop the kept plans and the never-worse rule's kept predictions, so that the next
    gradients call plans as a first trace does (``build-time`` measures first builds)."""
    _PLANS.clear()
    _PREDICTED_PEAKS.clear()


def _plan_key(ctx: SelectionContext, checkpoints: ParsedCheckpoints):
    """What a planner's plan depends on: the graph model (sizes, costs, flags, names), the
    node sets, the strategy or budget; None where nothing is cached (explicit tensors, the
    graph collection and ``"speed"`` choose without planning; a budget with measured op
    seconds plans with costs the model does not hold)."""
    budget = checkpoints.budget
    if budget is None and checkpoints.strategy != "memory":
        return None
    if budget is not None and budget.op_seconds:
        return None
    candidates, must_keep, not_replayed = ctx.node_sets()
    # The models without their memo: the key outlives this call, its planners' caches need
    # not. A budget's fraction is of plain tf.gradients' model, which differs from the
    # planners' where loops are recomputed inside.
    strategy = repr(budget) if budget is not None else checkpoints.strategy
    plain = (graph_lib.without_memo(ctx.plain_model)
             if budget is not None and ctx.plain_model is not ctx.model else None)
    return (graph_lib.without_memo(ctx.model), plain, strategy, tuple(candidates),
            tuple(sorted(must_keep)), tuple(sorted(not_replayed)))


def make_plan(ctx: SelectionContext, checkpoints: ParsedCheckpoints) -> plan_lib.Plan:
    """The plan ``checkpoints`` makes on ``ctx``: what the strategy chose (or the planner's
    plan), plus the ops kept anyway, closed for single ownership (design note "single owner":
    ``graph.close_segments``), in node numbers of ``ctx.model``. A planner's plan for the same
    model, node sets and strategy is planned once (:data:`_PLANS`)."""
    key = _plan_key(ctx, checkpoints)
    if key is not None and key in _PLANS:
        _PLANS.move_to_end(key)
        _LOG.debug("memsave_grads: the plan of this graph (%d forward ops) was made before; "
                   "not planning again", len(ctx.region))
        return _PLANS[key]
    plan = _make_plan(ctx, checkpoints)
    if key is not None:
        _PLANS[key] = plan
        while len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return plan


def _make_plan(ctx: SelectionContext, checkpoints: ParsedCheckpoints) -> plan_lib.Plan:
    chosen = select(ctx, checkpoints)
    _, must_keep, _ = ctx.node_sets()
    if isinstance(chosen, plan_lib.Plan):  # planners close their plans themselves
        return chosen.replace(chosen=chosen.kept - set(must_keep))
    return keep_ops(ctx, chosen, checkpoints.planner)


def keep_ops(ctx: SelectionContext, ops: Iterable[tf.Operation], planner: str) -> plan_lib.Plan:
    """The plan that keeps ``ops`` (and the ops kept anyway), closed for single ownership."""
    index = {op: i for i, op in enumerate(ctx.region)}
    _, must_keep, not_replayed = ctx.node_sets()
    chosen = {index[op] for op in ops if op in index}
    kept = graph_lib.close_segments(ctx.model, chosen | set(must_keep))
    return plan_lib.Plan(kept, not_replayed, chosen=frozenset(chosen), planner=planner)


# --------------------------------------------------------------------------------------------
# The never-worse rule: keep tf.gradients' schedule where a plan is not predicted to beat it
# --------------------------------------------------------------------------------------------

#: A chosen plan replaces tf.gradients' schedule only where the memory model, scratch of the
#: gradient kernels included, predicts a peak at most this fraction of tf.gradients' (docs/
#: design.md, note "never worse"): the executor's order alone moves a peak by up to 10%.
NEVER_WORSE_PEAK_FRACTION = 0.9
#: Switch for tests of the rewrite itself on graphs too small for any plan to pay off.
NEVER_WORSE_RULE = True


@dataclasses.dataclass(frozen=True)
class ScheduleDecision:
    """Whether ``gradients()`` runs the plan or plain ``tf.gradients`` (the never-worse rule).

    Attributes:
      rewrite: True to recompute as planned, False to call the original tf.gradients.
      reason: one sentence for logs and ``explain()``.
      plan_peak_bytes / plain_peak_bytes: the predictions compared (memory model plus the
        gradient kernels' scratch), None where the decision needed none.
      scratch_bytes: the largest scratch of one backward step in those predictions.
    """

    rewrite: bool
    reason: str
    plan_peak_bytes: int | None = None
    plain_peak_bytes: int | None = None
    scratch_bytes: int = 0


#: The never-worse rule's predictions by everything they depend on (the models by value, the
#: plan, the scratch), kept as the plans are (:data:`_PLANS`): a step traced again is not
#: replayed again (design note "planning cost"). A few, most recent kept.
_PREDICTED_PEAKS: collections.OrderedDict = collections.OrderedDict()


def _predicted_peaks(ctx: SelectionContext, plan: plan_lib.Plan,
                     scratch_factor: int = 1) -> tuple[int, int, int]:
    """(plan, plain tf.gradients, largest scratch): the memory model's peaks, with the gradient
    kernels' scratch (the plan's multiplied by ``scratch_factor``). With unknown dimensions
    sizes are per unit of them (per example), so terms that do not grow with the batch,
    variables' gradients and scratch, are left out of both: they would decide for a batch of
    one. Predicted once per model, plan and scratch (:data:`_PREDICTED_PEAKS`)."""
    workspace = ctx.workspace_bytes
    if plan.children:  # nested plans (revolve): not kept
        return _replayed_peaks(ctx, plan, workspace, scratch_factor)
    key = (graph_lib.without_memo(ctx.model),
           graph_lib.without_memo(ctx.plain_model) if ctx.plain_model is not ctx.model
           else None, ctx.unknown_dimensions, tuple(workspace) if workspace else None,
           scratch_factor, plan.kept, plan.not_replayed)
    if key in _PREDICTED_PEAKS:
        _PREDICTED_PEAKS.move_to_end(key)
        return _PREDICTED_PEAKS[key]
    peaks = _replayed_peaks(ctx, plan, workspace, scratch_factor)
    _PREDICTED_PEAKS[key] = peaks
    while len(_PREDICTED_PEAKS) > PLAN_CACHE_SIZE:
        _PREDICTED_PEAKS.popitem(last=False)
    return peaks


def _replayed_peaks(ctx: SelectionContext, plan: plan_lib.Plan, workspace: list[int] | None,
                    scratch_factor: int) -> tuple[int, int, int]:
    """:func:`_predicted_peaks`, replayed."""
    scratch = max(workspace) if workspace else 0
    plan_workspace = [scratch_factor * w for w in workspace] if workspace else None
    model, plain_model = ctx.model, ctx.plain_model
    if ctx.unknown_dimensions:
        model = dataclasses.replace(model, param_bytes=())
        plain_model = dataclasses.replace(plain_model, param_bytes=())
    if plan.children:  # nested levels: the full replay
        peak, _ = memory_model.plan_peak_and_cost(model, plan, plan_workspace)
    else:
        peak = fast_replay.replayer(model, plan.not_replayed, plan_workspace).peak_bytes(
            plan.kept)
    return peak, fast_replay.plain_peak_bytes(plain_model, workspace), scratch


def decide_schedule(ctx: SelectionContext, checkpoints: ParsedCheckpoints,
                    plan: plan_lib.Plan) -> ScheduleDecision:
    """The never-worse rule (docs/design.md, note "never worse"); gradients() warns once
    where it keeps the plain schedule.

    Automatic strategies (``"memory"``, ``"speed"``, budgets) and ``"collection"`` keep plain
    tf.gradients' schedule unless the plan is predicted to peak at most
    :data:`NEVER_WORSE_PEAK_FRACTION` of its peak, and no higher than it even where the
    allocator holds twice each scratch buffer of the plan; so does a strategy that chose
    nothing beyond the tensors kept anyway. An explicit list of tensors or patterns is what the
    user asked for: it is honoured, with a warning where it is predicted to peak higher.
    """
    if not NEVER_WORSE_RULE:
        return ScheduleDecision(True, "the never-worse rule is switched off")
    explicit = checkpoints.explicit
    _, must_keep, _ = ctx.node_sets()
    if (not explicit and not (plan.chosen or frozenset()) - set(must_keep)
            and not ctx.recomputed_loops):
        return _logged(checkpoints, ScheduleDecision(
            False, "the strategy keeps nothing beyond the tensors kept anyway (variable reads, "
            "stateful ops, xs), so its plan is plain tf.gradients"))
    peak, plain, scratch = _predicted_peaks(ctx, plan)
    # One unit for the numbers compared (a KiB peak against a MiB one read as larger).
    predicted = (f"predicted peak {budgets.format_bytes(peak, 'MiB')} against tf.gradients' "
                 f"{budgets.format_bytes(plain, 'MiB')}"
                 + (f", gradient kernels' scratch of up to {budgets.format_bytes(scratch, 'MiB')} "
                    "included" if scratch else "")
                 + (", per unit of the unknown dimensions, variables' gradients left out"
                    if ctx.unknown_dimensions else ""))
    if explicit:
        if peak > plain:
            _LOG.warning(
                "memsave_grads: the explicit checkpoints are predicted to peak above plain "
                "tf.gradients (%s); keeping them as asked. Pass checkpoints='memory' to choose "
                "them automatically.", predicted)
        return _logged(checkpoints, ScheduleDecision(
            True, f"explicit checkpoints are kept as given ({predicted})", peak, plain, scratch))
    if peak > NEVER_WORSE_PEAK_FRACTION * plain:
        return _logged(checkpoints, ScheduleDecision(
            False, f"the plan is not predicted to peak at least "
            f"{1 - NEVER_WORSE_PEAK_FRACTION:.0%} below tf.gradients ({predicted})", peak,
            plain, scratch))
    # BFC hands out a free chunk whole unless it is at least twice the request: a scratch
    # buffer may hold up to twice its size (traced: 15.6 and 20.2 MiB requests held 30.5 and
    # 34.0 MiB), which at a small batch is more than the activations a plan saves.
    if scratch:
        doubled, _, _ = _predicted_peaks(ctx, plan, scratch_factor=2)
        if doubled > plain:
            return _logged(checkpoints, ScheduleDecision(
                False, f"with each scratch buffer held twice over, as the allocator may, the "
                f"plan is predicted to peak at {budgets.format_bytes(doubled, 'MiB')}, above "
                f"tf.gradients ({predicted})", peak, plain, scratch))
    return _logged(checkpoints, ScheduleDecision(
        True, f"the plan is predicted to beat tf.gradients ({predicted})", peak, plain, scratch))


def _logged(checkpoints: ParsedCheckpoints, decision: ScheduleDecision) -> ScheduleDecision:
    _LOG.debug("memsave_grads: checkpoints=%s: %s; %s", _describe(checkpoints.given),
               decision.reason, "recomputing as planned" if decision.rewrite else
               "keeping plain tf.gradients' schedule (the original tf.gradients computes the "
               "gradients)")
    return decision


def forced_keep(region: Sequence[tf.Operation], xs: Sequence[tf.Tensor],
                recomputed_loops: Iterable[tf.Operation] = ()) -> set[tf.Operation]:
    """Ops kept whatever the strategy: they cannot be replayed, or they produce an ``x``.

    A stateful op (random draw, variable read, iterator) would give different values if run
    again, so it is never copied; its in-region inputs are kept too, so that its gradient can
    be taken through the original op from kept tensors alone. So is a loop whose body is
    recomputed inside (``recomputed_loops``): its gradient replays each iteration, so a copy
    of it would only replay the loop once more. So is the ``IdentityN`` of a
    ``tf.recompute_grad`` block (``graph.recomputing_custom_gradients``): a copy's gradient
    would still be the block's own, which runs it again from the original arguments, so they
    stay alive whatever a plan keeps (design note "custom gradients").
    """
    recomputed_loops = set(recomputed_loops)
    region_set = set(region)
    x_refs = {x.ref() for x in xs}
    keep = set()
    custom = tf_graph.recomputing_custom_gradients(region)
    for op in region:
        if tf_graph.uses_v1_control_flow(op):
            raise errors.UnsupportedGraphError(
                f"The forward op {op.name!r} ({op.type}) uses TF1 control flow "
                "(tf.compat.v1.disable_control_flow_v2 or disable_v2_behavior was called). "
                "memsave_grads rewrites control flow v2 only: call "
                "tf.compat.v1.enable_control_flow_v2() before building the model (and "
                "tf.compat.v1.enable_resource_variables() under disable_v2_behavior: v1 "
                "layers' updates of reference variables refuse control flow v2), or use "
                "tf.gradients for this graph.")
        if any(t.ref() in x_refs for t in op.outputs):
            keep.add(op)
        if op in recomputed_loops or op in custom or (
                not tf_graph.is_replayable(op) and function_ops.exposure_plan(op) is None):
            # A stateful cond or call that exposes its state is replayed instead (design
            # note "control flow and calls").
            keep.add(op)
            keep.update(t.op for t in op.inputs if t.op in region_set)
    return keep
