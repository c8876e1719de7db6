"""Turn a ``checkpoints=`` argument into the set of forward ops whose outputs are kept.

Strategies are looked up in :data:`STRATEGIES`; each takes a :class:`SelectionContext` and
returns ops. Validation happens here, before anything is added to the graph, so a bad argument
never leaves a half-rewritten graph behind.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import tensorflow as tf

from memsave_grads import _tf_graph
from memsave_grads import budgets
from memsave_grads import errors
from memsave_grads import graph as graph_lib
from memsave_grads import memory_model
from memsave_grads import planners
from memsave_grads import policies
from memsave_grads import solvers

COLLECTION_NAME = "checkpoints"


@dataclasses.dataclass
class SelectionContext:
    """What a strategy may look at: the region between xs and ys and its TF-free model."""

    graph: tf.Graph
    region: list[tf.Operation]
    xs: list[tf.Tensor]
    ys: list[tf.Tensor]
    must_keep: set[tf.Operation]
    _model: graph_lib.ForwardGraph | None = None
    #: Set by planners that make one (``"memory"``, budgets), for reports.
    plan: planners.CutPlan | budgets.BudgetPlan | None = None

    @property
    def model(self) -> graph_lib.ForwardGraph:
        if self._model is None:
            self._model = _tf_graph.to_forward_graph(self.region, self.xs, self.ys)
        return self._model

    @property
    def unknown_dimensions(self) -> bool:
        """Some forward output has an unknown dimension (its size counts it as 1)."""
        return any(op.outputs[0].shape.rank is None or None in op.outputs[0].shape.as_list()
                   for i, op in enumerate(self.region)
                   if self.model.size_bytes[i] and op.outputs)

    def node_sets(self) -> tuple[list[int], list[int], list[int]]:
        """(candidates, must_keep, not_replayed) as node indices of :attr:`model`."""
        index = {op: i for i, op in enumerate(self.region)}
        excluded = {index[op] for op in self.endpoint_ops if op in index}
        candidates = [i for i in range(len(self.region)) if i not in excluded]
        must_keep = [index[op] for op in self.must_keep if op in index]
        not_replayed = [i for i in must_keep if not _tf_graph.is_replayable(self.region[i])]
        return candidates, must_keep, not_replayed

    @property
    def endpoint_ops(self) -> set[tf.Operation]:
        """Ops producing xs or ys: never chosen by a strategy (they are kept or seeded anyway)."""
        return {t.op for t in self.xs} | {t.op for t in self.ys}


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
    chosen = {op for op in ctx.region if policies.is_expensive_op_type(op.type)}
    chosen -= ctx.endpoint_ops
    if not chosen:
        raise _no_checkpoints(
            "speed", "the forward graph between xs and ys has no matmul/convolution/einsum op",
            "Use checkpoints='memory', or pass a list of tensors to keep.")
    return chosen


def select_memory(ctx: SelectionContext) -> set[tf.Operation]:
    """Cuts where the live frontier is small, placed to minimise the predicted peak
    (planners.frontier_cuts); works through skip connections of any DAG."""
    candidates, must_keep, not_replayed = ctx.node_sets()
    plan = planners.frontier_cuts(ctx.model, must_keep, candidates, not_replayed)
    if plan is None:
        raise _no_checkpoints(
            "memory", f"no cut of the {len(ctx.region)} forward ops between xs and ys "
            "keeps only tensors that may be checkpoints (the graph is a single op, or ys are "
            "read by other forward ops)",
            "Pass checkpoints='speed', or a list of tensors to keep, or use tf.gradients.")
    ctx.plan = plan
    return {ctx.region[i] for i in plan.kept} - set(ctx.must_keep)


def select_budget(ctx: SelectionContext, budget: budgets.Budget) -> set[tf.Operation]:
    """The plan that recomputes least while its predicted peak fits ``budget`` (solvers)."""
    if budget.bytes is not None and ctx.unknown_dimensions:
        raise errors.InvalidArgumentError(
            f"checkpoints: {budget.describe()} is in bytes, but the forward graph has tensors "
            "with unknown dimensions (such as a None batch size), so their sizes are unknown. "
            "Give the inputs a static shape, or pass a fraction: Budget(fraction=0.5) or "
            "'budget:50%'.")
    model = ctx.model
    if budget.op_seconds:
        model = dataclasses.replace(model, flops=budgets.calibrated_costs(
            model.names, model.flops, budget.op_seconds))
    candidates, must_keep, not_replayed = ctx.node_sets()
    problem = budgets.BudgetProblem(
        graph=model, budget_bytes=budget.resolve_bytes(memory_model.plain_peak_bytes(model)),
        must_keep=frozenset(must_keep), candidates=frozenset(candidates),
        not_replayed=frozenset(not_replayed))
    plan = solvers.solve(problem, budget.solver)
    ctx.plan = plan
    return {ctx.region[i] for i in plan.kept} - set(ctx.must_keep)


STRATEGIES: dict[str, Callable[[SelectionContext], set[tf.Operation]]] = {
    "collection": select_collection,
    "speed": select_speed,
    "memory": select_memory,
}


def _describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def select_explicit(ctx: SelectionContext, items: Sequence) -> set[tf.Operation]:
    """A list of tensors and/or name patterns (see policies.matches_tensor for the rule)."""
    region_set = set(ctx.region)
    x_refs = {t.ref() for t in ctx.xs}
    y_refs = {t.ref() for t in ctx.ys}
    chosen: set[tf.Operation] = set()
    for position, item in enumerate(items):
        where = f"checkpoints[{position}]"
        if isinstance(item, str):
            problem = policies.pattern_error(item)
            if problem:
                raise errors.InvalidArgumentError(
                    f"{where}: malformed name pattern {item!r}: {problem}. Patterns are "
                    "shell-style globs over op names ('block*/add') or tensor names "
                    "('block*/add:0').")
            matched = {op for op in ctx.region
                       if any(policies.matches_tensor(item, op.name, t.value_index)
                              for t in op.outputs)} - ctx.endpoint_ops
            if not matched:
                raise errors.CheckpointNotOnPathError(
                    f"{where}: the name pattern {item!r} matches no forward op between xs and ys. "
                    f"Check the names with [op.name for op in graph.get_operations()], or use a "
                    f"tensor instead of a pattern.")
            chosen |= matched
            continue
        if _tf_graph.is_resource_variable(item) or not isinstance(item, tf.Tensor):
            raise errors.InvalidTypeError(
                f"{where}: expected a tf.Tensor of the forward pass or a name pattern (str), "
                f"got {type(item).__name__}: {_describe(item)}. Pass the activation tensor.")
        if _tf_graph.is_eager_tensor(item):
            raise errors.InvalidTypeError(
                f"{where}: got an eager tensor (a value, not part of a graph). Pass the graph "
                "tensor built in the same graph or tf.function as ys.")
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
    if not chosen:
        raise errors.InvalidArgumentError(
            "checkpoints: got an empty list. Pass at least one tensor or pattern, or a strategy "
            f"name ({', '.join(sorted(STRATEGIES))}).")
    return chosen


def select(ctx: SelectionContext, checkpoints) -> set[tf.Operation]:
    """Dispatch on the form of ``checkpoints``: strategy name, or a list of tensors/patterns."""
    if isinstance(checkpoints, budgets.Budget):
        return select_budget(ctx, checkpoints)
    if budgets.is_budget_string(checkpoints):
        return select_budget(ctx, budgets.Budget.parse(checkpoints))
    if isinstance(checkpoints, str):
        strategy = STRATEGIES.get(checkpoints)
        if strategy is None:
            raise errors.UnknownStrategyError(
                f"checkpoints: unknown strategy {checkpoints!r}. Expected one of "
                f"{sorted(STRATEGIES)}, a budget ('budget:4GiB', 'budget:50%'), a list of "
                "tensors, or a list of name patterns (a single pattern must be wrapped in a "
                "list).")
        return strategy(ctx)
    if isinstance(checkpoints, tf.Tensor):
        checkpoints = [checkpoints]
    if isinstance(checkpoints, (list, tuple)):
        return select_explicit(ctx, checkpoints)
    raise errors.InvalidTypeError(
        f"checkpoints: expected a strategy name ({', '.join(sorted(STRATEGIES))}), a "
        f"memsave_grads.Budget, a list of tensors or a list of name patterns, got "
        f"{type(checkpoints).__name__}: "
        f"{_describe(checkpoints)}.")


def single_owner(ctx: SelectionContext, kept: set[tf.Operation]) -> set[tf.Operation]:
    """``kept`` plus the ops that would otherwise be recomputed in two segments
    (graph.close_segments)."""
    index = {op: i for i, op in enumerate(ctx.region)}
    closed = graph_lib.close_segments(ctx.model, [index[op] for op in kept if op in index])
    return kept | {ctx.region[i] for i in closed}


def forced_keep(region: Sequence[tf.Operation], xs: Sequence[tf.Tensor]) -> set[tf.Operation]:
    """Ops kept whatever the strategy: they cannot be replayed, or they produce an ``x``.

    A stateful op (random draw, variable read, iterator) would give different values if run
    again, so it is never copied; its in-region inputs are kept too, so that its gradient can
    be taken through the original op from kept tensors alone.
    """
    region_set = set(region)
    x_refs = {x.ref() for x in xs}
    keep = set()
    for op in region:
        if _tf_graph.uses_v1_control_flow(op):
            raise errors.UnsupportedGraphError(
                f"The forward op {op.name!r} ({op.type}) uses TF1 control flow "
                "(tf.compat.v1.disable_control_flow_v2 or disable_v2_behavior was called). "
                "memsave_grads rewrites control flow v2 only: call "
                "tf.compat.v1.enable_control_flow_v2() before building the model, or use "
                "tf.gradients for this graph.")
        if any(t.ref() in x_refs for t in op.outputs):
            keep.add(op)
        if not _tf_graph.is_replayable(op):
            keep.add(op)
            keep.update(t.op for t in op.inputs if t.op in region_set)
    return keep
