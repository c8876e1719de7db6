"""Budget solvers: one contract, a ``problem.BudgetProblem`` in, a ``core.plan.Plan`` out.

Every solver minimises the recompute cost of a plan subject to its predicted peak fitting the
budget, and every one scores plans with the same static models (``problem.score``: the memory
replay and the per-node cost), so their answers are comparable (design note "budget solvers"):

* :func:`solve_greedy` (``"greedy"``, the default), in phases, keeping the cheapest plan that
  fits: (1) fast DP seeds: :func:`dp.dp_cuts` on at most ``GREEDY_DP_POSITIONS`` positions
  with bucketed labels, recomputing segments whole or keeping their costly nodes, each plan
  checked by the replay and filled; (2) Chen et al.'s budget search generalised to frontier
  cuts: for a grid of segment caps it places cuts as ``"memory"`` does, then drops trailing
  cuts (a larger top segment is never recomputed) while the plan fits, and fills the cheapest
  plans and those with the most budget left (keeps recomputed nodes that cost most per byte,
  a prefix of that order); (3) fills that skip nodes that do not fit. Once a plan fits, it
  scores at most ``greedy.plan_limit(nodes)`` plans (256, fewer on graphs of over 1600 ops):
  a bound on work, not time, so one graph always gets one plan.
* :func:`solve_dp` (``"dp"``): an exact dynamic program over cut positions, for graphs that
  are chains of segments (every frontier small). It finds the cheapest set of cuts under a
  decomposed (segment by segment) peak, then checks the plan with the replay, tightening the
  budget if the replay disagrees.
* :func:`solve_milp` (``"milp"``): an exact mixed-integer program over *kept sets* (not only
  cuts), for small general graphs, with HiGHS through ``scipy.optimize.milp``. Its memory rows
  are a *valid relaxation* of the replay (for every kept set, each is at most the replayed
  peak; see :func:`_milp_model`), so its optimum is a lower bound of the true optimum. Each
  solution is replayed and, if rejected, excluded (a no-good cut); the plan is proven optimal
  (``optimal=True``) once the best plan replayed costs no more than the MILP's bound. Used to
  validate the heuristic.

These three plan a single recomputation level (each segment replayed once from kept tensors),
so for them the smallest feasible budget is the ``"memory"`` plan's peak; ``"revolve"``
(``revolve``) plans nested levels, and :func:`solve` hands it any budget below that.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

from memsave_grads import errors
from memsave_grads.core import budgets
from memsave_grads.core import fast_replay
from memsave_grads.core import graph as graph_lib
from memsave_grads.core import memory_model
from memsave_grads.core import plan as plan_lib
from memsave_grads.core import planners
from memsave_grads.core.solvers import problem as problem_lib
from memsave_grads.core.solvers.dp import solve_dp
from memsave_grads.core.solvers.greedy import cheapest_within, solve_greedy
from memsave_grads.core.solvers.milp import milp_lower_bound, solve_milp
from memsave_grads.core.solvers.revolve import lowest_peak_within_cost, solve_revolve

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

__all__ = ["SOLVERS", "solve", "memory_plan", "tradeoff", "solve_greedy", "solve_dp", "solve_milp",
           "solve_revolve", "milp_lower_bound"]

SOLVERS: dict[str, Callable[[problem_lib.BudgetProblem], plan_lib.Plan]] = {
    "greedy": solve_greedy,
    "dp": solve_dp,
    "milp": solve_milp,
    "revolve": solve_revolve,  # nested levels (design note "multi-level")
}


def solve(problem: problem_lib.BudgetProblem,
          solver: str = budgets.DEFAULT_SOLVER) -> plan_lib.Plan:
    """``SOLVERS[solver]``; a budget below every single-level plan goes to ``"revolve"``, whose
    nested levels reach lower peaks. If it fails too, the error states the lower of the two
    smallest peaks: revolve's (``revolve.smallest_peak_plan``, which counts the single-level
    ``"memory"`` plan too), one number whatever the budget asked, met by a plan at that
    budget."""
    try:
        plan = SOLVERS[solver](problem)
    except errors.InfeasibleBudgetError as single_level:
        if solver == "revolve":
            raise
        try:
            plan = SOLVERS["revolve"](problem)
        except errors.InfeasibleBudgetError as nested:
            # The lower of the two minimums (revolve's counts the single-level plan: never
            # higher).
            if nested.min_feasible_bytes <= single_level.min_feasible_bytes:
                raise nested from single_level
            raise single_level from None
        _LOG.info("memsave_grads: the budget of %d bytes is below every single-level plan "
                  "(%s: smallest %d); planned %d recomputation levels with 'revolve' "
                  "(peak %d, cost %.3g)", problem.budget_bytes, solver,
                  single_level.min_feasible_bytes,
                  plan.levels,
                  plan.predicted_peak_bytes, plan.recompute_cost)
    _LOG.debug("memsave_grads: %s: budget %d bytes -> peak %d, cost %.3g, %.2f s",
               solver, problem.budget_bytes, plan.predicted_peak_bytes, plan.recompute_cost,
               plan.solve_seconds)
    return plan


def memory_plan(graph: graph_lib.ForwardGraph, must_keep: Iterable[int],
                candidates: Iterable[int], not_replayed: Iterable[int] = (),
                nested: bool = True) -> plan_lib.Plan | None:
    """The ``"memory"`` strategy: the lowest predicted peak, for the least recomputation found.

    First :func:`planners.frontier_cuts` finds the lowest peak; then, with that peak as the
    budget, :func:`greedy.cheapest_within` looks for a plan that recomputes less (fewer FLOPs)
    without peaking higher (design note "frontier cuts"). ``None`` where no position can be
    cut; a plan that predicts no saving is returned as ``frontier_cuts`` made it. With
    ``nested`` (default) nested levels replace the single-level plan where they predict clearly
    less for at most one forward pass recomputed (design note "nested by default").
    """
    started = time.perf_counter()
    lowest = planners.frontier_cuts(graph, must_keep, candidates, not_replayed)
    if lowest is None or lowest.predicted_peak_bytes >= fast_replay.plain_peak_bytes(graph):
        return lowest
    problem = problem_lib.BudgetProblem(
        graph=graph, budget_bytes=lowest.predicted_peak_bytes, must_keep=frozenset(must_keep),
        candidates=frozenset(candidates), not_replayed=frozenset(not_replayed))
    deeper = _nested_below(problem) if nested else None
    if deeper is not None:
        return deeper.replace(solve_seconds=time.perf_counter() - started)
    (kept, peak, cost), (_, _, lowest_cost) = cheapest_within(problem, lowest.kept)
    if cost >= lowest_cost:
        return lowest.replace(recompute_cost=lowest_cost,
                              solve_seconds=time.perf_counter() - started)
    _LOG.debug("memsave_grads: memory: the same peak (%d bytes) for %.3g of the cut "
               "plan's recomputation", peak, cost / lowest_cost)
    return lowest.replace(
        kept=kept, predicted_peak_bytes=peak, recompute_cost=cost, cuts=(),
        solve_seconds=time.perf_counter() - started,
        reason=f"{lowest.reason}; then, at that peak or lower, the plan that recomputes least "
               f"({cost / lowest_cost:.0%} of the cut plan's FLOPs)")


#: ``"memory"`` plans nested levels where they recompute at most this fraction of the forward
#: pass (one extra forward pass at most: the time of a single-level plan) ...
NESTED_COST_CAP_FRACTION = 1.0
#: ... and predict a peak at most this fraction of the single-level plan's (the model
#: under-predicts nested plans on wide frontiers: design note "multi-level").
NESTED_PEAK_FACTOR = 0.9
#: ... and copy at most this many forward passes, each level's copies of its kept nodes
#: included (``memory_model.copied_cost``; design note "nested by default"): the raw-op
#: Transformer's nested plan copies 1.04 (kept: 44 MiB under XLA, 50 single-level); a
#: tf.function per block 1.94 (refused: 1.6x step time for the single-level plan's peak).
NESTED_COPIED_COST_CAP_FRACTION = 1.25


def _nested_below(problem: problem_lib.BudgetProblem) -> plan_lib.Plan | None:
    """The nested plan of the lowest predicted peak that recomputes at most one forward pass,
    where it predicts a peak clearly below the single-level plan's (``problem.budget_bytes``);
    else None (design note "nested by default")."""
    cap = NESTED_COST_CAP_FRACTION * problem.graph.forward_cost()
    # Plans above the factor are refused below: their replays may stop once they pass it.
    found = lowest_peak_within_cost(problem, cap,
                                    peak_cap_bytes=int(NESTED_PEAK_FACTOR * problem.budget_bytes))
    if found is None or found[1] > NESTED_PEAK_FACTOR * problem.budget_bytes:
        return None
    cost, peak, plan = found
    copied_cap = NESTED_COPIED_COST_CAP_FRACTION * problem.graph.forward_cost()
    if memory_model.copied_cost(problem.graph, plan) > copied_cap:
        # Within the cap only without the levels' copies of their kept nodes (calls of a
        # block's function: each a whole block): nearly two forward passes after all.
        return None
    _LOG.debug("memsave_grads: memory: nested levels predict %d bytes against the single "
               "level's %d, for %.3g of the forward pass recomputed", peak,
               problem.budget_bytes, cost / problem.graph.forward_cost())
    return plan.replace(
        planner="memory", predicted_peak_bytes=peak, recompute_cost=cost,
        reason=f"nested levels ({plan.levels} deep): the lowest predicted peak the revolve DP "
               "found that recomputes at most one forward pass, "
               f"{peak / problem.budget_bytes:.0%} of the best single-level plan's")


def tradeoff(problem: problem_lib.BudgetProblem, points: int = 12,
             solver: str = budgets.DEFAULT_SOLVER) -> list[plan_lib.Plan]:
    """The Pareto front of predicted peak vs recompute cost: plans for ``points`` budgets from
    the smallest feasible peak to plain ``tf.gradients``' peak, dominated plans dropped."""
    low = planners.frontier_cuts(problem.graph, problem.must_keep, problem.candidates,
                                 problem.not_replayed)
    high = fast_replay.plain_peak_bytes(problem.graph)
    low_bytes = low.predicted_peak_bytes if low is not None else high
    plans = []
    for i in range(points):
        budget = low_bytes + (high - low_bytes) * i / max(points - 1, 1)
        try:
            plans.append(solve(problem.with_budget(int(budget)), solver))
        except errors.InfeasibleBudgetError:
            continue
    plans.sort(key=lambda p: (p.predicted_peak_bytes, p.recompute_cost))
    front = []
    for plan in plans:
        if not front or plan.recompute_cost < front[-1].recompute_cost:
            front.append(plan)
    return front

