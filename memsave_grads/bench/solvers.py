"""Solver comparison on small graphs: the greedy heuristic against the exact solvers.

Four graphs of at most 200 forward ops, built from raw TensorFlow ops (no Keras, so the tests
can use them): a tanh chain, a residual MLP, a DenseNet block (concatenated features) and two
Transformer blocks (attention + MLP, pre-norm). For budgets between the smallest feasible peak
and tf.gradients' peak, every solver plans; :func:`comparison_table` prints their recompute
costs side by side, relative to the best plan any of them found.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Mapping, Sequence

import tensorflow as tf

from memsave_grads import api
from memsave_grads.bench import models
from memsave_grads.core import budgets
from memsave_grads import errors
from memsave_grads.core import memory_model
from memsave_grads.core import plan as plan_lib
from memsave_grads.core import solvers
from memsave_grads.core.solvers import greedy
from memsave_grads.core.solvers import problem as problem_lib

#: This module's messages (progress lines, per graph): a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

#: Budgets as fractions of tf.gradients' predicted peak.
FRACTIONS = models.SOLVER_FRACTIONS
COMPARED_SOLVERS = ("greedy", "dp", "milp")


def _weight(shape, seed):
    fan_in = shape[-2] if len(shape) > 1 else shape[0]
    return tf.Variable(tf.random.stateless_normal(shape, [seed, 7], stddev=1 / math.sqrt(fan_in)))


def tanh_chain(depth: int = 30, width: int = 256, batch: int = 64):
    x = tf.Variable(tf.random.stateless_normal([batch, width], [0, 0]), trainable=False)
    weights = [_weight([width, width], i) for i in range(depth)]
    h = x
    for w in weights:
        h = tf.tanh(h @ w)
    return tf.reduce_mean(h * h), weights


def residual_mlp(depth: int = 32, width: int = 256, batch: int = 64):
    x = tf.Variable(tf.random.stateless_normal([batch, width], [0, 0]), trainable=False)
    weights = [_weight([width, width], i) for i in range(depth)]
    h = x
    for w in weights:
        h = h + 0.5 * tf.tanh(h @ w)
    return tf.reduce_mean(h * h), weights


def densenet_block(layers: int = 8, growth: int = 16, batch: int = 8, image: int = 16):
    x = tf.Variable(tf.random.stateless_normal([batch, image, image, 2 * growth], [0, 0]),
                    trainable=False)
    features, weights = [x], []
    for i in range(layers):
        h = tf.nn.relu(tf.concat(features, axis=-1)) if len(features) > 1 else tf.nn.relu(x)
        channels = h.shape[-1]
        w1, w2 = _weight([1, 1, channels, 4 * growth], 2 * i), _weight([3, 3, 4 * growth, growth],
                                                                       2 * i + 1)
        weights += [w1, w2]
        h = tf.nn.relu(tf.nn.conv2d(h, w1, 1, "SAME"))
        features.append(tf.nn.conv2d(h, w2, 1, "SAME"))
    out = tf.concat(features, axis=-1)
    return tf.reduce_mean(out * out), weights


def transformer_blocks(blocks: int = 2, batch: int = 4, sequence: int = 64, d_model: int = 64,
                       heads: int = 4):
    x = tf.Variable(tf.random.stateless_normal([batch, sequence, d_model], [0, 0]),
                    trainable=False)
    weights = []
    head = d_model // heads

    def norm(h):
        mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
        return (h - mean) * tf.math.rsqrt(var + 1e-5)

    def split(h):
        return tf.transpose(tf.reshape(h, [batch, sequence, heads, head]), [0, 2, 1, 3])

    h = x
    for i in range(blocks):
        wq, wk, wv, wo = (_weight([d_model, d_model], 10 * i + j) for j in range(4))
        w1, w2 = _weight([d_model, 4 * d_model], 10 * i + 5), _weight([4 * d_model, d_model],
                                                                      10 * i + 6)
        weights += [wq, wk, wv, wo, w1, w2]
        a = norm(h)
        q, k, v = (split(tf.einsum("bsd,de->bse", a, w)) for w in (wq, wk, wv))
        attention = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / math.sqrt(head))
        context = tf.reshape(tf.transpose(tf.matmul(attention, v), [0, 2, 1, 3]),
                             [batch, sequence, d_model])
        h = h + tf.einsum("bsd,de->bse", context, wo)
        m = tf.nn.gelu(tf.einsum("bsd,df->bsf", norm(h), w1))
        h = h + tf.einsum("bsf,fd->bsd", m, w2)
    return tf.reduce_mean(h * h), weights


#: name -> builder returning (loss, weights) inside a fresh graph.
SMALL_GRAPHS: dict[str, Callable] = {
    "tanh chain (30 layers)": tanh_chain,
    "residual MLP (32 blocks)": residual_mlp,
    "DenseNet block (8 layers)": densenet_block,
    "Transformer (2 blocks)": transformer_blocks,
}


def problem_for(loss, variables) -> problem_lib.BudgetProblem:
    """The budget problem ``gradients(loss, variables, checkpoints=Budget(...))`` would solve
    (budget 0: set it with ``with_budget``)."""
    prepared = api.prepare(loss, variables, None, [], {}, select=False)
    ctx = prepared.selection
    candidates, must_keep, not_replayed = ctx.node_sets()
    return problem_lib.BudgetProblem(ctx.model, 0, frozenset(must_keep), frozenset(candidates),
                                 frozenset(not_replayed))


@dataclasses.dataclass
class Row:
    graph: str
    forward_ops: int
    fraction: float
    budget_bytes: int
    plans: dict  # solver -> Plan, or the error's short text
    forward_cost: float = 0.0  # the forward pass's recompute cost (FLOPs), all nodes


def compare(graphs: Mapping[str, Callable] | None = None, fractions: Sequence[float] = FRACTIONS,
            solver_names: Sequence[str] = COMPARED_SOLVERS) -> list[Row]:
    """Every solver's plan for each graph (name -> builder of (loss, weights); default
    :data:`SMALL_GRAPHS`) at each budget, a fraction of tf.gradients' predicted peak."""
    rows = []
    chosen = SMALL_GRAPHS if graphs is None else graphs
    for i, (name, build) in enumerate(chosen.items(), 1):
        _LOG.info("[%d/%d] %s: %s at %s ...", i, len(chosen), name, ", ".join(solver_names),
                  ", ".join(f"{f:.0%}" for f in fractions))
        graph = tf.Graph()
        with graph.as_default():
            problem = problem_for(*build())
        plain = memory_model.plain_peak_bytes(problem.graph)
        forward = problem.graph.forward_cost()
        for fraction in fractions:
            budget = int(fraction * plain)
            row = Row(name, problem.graph.num_nodes, fraction, budget, {}, forward)
            for solver in solver_names:
                try:
                    row.plans[solver] = solvers.solve(problem.with_budget(budget), solver)
                except errors.InfeasibleBudgetError as e:
                    smallest = budgets.format_bytes(e.min_feasible_bytes)
                    row.plans[solver] = f"infeasible (min {smallest})"
            rows.append(row)
    return rows


def best_cost(row: Row) -> float | None:
    costs = [p.recompute_cost for p in row.plans.values() if isinstance(p, plan_lib.Plan)]
    return min(costs) if costs else None


def comparison_table(rows: Sequence[Row], solver_names: Sequence[str] = COMPARED_SOLVERS) -> str:
    header = ["graph", "ops", "budget"] + [f"{s} cost (x best)" for s in solver_names] + \
        [f"{s} s" for s in solver_names]
    lines = ["| " + " | ".join(header) + " |",
             "|---|---:|---:|" + "---:|" * (2 * len(solver_names))]
    for row in rows:
        best = best_cost(row)
        cells = [row.graph, str(row.forward_ops),
                 f"{row.fraction:.0%} = {budgets.format_bytes(row.budget_bytes)}"]
        times = []
        for solver in solver_names:
            plan = row.plans.get(solver)
            if isinstance(plan, plan_lib.Plan):
                ratio = plan.recompute_cost / best if best else 1.0
                cells.append(f"{plan.recompute_cost:.3g} ({ratio:.2f}x)"
                             + (" opt" if plan.optimal else ""))
                times.append(f"{plan.solve_seconds:.2f}")
            else:
                cells.append(str(plan))
                times.append("-")
        lines.append("| " + " | ".join(cells + times) + " |")
    return "\n".join(lines)


def network_table(rows: Sequence[Row]) -> str:
    """Greedy's plans on networks: recomputed FLOPs as a share of the forward pass, planning
    seconds and the bound on plans scored (``greedy.plan_limit``)."""
    lines = ["| network | ops | budget | greedy recomputes (of forward) | seconds "
             "| plans at most |", "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        plan = row.plans["greedy"]
        cells = [row.graph, str(row.forward_ops),
                 f"{row.fraction:.0%} = {budgets.format_bytes(row.budget_bytes)}"]
        if isinstance(plan, plan_lib.Plan):
            nested = f" ({plan.planner}, {plan.levels} levels)" if plan.levels > 1 else ""
            cells += [f"{plan.recompute_cost / row.forward_cost:.1%}{nested}",
                      f"{plan.solve_seconds:.2f}"]
        else:
            cells += [str(plan), "-"]
        cells.append(str(greedy.plan_limit(row.forward_ops)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


_GREEDY_BOUND = (f"at most {greedy.GREEDY_MAX_PLANS} plans scored once one fits, fewer past "
                 f"{greedy.GREEDY_REPLAYED_NODES // greedy.GREEDY_MAX_PLANS} ops")

NOTES = f"""cost: recomputed FLOPs of the plan (static shapes), and its ratio to the cheapest
plan any solver found for that budget; "opt": the solver proved its plan optimal (milp: over
all kept sets, under the replay; dp: only over plans made of cuts, under its decomposed peak).
budget: a fraction of tf.gradients' predicted peak. greedy is the default solver (fast DP
seeds, cut search, fill;
{_GREEDY_BOUND}); dp plans cuts exactly under a decomposed peak (then checked by the replay);
milp searches kept sets under a valid relaxation of the replay's peak, excluding plans the
replay rejects until the best plan found meets its lower bound (design note "budget
solvers")."""

NETWORK_NOTES = f"""greedy recomputes: the plan's recomputed FLOPs (static shapes) as a share of
the forward pass's. budget: a fraction of tf.gradients' predicted peak. seconds: planning wall
time on this machine. plans at most: the solver's bound on plans scored (each a replay of the
memory model), which makes its plan independent of the machine's speed (greedy.plan_limit:
{_GREEDY_BOUND})."""
