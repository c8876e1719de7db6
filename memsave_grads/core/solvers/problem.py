"""The planning problem every budget solver receives, and how its plans are scored.

One contract (design note "budget solvers"): a :class:`BudgetProblem` in (graph model, budget,
what may or must be kept), a :class:`~memsave_grads.core.plan.Plan` out. Every solver scores
plans with the same static models, so their answers are comparable:

* **peak**: :func:`memory_model.plan_peak_bytes`, the replay of forward + backward in bytes
  (computed by ``fast_replay``, which gives the same number faster);
* **recompute cost**: the sum of :meth:`ForwardGraph.cost_of` over the nodes the rewrite
  recomputes (FLOPs from static shapes by default; seconds when calibrated from a profile with
  ``budgets.calibrated_costs``). Each node is recomputed at most once (design note "single
  owner"), so the cost is a sum over nodes, not over segments.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Iterable

from memsave_grads import errors
from memsave_grads.core import budgets
from memsave_grads.core import fast_replay
from memsave_grads.core import graph as graph_lib
from memsave_grads.core import plan as plan_lib
from memsave_grads.core import planners


@dataclasses.dataclass(frozen=True)
class BudgetProblem:
    """What a solver receives: the graph model, the budget, and what may or must be kept.

    Attributes:
      graph: the forward region (its ``costs`` are the recompute costs).
      budget_bytes: the predicted peak may not exceed this.
      must_keep: nodes kept whatever the plan (stateful ops, intermediate ``xs``).
      candidates: nodes a plan may keep (``must_keep`` included implicitly).
      not_replayed: kept nodes whose segment is never copied (stateful ops).
      plain_peak_bytes: plain tf.gradients' predicted peak, where it is not the graph's own:
        a graph whose loops are modelled with their bodies recomputed inside (the rewrite does
        that, tf.gradients would not: design note "control flow and calls"). Fractional
        budgets are of it, and errors state it; None: the graph's plain peak.
      deadline_seconds: how long the anytime solvers (``"dp"``, ``"milp"``) may search before
        they answer with the best plan found; None: each solver's default.
    """

    graph: graph_lib.ForwardGraph
    budget_bytes: int
    must_keep: frozenset = frozenset()
    candidates: frozenset | None = None
    not_replayed: frozenset = frozenset()
    plain_peak_bytes: int | None = None
    deadline_seconds: float | None = None

    def __post_init__(self):
        if self.candidates is None:
            object.__setattr__(self, "candidates", frozenset(range(self.graph.num_nodes)))
        object.__setattr__(self, "must_keep", frozenset(self.must_keep))
        object.__setattr__(self, "candidates", frozenset(self.candidates) | self.must_keep)
        object.__setattr__(self, "not_replayed", frozenset(self.not_replayed))

    def with_budget(self, budget_bytes: int) -> "BudgetProblem":
        return dataclasses.replace(self, budget_bytes=int(budget_bytes))


def score(problem: BudgetProblem, kept: Iterable[int],
          stop_above_bytes: int | None = None) -> tuple[frozenset, int, float]:
    """Close ``kept`` (single ownership, ``must_keep`` added) and return it with its predicted
    peak and recompute cost (the replay's, through ``fast_replay``: the same numbers, a plan
    in a few milliseconds on thousands of ops; design note "planning cost").
    ``stop_above_bytes``: as in ``FastReplay.score`` (a peak above it may be a lower bound)."""
    replayer = fast_replay.replayer(problem.graph, problem.not_replayed)
    closed, owned = replayer.closed_owners(set(kept) | problem.must_keep)
    peak, cost = replayer.score_owned(closed, owned, stop_above_bytes=stop_above_bytes)
    return closed, peak, cost


def infeasible(problem: BudgetProblem, smallest_peak_bytes: int,
               solver: str) -> errors.InfeasibleBudgetError:
    """The error for a budget no plan meets, stating the smallest predicted peak reached."""
    plain_bytes = (problem.plain_peak_bytes if problem.plain_peak_bytes is not None
                   else fast_replay.plain_peak_bytes(problem.graph))
    error = errors.InfeasibleBudgetError(
        f"checkpoints: the budget of {budgets.format_bytes(problem.budget_bytes)} "
        f"({problem.budget_bytes} bytes) is below the smallest peak the solver found: "
        f"{budgets.format_bytes(smallest_peak_bytes)} "
        f"({smallest_peak_bytes} bytes, {_share(smallest_peak_bytes, plain_bytes)} of plain "
        f"tf.gradients' {budgets.format_bytes(plain_bytes)}; static memory model, "
        f"solver {solver!r}). "
        + (f"Raise the budget to at least that "
           f"({_as_budget(smallest_peak_bytes, plain_bytes, solver)}), or reduce the batch size."
           if smallest_peak_bytes < plain_bytes else
           "No plan it found peaks below plain tf.gradients here, so no budget helps: use "
           "tf.gradients for this graph (fallback='warn' does), or reduce the batch size."))
    error.min_feasible_bytes = smallest_peak_bytes
    error.budget_bytes = problem.budget_bytes
    error.plain_peak_bytes = plain_bytes
    return error


def _as_budget(nbytes: int, plain_bytes: int, solver: str) -> str:
    """The smallest feasible budget as the user would write it: the smallest whole percentage
    of tf.gradients' peak that resolves (``Budget.resolve_bytes``) to at least ``nbytes``,
    with the solver that found it."""
    suffix = "" if solver == budgets.DEFAULT_SOLVER else f":{solver}"
    percent = -(-100 * nbytes // plain_bytes) if plain_bytes > 0 else 101
    while percent <= 100 and budgets.Budget(fraction=percent / 100).resolve_bytes(
            plain_bytes) < nbytes:
        percent += 1  # int(fraction * plain) may round a byte below
    if percent > 100:  # a fraction is at most 1: no plan peaks below tf.gradients here
        return f"checkpoints=Budget(bytes={nbytes}, solver={solver!r})"
    return (f"checkpoints=\"budget:{percent}%{suffix}\", or "
            f"Budget(bytes={nbytes}, solver={solver!r})")


def _share(nbytes: int, plain_bytes: int) -> str:
    return f"{nbytes / plain_bytes:.1%}" if plain_bytes > 0 else "n/a"


class OutOfPlans(Exception):
    """A scorer scored as many plans as it may, and it has a plan that fits."""


class Scorer:
    """Scores plans once each (a replay is the expensive step) and remembers the best fit.

    ``max_plans`` bounds the search by work, not by the clock: scoring a new plan once that
    many are scored raises :class:`OutOfPlans`, but only once some plan fits (the search stops,
    the best plan stands). So a graph always gets the same plan, however busy the machine
    (design note "budget solvers").
    """

    def __init__(self, problem: BudgetProblem, max_plans: int | float = math.inf):
        self.problem = problem
        self.max_plans = max_plans
        #: Plans scored in full: kept (as asked) -> (closed kept set, peak, cost).
        self.cache: dict[frozenset, tuple[frozenset, int, float]] = {}
        #: Plans that :meth:`fits` found over the budget before their replay ended (their
        #: peak is not known exactly): scored all the same, they count towards ``max_plans``,
        #: so the search scores the plans it scored before (design note "planning cost").
        self.over_budget: set[frozenset] = set()
        self.best: tuple[frozenset, int, float] | None = None

    @property
    def scored(self) -> int:
        """How many distinct plans were scored (in full or until they passed the budget)."""
        return len(self.cache) + len(self.over_budget)

    def _count_new_plan(self) -> None:
        if self.best is not None and self.scored >= self.max_plans:
            raise OutOfPlans()

    def _record(self, key: frozenset, result: tuple[frozenset, int, float]) -> None:
        self.cache[key] = result
        _, peak, cost = result
        if peak <= self.problem.budget_bytes and (
                self.best is None or (cost, peak) < (self.best[2], self.best[1])):
            self.best = result

    def __call__(self, kept) -> tuple[frozenset, int, float]:
        key = frozenset(kept)
        if key not in self.cache:
            if key in self.over_budget:  # counted when fits() scored it
                self.over_budget.discard(key)
            else:
                self._count_new_plan()
            self._record(key, score(self.problem, key))
        return self.cache[key]

    def fits(self, kept) -> bool:
        """Whether the plan's predicted peak fits the budget: the replay stops once its peak
        passes the budget (``FastReplay.score``'s ``stop_above_bytes``), the same answer."""
        key = frozenset(kept)
        budget = self.problem.budget_bytes
        if key in self.cache:
            return self.cache[key][1] <= budget
        if key in self.over_budget:
            return False
        self._count_new_plan()
        result = score(self.problem, key, stop_above_bytes=budget)
        if result[1] > budget:
            self.over_budget.add(key)
            return False
        self._record(key, result)
        return True

    def plan(self, solver: str, started: float, optimal: bool = False) -> plan_lib.Plan:
        if self.best is None:
            # The "memory" plan, the lowest single-level peak: the minimum the error states,
            # the same whatever the budget (the plans scored depend on it), and a budget of
            # it is met by that plan.
            problem = self.problem
            lowest = planners.frontier_cuts(problem.graph, problem.must_keep, problem.candidates,
                                            problem.not_replayed)
            _, smallest, _ = self(lowest.kept if lowest is not None else problem.must_keep)
            if self.best is None:
                raise infeasible(self.problem, smallest, solver)
        kept, peak, cost = self.best
        reason = (f"the plan that recomputes least among those it scored whose predicted peak "
                  f"fits the budget{' (proven optimal in its search space)' if optimal else ''}")
        return plan_lib.Plan(kept, self.problem.not_replayed, planner=solver, reason=reason,
                             predicted_peak_bytes=peak, recompute_cost=cost, optimal=optimal,
                             solve_seconds=time.perf_counter() - started,
                             budget_bytes=self.problem.budget_bytes)
